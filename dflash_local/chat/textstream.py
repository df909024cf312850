"""Token bytes in, text deltas out: UTF-8 safe across token boundaries, with stop strings that may span tokens."""

from __future__ import annotations

import codecs


def partial_suffix(text: str, markers) -> int:
    """Length of the longest tail of `text` that begins one of `markers` (and is not all of it): text a stream must
    hold back until the next piece says whether the marker follows."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if m.startswith(text[-n:]):
                best = n
                break
    return best


class TextStream:
    def __init__(self, stop: list[str] | tuple[str, ...] = ()):
        self.stop = [s for s in stop if s]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text not yet released: it may be the start of a stop string
        self.text = ""  # everything released so far
        self.stopped_by: str | None = None

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now safe to show."""
        self._held += self._decoder.decode(piece)
        return self._release(final=False)

    def flush(self) -> str:
        """End of generation: release whatever is held (a dangling partial UTF-8 sequence becomes U+FFFD)."""
        self._held += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped_by is not None:
            return ""
        hits = [(self._held.find(s), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            i, s = min(hits)
            out, self._held, self.stopped_by = self._held[:i], "", s
        elif final:
            out, self._held = self._held, ""
        else:
            keep = partial_suffix(self._held, self.stop)
            out = self._held[: len(self._held) - keep]
            self._held = self._held[len(out) :]
        self.text += out
        return out


class Output:
    """The generated tokens a caller gets, and their text: they end before an end-of-generation token, at a stop
    string or at max_tokens; `finish` says which (None while going on). Control tokens show as text only where
    listed in `shown` (as llama-server's preserved tokens: the markers a chat format's parser reads)."""

    def __init__(self, vocab, stop: list[str] | tuple[str, ...], max_tokens: int, shown: frozenset[int] = frozenset()):
        self.vocab = vocab  # is_eog(token) -> bool, piece(token, special) -> bytes
        self.shown = shown
        self.max_tokens = max_tokens
        self.stream = TextStream(stop)
        self.ids: list[int] = []
        self.finish: str | None = None

    def add(self, tokens: list[int]) -> str:
        """Take one step's tokens, in order, up to the first that ends the output; return the text now safe to show."""
        text = ""
        for tok in tokens:
            if self.vocab.is_eog(tok):
                self.finish = "eos"
                break
            self.ids.append(tok)
            text += self.stream.feed(self.vocab.piece(tok, tok in self.shown))
            if self.stream.stopped_by is not None:
                self.finish = "stop"
            elif len(self.ids) >= self.max_tokens:
                self.finish = "length"
            if self.finish:
                break
        return text
