"""A soak of `dflash-local serve -np 4`: random arrivals, every completed output compared with its request run alone.

    python bench/serve_soak.py [-m target.gguf] [-d drafter.gguf] [--requests 500] [-np 4] [-c 1024] [--seed 1]

Starts two real servers (subprocesses on 127.0.0.1): the soaked one with -np slots of -c tokens each, and a reference
with one slot of the same size. Requests arrive at random (an exponential gap of --gap seconds on average, in bursts
that fill every slot and queue), from short prompts and prompts of about --long tokens (a source file to explain),
streamed and not, greedy and seeded sampling (llama.cpp's default chain), 16-160 tokens; --cancel of the streams are
dropped by their client after a few chunks. Each request that completed is then sent to the reference server, one at a
time, and its text and finish reason compared. Prints a progress line every --report requests and a Markdown summary:
sent, completed, cancelled, server errors, outputs that differ (each listed with its first differing characters), the
soak's tokens per second and the rounds the server gave up for an arriving request. Exit status 1 if any output
differs or the server answered 5xx.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from dflash_local.llama_server import free_port
from dflash_local import models

SHORT = ["A recipe for bread:", "The water cycle explained:", "def fizzbuzz(n):\n", "The history of the bicycle",
         "Ten facts about the moon:\n1.", "class Queue:\n    def __init__(self):\n", "Dear hiring manager,",
         "SELECT name FROM users WHERE", "Once upon a time, in a village by the sea,", "How a hash table works:"]


def long_prompt(n_tokens: int) -> str:
    """About n_tokens of a real source file (4 characters a token), then a question about it."""
    src = (Path(__file__).parents[1] / "dflash_local" / "engine" / "policy.py").read_text()
    return src[: 4 * n_tokens] + "\n\n# Explain what the code above does, step by step.\n#"


def request(rng: random.Random, i: int, long_text: str, cancel: float) -> dict:
    """Request i: its body and whether its client drops the stream."""
    prompt = long_text if rng.random() < 0.2 else rng.choice(SHORT) + f" (request {i})" * (rng.random() < 0.5)
    body = {"prompt": prompt, "max_tokens": rng.choice([16, 32, 64, 96, 128, 160]), "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:  # the server's chain for what is left out: llama-server's defaults
        body |= {"temperature": rng.choice([0.7, 0.8, 1.0]), "seed": rng.randrange(1 << 30)}
    drop = body["stream"] and rng.random() < cancel
    return {"i": i, "body": body, "drop": drop}


def send(url: str, r: dict) -> dict:
    """Sends one request; the result: status, text, finish reason, completion tokens, or dropped."""
    b = r["body"]
    try:
        if not b["stream"]:
            resp = httpx.post(url + "/v1/completions", json=b, timeout=900)
            if resp.status_code != 200:
                return {"status": resp.status_code, "error": resp.text[:200]}
            c = resp.json()
            return {"status": 200, "text": c["choices"][0]["text"], "finish": c["choices"][0]["finish_reason"],
                    "tokens": c["usage"]["completion_tokens"]}
        text, finish, chunks, tokens = "", None, 0, 0
        with httpx.stream("POST", url + "/v1/completions", json=b | {"stream_options": {"include_usage": True}},
                          timeout=900) as resp:
            if resp.status_code != 200:
                return {"status": resp.status_code, "error": resp.read().decode(errors="replace")[:200]}
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                c = json.loads(line[6:])
                if c.get("usage"):
                    tokens = c["usage"]["completion_tokens"]
                for ch in c.get("choices") or []:
                    text += ch.get("text") or ""
                    finish = ch.get("finish_reason") or finish
                chunks += 1
                if r["drop"] and chunks >= 3:
                    return {"status": 200, "dropped": True}
        return {"status": 200, "text": text, "finish": finish, "tokens": tokens}
    except httpx.HTTPError as e:
        return {"status": 0, "error": f"{type(e).__name__}: {e}"}


class Server:
    """A `dflash-local serve` subprocess on 127.0.0.1."""

    def __init__(self, args: list[str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash_local", "serve", *args, "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server was not ready in 300 s: see {log}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def first_difference(a: str, b: str) -> str:
    n = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    return f"at char {n}: {a[n:n + 30]!r} vs alone {b[n:n + 30]!r}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="target GGUF (default: the default pair's)")
    ap.add_argument("-d", "--draft", help="drafter GGUF (default: the default pair's)")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("-np", "--parallel", type=int, default=4)
    ap.add_argument("-c", "--ctx-size", type=int, default=1024, help="tokens per slot (both servers)")
    ap.add_argument("--long", type=int, default=600, help="tokens of the long prompts")
    ap.add_argument("--gap", type=float, default=0.4, help="mean seconds between arrivals")
    ap.add_argument("--cancel", type=float, default=0.15, help="share of the streams their client drops")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--report", type=int, default=50, help="a progress line every this many requests")
    ap.add_argument("-t", "--threads", type=int)
    args = ap.parse_args(argv)

    model, draft = map(str, models.pair(args.model, args.draft))
    rng = random.Random(args.seed)
    long_text = long_prompt(args.long)
    reqs = [request(rng, i, long_text, args.cancel) for i in range(args.requests)]
    common = ["-m", model, "-d", draft] + (["-t", str(args.threads)] if args.threads else [])
    logs = Path(tempfile.mkdtemp(prefix="serve-soak-"))
    soaked = Server(common + ["-np", str(args.parallel), "-c", str(args.ctx_size * args.parallel)], logs / "soak.log")
    results: dict[int, dict] = {}
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=4 * args.parallel + 8) as pool:
            lock = threading.Lock()

            def run(r):
                out = send(soaked.url, r)
                with lock:
                    results[r["i"]] = out
                    if len(results) % args.report == 0:
                        print(f"{len(results)}/{len(reqs)} done, {time.perf_counter() - t0:.0f} s", file=sys.stderr)

            futures = []
            for r in reqs:
                futures.append(pool.submit(run, r))
                time.sleep(rng.expovariate(1 / args.gap))
            for f in futures:
                f.result()
        soak_s = time.perf_counter() - t0
        alive = soaked.proc.poll() is None
        # rounds given up for an arriving request's prompt: the path a slot's cells once went astray on
        metrics = httpx.get(soaked.url + "/metrics", timeout=10).text if alive else ""
        interrupted = next((line.split()[-1] for line in metrics.splitlines()
                            if line.startswith("dflash_interrupted_rounds_total")), "?")
    finally:
        soaked.stop()
    done = [r for r in reqs if "text" in results[r["i"]]]
    dropped = sum(1 for r in reqs if results[r["i"]].get("dropped"))
    errors = [(r["i"], results[r["i"]]) for r in reqs if results[r["i"]]["status"] != 200]

    reference = Server(common + ["-np", "1", "-c", str(args.ctx_size)], logs / "alone.log")
    differ = []
    try:
        for k, r in enumerate(done):
            alone = send(reference.url, r | {"drop": False})
            got = results[r["i"]]
            if (alone.get("text"), alone.get("finish")) != (got["text"], got["finish"]):
                differ.append((r, first_difference(got["text"], alone.get("text") or "")))
            if (k + 1) % args.report == 0:
                print(f"reference: {k + 1}/{len(done)}, {len(differ)} differ", file=sys.stderr)
    finally:
        reference.stop()

    tokens = sum(results[r["i"]]["tokens"] for r in done)
    print("| requests | completed | cancelled | errors | 5xx | outputs that differ from their run alone | "
          "soak tokens/s | interrupted rounds | server alive |")
    print("|---|---|---|---|---|---|---|---|---|")
    n5 = sum(1 for _, e in errors if e["status"] >= 500)
    print(f"| {len(reqs)} | {len(done)} | {dropped} | {len(errors)} | {n5} | {len(differ)} | {tokens / soak_s:.1f} | "
          f"{interrupted} | {alive} |")
    for r, why in differ:
        b = r["body"]
        print(f"- request {r['i']} ({'stream' if b['stream'] else 'whole'}, temperature {b.get('temperature')}, "
              f"{b['max_tokens']} tokens, prompt {b['prompt'][:30]!r}): {why}")
    for i, e in errors[:10]:
        print(f"- request {i}: {e}")
    print(f"logs: {logs}", file=sys.stderr)
    return 1 if differ or n5 or not alive else 0


if __name__ == "__main__":
    sys.exit(main())
