"""A test double at the engine boundary: the generation's text is planted.

The real engine still renders, tokenizes and prefills each request's prompt and makes one token (its summary is the
response's), so the request path up to the engine is the real one; only the generated text is replaced, cut in the
pieces given, to test how the server reads outputs (reasoning, tool calls) that the tiny test models never write.
"""

from dataclasses import replace

from dflash_local.engine.engine import Engine, Finished, TextDelta


class PlantedEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.pieces: list[str] = []
        self.requests: list[dict] = []  # generate()'s arguments, one per request

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, **kwargs):
        self.requests.append(kwargs)
        real = self.engine.complete(**{**kwargs, "max_tokens": 1})
        for piece in self.pieces:
            yield TextDelta(piece)
        # the planted text ends as a model's answer does, at an end-of-generation token
        yield Finished("".join(self.pieces), real.token_ids, replace(real.summary, finish_reason="eos"))

    def last_prompt(self) -> str:
        """The prompt text of the last request."""
        r = self.requests[-1]
        return self.engine.chat_prompt(r["messages"], r["chat_template_kwargs"])


def cut(text: str, n: int) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)]
