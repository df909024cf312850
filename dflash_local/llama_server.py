"""Upstream llama.cpp's llama-server as a process to measure: start it on 127.0.0.1 and a free port, wait until its
/health answers 200, run greedy completions through its /completion endpoint, read its own timings, stop it.

A server that does not start, dies (upstream aborts on some models: a GGML_ASSERT) or does not answer in time raises
ServerError with one line saying why, taken from its log.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

START_TIMEOUT = 300.0  # loading a model from a cold disk
REQUEST_TIMEOUT = 600.0  # one completion


class ServerError(RuntimeError):
    """A llama-server that failed: the message is one line."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def why_it_stopped(log: Path, returncode: int | None) -> str:
    """One line: how the process ended and the line of its log that says why (its GGML_ASSERT, else its last error
    line). The first error-looking lines are no use: llama-server logs some as normal while it sizes its memory."""
    if returncode is None:
        status = "still running"
    elif returncode < 0:
        status = f"crashed ({signal.Signals(-returncode).name})"
    else:
        status = f"exited with code {returncode}"
    lines = [re.sub(r"^[\d.]+ [A-Z] ", "", line).strip() for line in log.read_text(errors="replace").splitlines()]
    asserts = [line for line in lines if "GGML_ASSERT" in line or "GGML_ABORT" in line]
    errors = [line for line in lines if re.search(r"error|failed", line, re.IGNORECASE)]
    last = asserts[:1] or errors[-1:] or [line for line in lines if line][-1:]
    return f"{status}: {last[0][:300]}" if last else f"{status}, nothing in its log"


class Server:
    """`with Server(argv, port, log) as s: s.complete(ids, n)`; argv must make it listen on 127.0.0.1:port. Its
    stdout and stderr go to `log`."""

    def __init__(self, argv: list[str], port: int, log: Path, start_timeout: float = START_TIMEOUT):
        self.argv, self.url, self.log, self.start_timeout = argv, f"http://127.0.0.1:{port}", log, start_timeout
        self.proc = None

    def __enter__(self) -> Server:
        with open(self.log, "wb") as f:
            try:
                self.proc = subprocess.Popen(self.argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            except OSError as e:
                raise ServerError(f"could not run {self.argv[0]}: {e.strerror}") from None
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"failed to start: {why_it_stopped(self.log, self.proc.returncode)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while it loads the model
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"not ready within {self.start_timeout:g} s")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def complete(self, ids: list[int], n_predict: int, timeout: float = REQUEST_TIMEOUT,
                 sampling: dict | None = None, cache_prompt: bool = False) -> dict:
        """Completion of the prompt tokens `ids` (sent as ids: llama-server adds no BOS to them and applies no
        template), n_predict tokens at most, the prompt evaluated afresh (cache_prompt: after what its cache holds);
        greedy, or with `sampling` (temperature, top_k, top_p, min_p, seed: its fields of the same names). Returns its
        token ids, its timings (predicted_n, predicted_ms, predicted_per_second, prompt_n, prompt_ms, and draft_n /
        draft_n_accepted, 0 without drafts) and the request's wall-clock seconds."""
        body = {"prompt": ids, "n_predict": n_predict, "temperature": 0, "cache_prompt": cache_prompt,
                "return_tokens": True}
        body |= sampling or {}
        req = urllib.request.Request(self.url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                out = json.load(r)
        except urllib.error.HTTPError as e:
            raise ServerError(f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}") from None
        except TimeoutError:
            raise ServerError(f"no answer within {timeout:g} s") from None
        except (urllib.error.URLError, OSError):
            # the connection dropped: the server died on this request; give it a moment to finish its log
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            raise ServerError(why_it_stopped(self.log, self.proc.poll())) from None
        wall = time.perf_counter() - t0
        t = out["timings"]
        return {"tokens": out["tokens"], "predicted_n": t["predicted_n"], "predicted_ms": t["predicted_ms"],
                "predicted_per_second": t["predicted_per_second"], "draft_n": t.get("draft_n", 0),
                "draft_n_accepted": t.get("draft_n_accepted", 0), "prompt_n": t["prompt_n"], "prompt_ms": t["prompt_ms"],
                "wall_s": wall}
