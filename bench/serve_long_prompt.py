"""A long prompt arriving while other streams run: how long those streams wait between tokens meanwhile (issue #37).

    python bench/serve_long_prompt.py [-m target.gguf] [-d drafter.gguf] [-np 4] [--streams 3] [--prompt-tokens 5000]
        [--llama-server .llama-server/bin/llama-server]

Starts `dflash-local serve -np K` (a subprocess on 127.0.0.1, slots of --ctx tokens), starts --streams streamed
completions of short prompts, waits until each has streamed --warm chunks, then sends a prompt of about
--prompt-tokens tokens (source code to explain), streamed too. Each running stream's chunk arrival times are recorded:
their usual gap (the median gap between chunks before the long prompt arrived) and their longest gap while it was
processed (from its sending to its first token). Then the same long request again alone on the idle server, its
prompt not reused from the cache (`cache_prompt: false`): its time to first token alone, and whether its output
equals the one it got beside the streams. With --llama-server PATH, the same against upstream's llama-server on the
same files (its defaults: a prompt goes in batches of -b 2048 tokens, each in one decode with the streams' tokens).
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve_soak import Server  # noqa: E402

from dflash_local.llama_server import Server as UpstreamServer  # noqa: E402
from dflash_local.llama_server import free_port  # noqa: E402
from dflash_local import models  # noqa: E402

def counting(i: int) -> str:
    """A prompt a model continues for thousands of tokens (a stream must outlast the long prompt)."""
    start = 100 * (i + 1)
    return "Counting up by one:\n" + ", ".join(str(n) for n in range(start, start + 8)) + ","


def long_prompt(n_tokens: int) -> str:
    """About n_tokens of real source code (4 characters a token), then a request about it."""
    root = Path(__file__).parents[1] / "dflash_local"
    src = "".join(p.read_text() for p in sorted((root / "engine").glob("*.py")))
    return src[: 4 * n_tokens] + "\n\n# Explain what the code above does, step by step.\n#"


def stream(url: str, body: dict, times: list[float], texts: list[str], stop: threading.Event | None = None) -> None:
    """A streamed completion: each chunk's arrival time and text, until it ends or `stop` is set."""
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, timeout=900) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if stop is not None and stop.is_set():
                return
            if line.startswith("data: {"):
                c = json.loads(line[6:])
                text = "".join(ch.get("text") or "" for ch in c.get("choices") or [])
                if text:
                    times.append(time.monotonic())
                    texts.append(text)


def measure(url: str, args) -> dict:
    """Start the streams on the server at `url`, send the long prompt beside them, then again alone: the gaps and
    times of the module's docstring."""
    stop = threading.Event()
    times = [[] for _ in range(args.streams)]
    texts = [[] for _ in range(args.streams)]
    runners = [threading.Thread(target=stream, args=(url, {"prompt": counting(i), "max_tokens": args.ctx - 64,
                                                           "temperature": 0}, times[i], texts[i], stop))
               for i in range(args.streams)]
    for r in runners:
        r.start()
    while any(len(t) < args.warm for t in times):
        if not any(r.is_alive() for r in runners):
            raise RuntimeError("the streams ended before the long prompt was sent")
        time.sleep(0.05)
    body = {"prompt": long_prompt(args.prompt_tokens), "max_tokens": args.long_tokens, "temperature": 0}
    sent = time.monotonic()
    beside_times, beside_texts = [], []
    stream(url, body, beside_times, beside_texts)
    if not all(r.is_alive() for r in runners):
        raise RuntimeError("a stream ended before the long prompt's answer did: the gaps would not be the streams'")
    stop.set()
    for r in runners:
        r.join()
    first = beside_times[0]
    before = sorted(b - a for t in times for a, b in zip(t, t[1:]) if b <= sent)
    # each stream's gaps that overlap the prompt's processing (the one it was in when the prompt came, too)
    during = sorted(b - a for t in times for a, b in zip(t, t[1:]) if b > sent and a < first)
    alone_times, alone_texts = [], []
    t0 = time.monotonic()
    stream(url, body | {"cache_prompt": False}, alone_times, alone_texts)
    n_prompt = len(httpx.post(url + "/tokenize", json={"content": body["prompt"]}).json()["tokens"])
    return {"n_prompt": n_prompt, "before": before, "during": during, "ttft_beside": first - sent,
            "ttft_alone": alone_times[0] - t0, "same": "".join(beside_texts) == "".join(alone_texts)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None, help="target GGUF (default: the default pair's)")
    ap.add_argument("-d", "--drafter", default=None, help="drafter GGUF (default: the default pair's)")
    ap.add_argument("-np", "--parallel", type=int, default=4)
    ap.add_argument("--streams", type=int, default=3, help="streams running when the long prompt arrives")
    ap.add_argument("--prompt-tokens", type=int, default=5000)
    ap.add_argument("--ctx", type=int, default=8192, help="tokens per slot")
    ap.add_argument("--warm", type=int, default=16, help="chunks each stream has streamed before the long prompt")
    ap.add_argument("--long-tokens", type=int, default=32, help="tokens the long request generates")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--llama-server", type=Path, help="also measure this upstream llama-server (plain, its defaults)")
    ap.add_argument("--log", default=str(Path(tempfile.gettempdir()) / "serve_long_prompt.log"))
    args = ap.parse_args(argv)
    model, drafter = map(str, models.pair(args.model, args.drafter))
    runs = {}
    server = Server(["-m", model, "-d", drafter, "-np", str(args.parallel), "-c", str(args.ctx * args.parallel),
                     "-t", str(args.threads)], Path(args.log))
    try:
        runs["ours"] = measure(server.url, args)
    finally:
        server.stop()
    if args.llama_server:
        port = free_port()
        argv = [str(args.llama_server), "-m", model, "-np", str(args.parallel), "-c", str(args.ctx * args.parallel),
                "-t", str(args.threads), "--host", "127.0.0.1", "--port", str(port)]
        with UpstreamServer(argv, port, Path(args.log).with_suffix(".llama-server.log")) as up:
            runs["llama-server"] = measure(up.url, args)
    names = list(runs)
    n_prompt = runs[names[0]]["n_prompt"]
    print(f"| long prompt ({n_prompt} tokens) beside {args.streams} streams, -np {args.parallel} | "
          + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))

    def row(label: str, cell) -> None:
        print(f"| {label} | " + " | ".join(cell(runs[n]) for n in names) + " |")

    def ms(x: float) -> str:
        return f"{x * 1000:,.0f} ms"

    row("streams' usual gap between chunks (median before the prompt; longest before it)",
        lambda r: f"{ms(statistics.median(r['before']))} ({ms(r['before'][-1])})")
    row("streams' gaps while the prompt was processed: median, 95th percentile",
        lambda r: f"{ms(statistics.median(r['during']))}, {ms(r['during'][int(0.95 * (len(r['during']) - 1))])}")
    row("longest gap while it was processed (x the usual)",
        lambda r: f"{ms(r['during'][-1])} ({r['during'][-1] / statistics.median(r['before']):.1f}x)")
    row("long prompt's time to first token beside the streams",
        lambda r: f"{r['ttft_beside']:.1f} s ({r['n_prompt'] / r['ttft_beside']:.0f} prompt tokens/s)")
    row("the same alone (`cache_prompt: false`)",
        lambda r: f"{r['ttft_alone']:.1f} s ({r['n_prompt'] / r['ttft_alone']:.0f} prompt tokens/s)")
    row("its output beside the streams equals its output alone", lambda r: str(r["same"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
