"""Each new grammar is loaded by llama.cpp in a child process before the engine's own sampler loads it: a grammar that
crashes llama.cpp's parser (a stack overflow is a signal, not an error) costs the child, and the request gets a 400.
The child loads it in a thread with a quarter of the stack the engine's threads have, so one that loads there loads
in the engine. Answers are kept per grammar text: clients send the same schema again and again.

`python -m dflash_local.engine.grammar_guard MODEL.gguf` is the child: it loads the model's vocabulary only, says
"ready", then answers one JSON line per grammar with whether llama.cpp built a grammar sampler from it.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
from collections import OrderedDict

CHILD_STACK = 2 * 1024 * 1024  # threads get 8 MB (glibc's default, Linux's usual stack limit)
TIMEOUT = 10.0  # seconds a grammar may take to load
START_TIMEOUT = 120.0  # the child's start: Python, llama.cpp and the vocabulary
KEEP = 256  # grammars remembered


class GrammarGuard:
    def __init__(self, model_path):
        self.model_path = str(model_path)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._known: OrderedDict[str, str | None] = OrderedDict()  # grammar -> why it cannot load, or None

    def check(self, text: str) -> None:
        """Raise ValueError if loading this grammar takes a process down or runs past TIMEOUT. A grammar that only
        fails to parse passes: the engine's sampler reports llama.cpp's reason."""
        with self._lock:
            if text not in self._known:
                self._known[text] = self._ask(text)
                while len(self._known) > KEEP:
                    self._known.popitem(last=False)
            self._known.move_to_end(text)
            why = self._known[text]
        if why:
            raise ValueError(why)

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def _child(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._proc = subprocess.Popen([sys.executable, "-m", "dflash_local.engine.grammar_guard", self.model_path],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True, encoding="utf-8")
        if self._read(START_TIMEOUT) != "ready":
            self._stop()
            raise RuntimeError("the grammar checker did not start")
        return self._proc

    def _read(self, timeout: float) -> str | None:
        """The child's next line; "" if it died, None if it said nothing in time."""
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        return self._proc.stdout.readline().strip() if ready else None

    def _ask(self, text: str) -> str | None:
        proc = self._child()
        try:
            proc.stdin.write(json.dumps({"grammar": text}) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: the read below says so
        reply = self._read(TIMEOUT)
        if not reply:
            self._stop()
            if reply == "":
                return "llama.cpp's grammar parser crashed on this grammar (too deeply nested?)"
            return f"llama.cpp took over {TIMEOUT:g} s to load this grammar"
        return None


def main(model_path: str) -> int:
    import ctypes

    import llama_cpp

    @ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
    def quiet(level, text, data):
        pass

    llama_cpp.llama_log_set(quiet, None)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), params)
    if not model:
        return 1
    vocab = llama_cpp.llama_model_get_vocab(model)
    threading.stack_size(CHILD_STACK)
    print("ready", flush=True)
    for line in sys.stdin:
        text = json.loads(line)["grammar"].encode()
        built = []

        def load():
            sampler = llama_cpp.llama_sampler_init_grammar(vocab, text, b"root")
            built.append(bool(sampler))
            if sampler:
                llama_cpp.llama_sampler_free(sampler)

        worker = threading.Thread(target=load)
        worker.start()
        worker.join()
        print(json.dumps({"built": built[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
