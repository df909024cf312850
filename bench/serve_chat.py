"""Requests per minute and tokens/s of `dflash-local serve` for a sequence of chat requests, with and without drafter.

    python bench/serve_chat.py -m target.gguf -d drafter.gguf [-n 20] [--max-tokens 128] [--llama-server PATH]

Starts the real server (a subprocess on 127.0.0.1) once with the drafter and once with --no-draft, sends the same
chat requests one after another through the official openai client, and prints a Markdown table. With
--llama-server, upstream llama-server (plain, one slot, the same context and threads) gets the same requests on its
/v1/chat/completions, with its own chat template.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai

TOPICS = [
    "the water cycle", "how a bicycle works", "the history of paper", "why the sky is blue", "binary search",
    "a recipe for bread", "the moon landing", "how vaccines work", "volcanoes", "the printing press",
    "photosynthesis", "a sorting algorithm in Python", "the rules of chess", "how batteries store energy",
    "the Roman empire", "what a compiler does", "ocean tides", "how to plant a tree", "the speed of light",
    "a haiku about autumn",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv: list[str], n: int, max_tokens: int, label: str) -> dict:
    """The requests against the server `argv` starts (given --port too)."""
    port = free_port()
    # run from a neutral folder: in the repository root `-m dflash_local` would find the unbuilt source tree
    proc = subprocess.Popen([*argv, "--port", str(port)], stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.ConnectError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with code {proc.returncode}")
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        topics = (TOPICS * (n // len(TOPICS) + 1))[:n]
        tokens, t0 = 0, time.perf_counter()
        for i, topic in enumerate(topics):
            r = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0,
                                               messages=[{"role": "user", "content": f"Explain {topic}."}])
            tokens += r.usage.completion_tokens
            print(f"  {label}: request {i + 1}/{n}, {r.usage.completion_tokens} tokens", file=sys.stderr)
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(10)
    return {"label": label, "requests": n, "tokens": tokens, "seconds": wall,
            "requests_per_minute": 60 * n / wall, "tokens_per_second": tokens / wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", help="target GGUF (default: gemma-3-270m)")
    p.add_argument("-d", "--draft", required=True, help="drafter GGUF")
    p.add_argument("-n", "--requests", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--llama-server", metavar="PATH", help="also time upstream llama-server, plain")
    args = p.parse_args()
    ours = [sys.executable, "-m", "dflash_local", "serve"] + (["-m", args.model] if args.model else [])
    rows = [run(ours + ["-d", args.draft], args.requests, args.max_tokens, "dflash"),
            run(ours + ["--no-draft"], args.requests, args.max_tokens, "no drafter")]
    if args.llama_server:
        from dflash_local.models import default_target

        # our serve's defaults: context 4096, all cores
        upstream = [args.llama_server, "-m", args.model or str(default_target()), "--host", "127.0.0.1", "-np", "1",
                    "-c", "4096", "-t", str(os.cpu_count())]
        rows.append(run(upstream, args.requests, args.max_tokens, "llama-server"))
    print("| server | requests | tokens | seconds | requests/min | tokens/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['requests']} | {r['tokens']} | {r['seconds']:.1f} | "
              f"{r['requests_per_minute']:.1f} | {r['tokens_per_second']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
