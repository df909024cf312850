"""A test double at the engine boundary: the generation's text is planted.

The real engine still renders, tokenizes and prefills each request's prompt and makes one token (its summary is the
response's), so the request path up to the engine is the real one; only the generated text is replaced, cut in the
pieces given, to test how the server reads outputs (reasoning, tool calls) that the tiny test models never write.
"""

from dataclasses import replace

from dflash_local.engine.engine import Engine, Finished, Generation, TextDelta


class PlantedEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.pieces: list[str] = []
        self.requests: list[Generation] = []  # the prepared generations, one per request
        self.preserved: list[str] = []  # the last request's preserved tokens (a chat format's control tokens)

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt=None, messages=None, **kwargs):
        self.preserved = list(kwargs.get("preserved_tokens", ()))
        yield from self.run(self.engine.prepare(prompt, messages, **kwargs))

    def token_set(self, texts) -> frozenset[int]:
        self.preserved = list(texts)  # the control tokens a chat format's parser asked to see (the server's path)
        return self.engine.token_set(texts)

    def run(self, generation: Generation, slot: int = 0):
        self.requests.append(generation)
        real = [ev for ev in self.engine.run(replace(generation, max_tokens=1), slot) if isinstance(ev, Finished)][0]
        for piece in self.pieces:
            yield TextDelta(piece)
        # the planted text ends as a model's answer does, at an end-of-generation token
        yield Finished("".join(self.pieces), real.token_ids, replace(real.summary, finish_reason="eos"))

    def generation(self, generation: Generation, slot: int = 0):
        """What the server's runner drives: the planted events (no step to run)."""
        return self.run(generation, slot)

    def last_prompt(self) -> str:
        """The prompt text of the last request."""
        return self.requests[-1].prompt_text


def cut(text: str, n: int) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)]
