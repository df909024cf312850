"""Requests per minute and tokens/s of `dflash-local serve` for a sequence of chat requests, with and without drafter.

    python bench/serve_chat.py -m target.gguf -d drafter.gguf [-n 20] [--max-tokens 128] [--clients K[,K...]]
        [--llama-server PATH]

Starts the real server (a subprocess on 127.0.0.1) once with the drafter and once with --no-draft, sends the same
chat requests through the official openai client, streamed, and prints a Markdown table: requests per minute,
aggregate tokens/s, and the time to the first token (mean and worst). --clients K sends them from K clients at once
(each takes the next request when its last one is done) to a server with K slots (`-np K`, 4096 tokens each); 1 (the
default) sends them one after another, to one slot: its first-token times are an idle server's. With K clients, every
request after the first K arrives while K - 1 others stream: their first-token times get a column of their own (the
first K arrive together and wait for each other's prompts). A list (1,4) runs
each in turn, in one run. With
--llama-server, upstream llama-server (plain, the same context and threads, as many slots as clients: `-np K`) gets
the same requests on its /v1/chat/completions, with its own chat template.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from dflash_local.llama_server import free_port

TOPICS = [
    "the water cycle", "how a bicycle works", "the history of paper", "why the sky is blue", "binary search",
    "a recipe for bread", "the moon landing", "how vaccines work", "volcanoes", "the printing press",
    "photosynthesis", "a sorting algorithm in Python", "the rules of chess", "how batteries store energy",
    "the Roman empire", "what a compiler does", "ocean tides", "how to plant a tree", "the speed of light",
    "a haiku about autumn",
]


def request(client: openai.OpenAI, model: str, topic: str, max_tokens: int) -> tuple[int, float]:
    """One streamed chat request: (completion tokens, seconds to the first content)."""
    t0, first, tokens = time.perf_counter(), None, 0
    stream = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": f"Explain {topic}."}])
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens, first if first is not None else time.perf_counter() - t0


def run(argv: list[str], n: int, max_tokens: int, label: str, clients: int = 1) -> dict:
    """The requests against the server `argv` starts (given --port too)."""
    port = free_port()
    # run from a neutral folder: in the repository root `-m dflash_local` would find the unbuilt source tree
    proc = subprocess.Popen([*argv, "--port", str(port)], stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                health = httpx.get(url + "/health")
                if health.status_code == 200:
                    if health.json().get("drafter_error"):  # ours serves without the drafter then: not this row
                        raise SystemExit(f"{label}: the drafter did not load: {health.json()['drafter_error']}")
                    break
            except httpx.ConnectError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with code {proc.returncode}")
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        topics = (TOPICS * (n // len(TOPICS) + 1))[:n]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            done = list(pool.map(lambda topic: request(client, model, topic, max_tokens), topics))
        wall = time.perf_counter() - t0
        tokens = sum(t for t, _ in done)
        ttft = [f for _, f in done]
        busy = ttft[clients:] if clients > 1 else ttft  # pool.map keeps the order: the first K started together
        print(f"  {label}: {n} requests, {tokens} tokens", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(10)
    return {"label": label, "clients": clients, "requests": n, "tokens": tokens, "seconds": wall,
            "requests_per_minute": 60 * n / wall, "tokens_per_second": tokens / wall,
            "ttft_mean": statistics.mean(ttft), "ttft_max": max(ttft),
            "ttft_busy_mean": statistics.mean(busy), "ttft_busy_max": max(busy)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", help="target GGUF (default: gemma-3-270m)")
    p.add_argument("-d", "--draft", required=True, help="drafter GGUF")
    p.add_argument("-n", "--requests", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--clients", default="1", help="requests in flight at once (default 1), or a list: 1,4")
    p.add_argument("--llama-server", metavar="PATH", help="also time upstream llama-server, plain")
    args = p.parse_args(argv)
    # the servers run from a neutral folder (see run): paths as the user gave them, relative to here
    for name in ("model", "draft", "llama_server"):
        if getattr(args, name):
            setattr(args, name, os.path.abspath(getattr(args, name)))
    rows = []
    for k in map(int, args.clients.split(",")):
        ours = [sys.executable, "-m", "dflash_local", "serve", "-np", str(k)]
        ours += ["-m", args.model] if args.model else []
        rows += [run(ours + ["-d", args.draft], args.requests, args.max_tokens, f"dflash -np {k}", k),
                 run(ours + ["--no-draft"], args.requests, args.max_tokens, f"no drafter -np {k}", k)]
        if args.llama_server:
            from dflash_local import models

            # our serve's defaults: context 4096 (for each slot), all cores
            upstream = [args.llama_server, "-m", str(models.pair(args.model)[0]), "--host", "127.0.0.1", "-np",
                        str(k), "-c", str(4096 * k), "-t", str(os.cpu_count())]
            rows.append(run(upstream, args.requests, args.max_tokens, f"llama-server -np {k}", k))
    print("| server | clients | requests | tokens | seconds | requests/min | tokens/s | first token: mean, worst (s) "
          "| arriving while K - 1 stream: mean, worst (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['clients']} | {r['requests']} | {r['tokens']} | {r['seconds']:.1f} | "
              f"{r['requests_per_minute']:.1f} | {r['tokens_per_second']:.1f} | {r['ttft_mean']:.2f}, "
              f"{r['ttft_max']:.2f} | {r['ttft_busy_mean']:.2f}, {r['ttft_busy_max']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
