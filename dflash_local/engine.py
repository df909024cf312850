"""The engine: load and validate a target/drafter pair, then generate text as a stream of events.

Every frontend (CLI, server, TUI, bench) uses Engine.generate and shows only what its events carry.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from . import _native, chat
from .gguf_file import read_gguf
from .policy import DraftPolicy
from .sampling import SamplingParams
from .stats import StatsTracker, StepStats, Summary
from .textstream import TextStream
from .validate import DraftSpec, check_pair, check_target


PREFILL_CHUNK = 512  # the native batch size


class ContextOverflowError(ValueError):
    """The prompt does not fit in the context window."""


class EngineBusyError(RuntimeError):
    """Another generation is running on this engine."""


@dataclass
class TextDelta:
    text: str


@dataclass
class Finished:
    text: str
    token_ids: list[int]
    summary: Summary


Event = TextDelta | StepStats | Finished

# An external drafter gets the tokens so far (prompt + generated, the newest last) and a draft length, and returns
# its proposed next tokens. Used for scripted drafters in tests and drafters that run outside llama.cpp.
ExternalDrafter = Callable[[list[int], int], list[int]]


def _file_type(info) -> str:
    from gguf import LlamaFileType

    ft = info.kv.get("general.file_type")
    try:
        return LlamaFileType(ft).name.removeprefix("MOSTLY_") if ft is not None else "unknown"
    except ValueError:
        return str(ft)


class Engine:
    def __init__(
        self,
        model: str | os.PathLike,
        draft: str | os.PathLike | None = None,
        *,
        n_ctx: int = 4096,
        n_gpu_layers: int = 0,
        n_threads: int | None = None,
        block_size: int | None = None,
        capture: str = "auto",
        draft_backend: str = "ggml",
        draft_device: str = "cpu",
        draft_policy: str = "auto",
        flash_attn: bool = False,
        repack: bool = False,
        verbose: bool = False,
    ):
        """capture: how target features are read: 'auto' (from the architecture), 'layer_api' or 'callback'.

        draft_backend: 'ggml' runs the drafter in llama.cpp; 'torch' runs it in PyTorch on draft_device (cuda, mps
        or cpu) beside the llama.cpp target.

        draft_policy: 'auto' drafts, at each step, the number of tokens a cost model expects to be fastest
        (policy.py); 'fixed' always drafts a full block.

        flash_attn and repack select faster CPU kernels for the target that round differently for a verify batch
        than for a single token, so greedy output may then differ from plain decoding where two tokens nearly tie.
        Both are off by default: verification is then bit-exact on CPUs.
        """
        if capture not in ("auto", "layer_api", "callback"):
            raise ValueError(f"capture must be auto, layer_api or callback, not {capture!r}")
        if draft_policy not in ("auto", "fixed"):
            raise ValueError(f"draft policy must be auto or fixed, not {draft_policy!r}")
        if draft_backend not in ("ggml", "torch"):
            raise ValueError(f"draft backend must be ggml or torch, not {draft_backend!r}")
        _native.set_verbose(verbose)
        self.target_info = read_gguf(model)
        check_target(self.target_info)
        self.draft_info = None  # the drafter GGUF's header; a z-lab checkpoint folder has none
        self.spec = None
        if draft and Path(draft).is_dir():
            if draft_backend != "torch":
                raise ValueError(f"{draft} is a checkpoint folder: run it with draft_backend='torch', or convert it "
                                 f"to GGUF for the llama.cpp drafter (dflash-local convert)")
        elif draft:
            self.draft_info = read_gguf(draft)
            self.spec = check_pair(self.target_info, self.draft_info)

        n_ctx_train = self.target_info.get("context_length") or n_ctx
        if n_ctx < 8:
            raise ValueError(f"n_ctx must be at least 8, got {n_ctx}")
        self.n_ctx = min(n_ctx, n_ctx_train)
        self.n_threads = n_threads or os.cpu_count() or 1
        self.draft_path = draft
        self.target = _native.Model(str(model), n_gpu_layers, repack)
        self.drafter = None  # the llama.cpp drafter
        self.torch_drafter = None
        if draft and draft_backend == "ggml":
            self.drafter = _native.Model(str(draft), n_gpu_layers, True)  # drafts need no bit-exactness
        elif draft:
            from .torch_drafter import TorchDraftBackend, pick_device

            self.torch_drafter = TorchDraftBackend.load(draft, model, pick_device(draft_device))
            sh = self.torch_drafter.model.shape
            self.spec = self.spec or DraftSpec(sh.target_layers, sh.block_size, sh.mask_token)

        layers = self.spec.layers if self.spec else []
        arch = self.target_info.arch
        use_layer_api = capture == "layer_api" or (capture == "auto" and _native.arch_records_layer_inputs(arch))
        self.session = _native.Session(
            self.target, self.drafter, layers, self.n_ctx, self.n_threads, use_layer_api, flash_attn
        )

        # Greedy verification reproduces plain decoding bit for bit only when every kernel rounds a verify batch row
        # exactly as it rounds a single token (see README, "Lossless")
        self.bit_exact = (
            not flash_attn
            and not repack
            and n_gpu_layers == 0
            and _native.cpu_matmul_batch_invariant()
        )
        trained = self.spec.block_size if self.spec else 1
        if block_size is not None and block_size < 1:
            raise ValueError(f"block size must be at least 1, got {block_size}")
        self.block_size = min(block_size or trained, trained)
        self.draft_policy = draft_policy
        self._policy: DraftPolicy | None = None  # learned acceptance and costs, kept across generations
        self._cached: list[int] = []  # the tokens in the target's KV cache, in order
        self._draft_valid = 0  # how many of them the drafter's cache holds features for
        self._lock = threading.Lock()

    # -- information ----------------------------------------------------------------------------------------------

    @property
    def has_drafter(self) -> bool:
        return self.drafter is not None or self.torch_drafter is not None

    def model_info(self) -> dict:
        """What a frontend shows about the loaded pair."""
        t = self.target_info
        info = {
            "target": {
                "path": str(t.path),
                "arch": t.arch,
                "quant": _file_type(t),
                "desc": self.target.desc,
                "size_bytes": self.target.size,
                "n_layer": self.target.n_layer,
                "n_embd": self.target.n_embd,
                "n_vocab": self.target.n_vocab,
            },
            "n_ctx": self.n_ctx,
            "n_threads": self.n_threads,
            "block_size": self.block_size,
            "feature_capture": "layer_api" if self.session.uses_layer_api else "callback",
            "bit_exact_verify": self.bit_exact,
            "gpu_offload": _native.supports_gpu_offload(),
            "drafter": None,
        }
        if self.torch_drafter is not None:
            info["draft_backend"] = f"torch ({self.torch_drafter.device})"
        elif self.drafter is not None:
            info["draft_backend"] = "ggml"
        if self.spec:
            d = self.draft_info
            info["drafter"] = {
                "path": str(self.draft_path),
                "arch": d.arch if d else "DFlashDraftModel (checkpoint)",
                "quant": _file_type(d) if d else "safetensors",
                "size_bytes": d.path.stat().st_size if d else 0,
                "n_layer": d.get("block_count") if d else self.torch_drafter.model.shape.n_layer,
                "target_layers": self.spec.layers,
                "trained_block_size": self.spec.block_size,
            }
        return info

    # -- prompts --------------------------------------------------------------------------------------------------

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        """Tokenize text; `special` parses control tokens and adds BOS only where the text lacks it."""
        if not special:
            return self.target.tokenize(text, True, False)
        bos = self.target.bos
        ids = self.target.tokenize(text, False, True)
        if self.target.meta("tokenizer.ggml.add_bos_token") == "true" and bos >= 0 and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def detokenize(self, ids: list[int]) -> str:
        return b"".join(self.target.piece(t) for t in ids).decode("utf-8", errors="replace")

    def chat_prompt(self, messages: list[dict]) -> str:
        template = self.target_info.kv.get("tokenizer.chat_template")
        bos = self.target.piece(self.target.bos).decode(errors="replace") if self.target.bos >= 0 else ""
        eos = self.target.piece(self.target.eos).decode(errors="replace") if self.target.eos >= 0 else ""
        return chat.render(messages, template, self.target_info.arch, bos, eos)

    def prompt_tokens(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        if (prompt is None) == (messages is None):
            raise ValueError("give either a prompt or chat messages")
        if messages is not None:
            ids = self.tokenize(self.chat_prompt(messages), special=True)
        else:
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string")
            ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx} (prompt plus at least one "
                f"generated token); shorten it or raise n_ctx"
            )
        return ids

    # -- generation -----------------------------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | None = None,
        messages: list[dict] | None = None,
        *,
        max_tokens: int = 256,
        stop: list[str] | tuple[str, ...] = (),
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        draft: bool = True,
        external_drafter: ExternalDrafter | None = None,
    ) -> Iterator[Event]:
        """Yield TextDelta, StepStats and, last, Finished. draft=False is the plain-decoding baseline."""
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if isinstance(stop, str):
            stop = [stop]
        if not all(isinstance(s, str) for s in stop):
            raise ValueError("stop must be a string or a list of strings")
        params = SamplingParams(temperature, top_k, top_p, min_p, seed)
        ids = self.prompt_tokens(prompt, messages)
        if not self._lock.acquire(blocking=False):
            raise EngineBusyError("another generation is running on this engine")
        try:
            yield from self._generate(ids, max_tokens, list(stop), params, draft, external_drafter)
        finally:
            self._lock.release()

    def _generate(self, ids, max_tokens, stop, params, draft, external_drafter) -> Iterator[Event]:
        s = self.session
        sampling = params.native()
        drafting = draft and (self.has_drafter or external_drafter is not None)
        policy = self._policy_for(self.block_size - 1 if drafting else 0)
        stream = TextStream(stop)
        tracker = StatsTracker(max(self.block_size, 2) if drafting else 1)
        out: list[int] = []  # emitted tokens
        produced: list[int] = []  # every token the target produced, also past a stop (they are in the cache)
        finish = None

        def emit(tok: int) -> str:
            nonlocal finish
            if self.target.is_eog(tok):
                finish = "eos"
                return ""
            out.append(tok)
            delta = stream.feed(self.target.piece(tok))
            if stream.stopped_by is not None:
                finish = "stop"
            elif len(out) >= max_tokens:
                finish = "length"
            return delta

        # reuse the cached prefix; at least one prompt token is decoded so that its logits exist
        n_cached = 0
        while n_cached < min(len(self._cached), len(ids) - 1) and self._cached[n_cached] == ids[n_cached]:
            n_cached += 1
        if drafting:
            n_cached = min(n_cached, self._draft_valid)
        s.set_capture(drafting)
        self._draft_valid = min(self._draft_valid, n_cached)
        td = self.torch_drafter if drafting and external_drafter is None else None
        try:
            t0 = time.perf_counter()
            s.truncate(n_cached)
            self._cached = ids[:n_cached]
            if td is None:
                first = s.prefill(ids[n_cached:], sampling, 0)
            else:
                # the torch drafter needs the features of every prompt position: prefill chunk by chunk
                td.crop(n_cached)
                for off in range(n_cached, len(ids), PREFILL_CHUNK):
                    first = s.prefill(ids[off : off + PREFILL_CHUNK], sampling, 0)
                    td.add(s.features(), off)
            prompt_ms = (time.perf_counter() - t0) * 1000
            self._cached = list(ids)
            produced.append(first)
            delta = emit(first)
            if delta:
                yield TextDelta(delta)
            last = first
            while finish is None:
                if s.n_past >= self.n_ctx:
                    finish = "context_full"
                    break
                t_step = time.perf_counter()
                want = min(policy.choose(), max_tokens - len(out) - 1)  # drafts past max_tokens would be wasted
                forced, torch_ms, p0 = None, 0.0, s.n_past
                if external_drafter is not None and want > 0:
                    forced = list(external_drafter(ids + produced, want))[:want]
                elif td is not None and want > 0:
                    forced = td.propose(last, want)
                    torch_ms = (time.perf_counter() - t_step) * 1000
                r = s.step(last, want, sampling, len(produced), forced)
                if td is not None:
                    t_add = time.perf_counter()
                    td.add(s.features()[: r.n_accepted + 1], p0)
                    torch_ms += (time.perf_counter() - t_add) * 1000
                self._cached = (ids + produced)[: s.n_past]
                produced.extend(r.tokens)
                text, n_out = "", len(out)
                for tok in r.tokens:
                    text += emit(tok)
                    if finish:
                        break
                last = r.tokens[-1]
                wall_ms = (time.perf_counter() - t_step) * 1000
                stats = StepStats(
                    step=len(tracker.steps),
                    n_drafted=len(r.draft),
                    n_accepted=r.n_accepted,
                    n_tokens=len(out) - n_out,
                    draft_ms=r.draft_ms + torch_ms,
                    verify_ms=r.verify_ms,
                    other_ms=max(wall_ms - r.draft_ms - torch_ms - r.verify_ms, 0.0),
                )
                tracker.add(stats)
                policy.update(stats.n_drafted, stats.n_accepted, stats.verify_ms, stats.draft_ms, r.sample_ms)
                if text:
                    yield TextDelta(text)
                yield stats
            tail = stream.flush()
            if tail:
                yield TextDelta(tail)
            summary = tracker.summary(
                finish_reason=finish,
                drafting=drafting,
                n_prompt=len(ids),
                n_cached=n_cached,
                n_generated=len(out),
                prompt_ms=prompt_ms,
            )
            yield Finished(stream.text, list(out), summary)
        finally:
            # whatever happened (a stop, an error, the consumer walking away), the cache record stays true
            self._cached = (ids + produced)[: s.n_past]
            if drafting:  # a torch drafter skipped for an external one did not follow: its context ends earlier
                tdr = self.torch_drafter
                self._draft_valid = s.n_past if tdr is None else min(s.n_past, tdr.n)

    def _policy_for(self, max_draft: int) -> DraftPolicy:
        adaptive = self.draft_policy == "auto"
        if max_draft == 0:
            return DraftPolicy(0)
        if self._policy is None or (self._policy.max_draft, self._policy.adaptive) != (max_draft, adaptive):
            self._policy = DraftPolicy(max_draft, adaptive)
        self._policy.new_text()
        return self._policy

    def complete(self, *args, **kwargs) -> Finished:
        """Run generate() to the end and return its Finished event."""
        for ev in self.generate(*args, **kwargs):
            if isinstance(ev, Finished):
                return ev
        raise RuntimeError("generation ended without a result")
