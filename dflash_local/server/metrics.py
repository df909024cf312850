"""Server counters in Prometheus' text exposition format."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.stats import Summary


@dataclass
class Metrics:
    requests: int = 0
    cancelled: int = 0  # requests whose client went away before the end
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    drafts: int = 0  # verify steps that had a draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)  # per block position
    slot_requests: dict[int, int] = field(default_factory=dict)  # completed requests per slot
    slot_tokens: dict[int, int] = field(default_factory=dict)  # generated tokens per slot

    def add(self, s: Summary, seconds: float, slot: int | None = None) -> None:
        if slot is not None:
            self.slot_requests[slot] = self.slot_requests.get(slot, 0) + 1
            self.slot_tokens[slot] = self.slot_tokens.get(slot, 0) + s.n_generated
        self.requests += 1
        self.prompt_tokens += s.n_prompt
        self.generated_tokens += s.n_generated
        self.seconds += seconds
        if s.drafting:
            self.drafts += s.steps
        self.draft_tokens += s.n_drafted
        self.accepted_tokens += s.n_accepted
        if len(self.accepted_at) < len(s.accepted_at):
            self.accepted_at += [0] * (len(s.accepted_at) - len(self.accepted_at))
        for k, n in enumerate(s.accepted_at):
            self.accepted_at[k] += n

    def render(self, gauges: dict[str, int] | None = None, counters: dict[str, int] | None = None) -> str:
        """The counters, `gauges` (slots_processing, requests_waiting: the runner's state now) and the runner's own
        `counters` (interrupted_rounds_total)."""
        rows = [
            ("requests_total", "Completed generation requests.", self.requests),
            ("cancelled_requests_total", "Requests stopped because the client went away.", self.cancelled),
            ("prompt_tokens_total", "Prompt tokens of completed requests.", self.prompt_tokens),
            ("generated_tokens_total", "Generated tokens.", self.generated_tokens),
            ("generation_seconds_total", "Wall time spent generating.", round(self.seconds, 6)),
            ("drafts_total", "Verify steps that checked a draft.", self.drafts),
            ("draft_tokens_total", "Tokens proposed by the drafter.", self.draft_tokens),
            ("accepted_tokens_total", "Drafted tokens accepted by the target.", self.accepted_tokens),
        ]
        out = []
        for name, help_, value in rows:
            out += [f"# HELP dflash_{name} {help_}", f"# TYPE dflash_{name} counter", f"dflash_{name} {value}"]
        name = "dflash_accepted_tokens_by_position_total"
        out += [f"# HELP {name} Accepted drafted tokens per block position (1 = first draft).", f"# TYPE {name} counter"]
        out += [f'{name}{{position="{k + 1}"}} {n}' for k, n in enumerate(self.accepted_at)]
        for name, help_, per_slot in (
            ("slot_requests_total", "Completed generation requests per slot.", self.slot_requests),
            ("slot_generated_tokens_total", "Generated tokens per slot.", self.slot_tokens),
        ):
            out += [f"# HELP dflash_{name} {help_}", f"# TYPE dflash_{name} counter"]
            out += [f'dflash_{name}{{slot="{k}"}} {n}' for k, n in sorted(per_slot.items())]
        helps = {"slots_processing": "Slots running a generation now.",
                 "requests_waiting": "Requests waiting for a free slot.",
                 "interrupted_rounds_total": "Batched steps given up for a new request's prompt, then run again."}
        for kind, values in (("gauge", gauges), ("counter", counters)):
            for name, value in (values or {}).items():
                out += [f"# HELP dflash_{name} {helps[name]}", f"# TYPE dflash_{name} {kind}", f"dflash_{name} {value}"]
        return "\n".join(out) + "\n"
