"""llama-server's own endpoints: POST /completion (a prompt of text, token ids or both mixed) and POST /infill (fill in
the middle, with the model's FIM tokens), in its shapes: `content`, `tokens`, `stop_type`, `stopping_word`, `timings`,
`generation_settings`, streamed as `data:` chunks that end with one whose `stop` is true (no [DONE])."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from ..engine.engine import Engine, Finished, TextDelta
from .errors import APIError
from .logprobs import native_logprobs
from .schema import REFUSED, GenerationRequest, timings_of
from .stream import KEEPALIVE, Running, frame, job_events

# what llama-server's native endpoints honour beyond the OpenAI ones
NATIVE = ("n_probs", "return_tokens")


class NativeRequest(GenerationRequest):
    """POST /completion's body: llama-server's fields (n_predict, n_probs, return_tokens, ...) over the shared ones."""

    prompt: str | list[int | str] = ""
    n_probs: int = Field(default=0, ge=0, le=20)  # the top tokens and their log-probabilities, per generated token
    return_tokens: bool = False

    refused: ClassVar[dict] = {name: v for name, v in REFUSED.items() if name not in NATIVE}

    def prompt_kwargs(self) -> dict:
        """Text parses control tokens and gets the BOS where the model wants one, as llama-server reads prompts."""
        parts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        return {"prompt": parts}

    def n_logprobs(self) -> int | None:
        return self.n_probs or None


class ExtraChunk(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str
    filename: str = "tmp"


class InfillRequest(NativeRequest):
    """POST /infill's body: the code before and after the cursor, other files for context (input_extra), and a
    prompt that goes right after the prefix (llama-server's order)."""

    input_prefix: str | list[int | str]
    input_suffix: str | list[int | str]
    input_extra: list[ExtraChunk] = []
    prompt: str = ""

    def infill_ids(self, engine: Engine, n_batch: int) -> list[int]:
        """The FIM prompt, laid out and cut as llama-server's format_prompt_infill: [repo name, then each extra chunk
        after a file separator] (the end of it that fits the context, less a batch and twice the request's n_predict),
        BOS, FIM_PRE, prefix (its last 3/4 of a batch), prompt, FIM_SUF, suffix (its first quarter of a batch, less
        the prompt), FIM_MID."""
        fim = engine.target.fim
        missing = [part for part, key in (("prefix", "pre"), ("suffix", "suf"), ("middle", "mid")) if fim[key] < 0]
        if missing:
            raise APIError(400, "infill is not supported by this model: it has no fill-in-the-middle "
                                f"{', '.join(missing)} token (GGUF tokenizer.ggml.fim_*_token_id)",
                           "not_supported_error", param="input_prefix")

        def tok(part) -> list[int]:
            parts = [part] if isinstance(part, str) else part
            return engine.mixed_ids(parts, special=False, bos=False)

        extra = []
        if fim["rep"] >= 0:
            extra += [fim["rep"], *tok("myproject\n")]
        for chunk in self.input_extra:
            extra += [fim["sep"], *tok(chunk.filename + "\n")] if fim["sep"] >= 0 else tok("\n\n--- snippet ---\n\n")
            extra += tok(chunk.text)
        if fim["sep"] >= 0:
            extra += [fim["sep"], *tok("filename\n")]
        prompt = engine.mixed_ids([self.prompt], special=True, bos=False)
        prefix = tok(self.input_prefix)
        prefix = prefix[len(prefix) - min(len(prefix), 3 * (n_batch // 4)):]
        suffix = tok(self.input_suffix)[:max(0, n_batch // 4 - (2 + len(prompt)))]
        asked = self.n_predict if self.n_predict is not None else self.max_completion_tokens or self.max_tokens
        keep = max(0, engine.n_ctx - n_batch - 2 * max(asked or 0, 0))
        extra = extra[len(extra) - min(len(extra), keep):]
        bos = [engine.target.bos] if engine.adds_bos and engine.target.bos >= 0 else []
        return [*extra, *bos, fim["pre"], *prefix, *prompt, fim["suf"], *suffix, fim["mid"]]


def stop_type(done: Finished) -> str:
    return {"eos": "eos", "stop": "word", "length": "limit", "context_full": "limit"}.get(
        done.summary.finish_reason, "none")


def settings(body: NativeRequest, n_predict: int) -> dict:
    """generation_settings: the request's sampling and length as they were applied."""
    fields = ("temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty", "repeat_last_n",
              "presence_penalty", "frequency_penalty", "n_probs", "cache_prompt", "samplers")
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    limit = body.max_new(n_predict)
    return {name: getattr(body, name) for name in fields} | {
        "n_predict": -1 if limit is None else limit, "stop": stop, "stream": body.stream,
        "grammar": body.grammar or "", "timings_per_token": body.timings_per_token}


def completion_body(engine: Engine, body: NativeRequest, done: Finished, slot: int, model: str, prompt: list[int],
                    n_predict: int) -> dict:
    """The whole answer, as llama-server's /completion gives it."""
    s = done.summary
    out = {"index": 0, "content": done.text, "tokens": done.token_ids if body.return_tokens else [], "id_slot": slot,
           "stop": True, "model": model, "tokens_predicted": s.n_generated, "tokens_evaluated": s.n_prompt,
           "generation_settings": settings(body, n_predict), "prompt": engine.detokenize(prompt),
           "has_new_line": "\n" in done.text, "truncated": s.finish_reason == "context_full",
           "stop_type": stop_type(done), "stopping_word": s.stop_word,
           "tokens_cached": s.n_prompt + max(s.n_generated - 1, 0),  # the last token is not decoded yet
           "timings": timings_of(done) | {"cache_n": s.n_cached}}
    if body.n_probs:
        out["completion_probabilities"] = native_logprobs(engine, done.logprobs or [])
    return out


async def chunks(job, engine: Engine, body: NativeRequest, metrics, t0: float, model: str, prompt: list[int],
                 n_predict: int):
    """The stream: a chunk per step's text (with n_probs, its tokens' probabilities), then the final chunk with every
    field of the whole answer but the text, its tokens and their probabilities (as llama-server's)."""
    running = Running()
    head = {"index": 0, "id_slot": job.slot if job.slot is not None else -1, "stop": False}
    try:
        async for ev in job_events(job, metrics, t0):
            running.add(ev)
            if ev is KEEPALIVE:
                yield ":\n\n"
            elif isinstance(ev, TextDelta):
                out = {**head, "content": ev.text, "tokens": [], "tokens_predicted": running.n,
                       "tokens_evaluated": len(prompt)}
                if body.timings_per_token:
                    out["timings"] = running.timings()
                if ev.logprobs:
                    out["completion_probabilities"] = native_logprobs(engine, ev.logprobs)
                yield frame(out)
            elif isinstance(ev, Finished):
                final = completion_body(engine, body, ev, job.slot, model, prompt, n_predict)
                final.pop("completion_probabilities", None)
                yield frame(final | {"content": "", "tokens": []})
    except Exception as e:  # the engine failed mid-stream: said in-band, and the stream ends
        yield frame({"error": {"message": str(e), "type": "server_error", "code": 500}})
