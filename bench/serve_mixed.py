"""16 clients at once against `dflash-local serve -np 4`, with mixed requests, and what is left afterwards.

    python bench/serve_mixed.py -d drafter.gguf [-m target.gguf] [--clients 16] [-np 4] [--rounds 1]

Starts the real server (a subprocess on 127.0.0.1), warms it with one request, reads its resident memory, then sends
--clients chat requests at once: lengths from 16 to 256 tokens, stop strings, JSON-schema answers, streamed and not,
and a quarter of the streams dropped by their client after the first chunk. Each completed request is then sent again
alone, and its output compared with the one it got beside the others. Prints a Markdown table, one line per round
(--rounds: the same mix again on the same server): completed, cancelled, server errors, outputs identical to their
single-request run, the slots all idle again, and the resident memory before the round and once it is over.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from dflash_local.llama_server import free_port

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "integer"}},
          "required": ["answer", "confidence"]}


def rss_mib(pid: int) -> float:
    """Resident memory of a process (ps, on Linux and macOS)."""
    return int(subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout) / 1024


def body(i: int) -> dict:
    """Request i of the mix."""
    topic = ["rivers", "clocks", "bees", "maps"][i % 4]
    b = {"messages": [{"role": "user", "content": f"Tell me about topic number {i}: {topic}."}],
         "max_tokens": [16, 64, 128, 256][i % 4], "temperature": 0}
    if i % 5 == 1:
        b["stop"] = [".", "\n\n"]
    if i % 5 == 2:
        b["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    if i % 2 == 0:
        b["stream"] = True
    return b


def send(url: str, b: dict, drop: bool) -> tuple[int, str | None]:
    """(status, the answer's text; None if the client dropped the stream)."""
    if not b.get("stream"):
        r = httpx.post(url + "/v1/chat/completions", json=b, timeout=600)
        return r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=b, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if drop:
                return r.status_code, None
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                text += c.get("delta", {}).get("content") or ""
    return r.status_code, text


def run_round(url: str, clients: int, rss) -> dict:
    """The mix once, each completed request again alone, and the server's memory once its slots are idle."""
    before = rss()
    bodies = [body(i) for i in range(clients)]
    drops = [b.get("stream", False) and i % 4 == 0 for i, b in enumerate(bodies)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda i: send(url, bodies[i], drops[i]), range(clients)))
    wall = time.perf_counter() - t0
    end = time.time() + 60
    while any(s["is_processing"] for s in httpx.get(url + "/slots").json()) and time.time() < end:
        time.sleep(0.1)
    idle = not any(s["is_processing"] for s in httpx.get(url + "/slots").json())
    time.sleep(0.5)  # the worker gives the burst's memory back right after the last generation ends (Engine.trim)
    after = rss()
    completed = [i for i, (status, text) in enumerate(results) if status == 200 and text is not None]
    same = sum(send(url, bodies[i] | {"stream": False}, False)[1] == results[i][1] for i in completed)
    return {"wall": wall, "completed": len(completed), "cancelled": sum(drops), "idle": idle, "same": same,
            "errors": sum(status >= 500 for status, _ in results), "before": before, "after": after}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", help="target GGUF (default: gemma-3-270m)")
    p.add_argument("-d", "--draft", required=True, help="drafter GGUF")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("-np", "--parallel", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1, help="the same mix again, to see whether memory keeps growing")
    args = p.parse_args(argv)
    port = free_port()
    cmd = [sys.executable, "-m", "dflash_local", "serve", "-np", str(args.parallel), "-d", os.path.abspath(args.draft),
           "--port", str(port)] + (["-m", os.path.abspath(args.model)] if args.model else [])
    # a neutral folder: in the repository root `-m dflash_local` would find the unbuilt source tree
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir())
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
        send(url, body(3), False)  # weights paged in, buffers allocated
        rows = [run_round(url, args.clients, lambda: rss_mib(proc.pid)) for _ in range(args.rounds)]
    finally:
        proc.terminate()
        proc.wait(10)
    print("| round | clients | slots | seconds | completed | cancelled | 5xx | identical to alone | slots idle after | "
          "memory before, after (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows, 1):
        print(f"| {i} | {args.clients} | {args.parallel} | {r['wall']:.1f} | {r['completed']} | {r['cancelled']} | "
              f"{r['errors']} | {r['same']} of {r['completed']} | {r['idle']} | {r['before']:.0f}, {r['after']:.0f} |")
    return 0 if all(r["errors"] == 0 and r["same"] == r["completed"] and r["idle"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
