"""Huge requests against `dflash-local serve` (the default pair unless -m/-d say otherwise): how each is refused, how
long that takes, and the worst time /health took to answer meanwhile (polled every 10 ms).

    python bench/serve_hostile.py [-- SERVE ARGS...]
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from dflash_local.llama_server import Server, free_port


def main(serve_args: list[str]) -> None:
    port = free_port()
    # the installed command: `python -m dflash_local` in the repository root would find the unbuilt source tree
    argv = [str(Path(sys.executable).parent / "dflash-local"), "serve", "-np", "4", "--api-key", "K", *serve_args,
            "--port", str(port)]
    with tempfile.TemporaryDirectory() as tmp, Server(argv, port, Path(tmp) / "serve.log") as server:
        url = server.url
        headers = {"Authorization": "Bearer K", "content-type": "application/json"}
        small = json.dumps({"role": "user", "content": "hi"})
        cases = [(f"{n} chat messages", "/v1/chat/completions", '{"messages": [' + ",".join([small] * n) + "]}")
                 for n in (20000, 200000, 3000)]
        cases.append(("a 200 KB prompt", "/v1/completions", json.dumps({"prompt": "word " * 40000, "max_tokens": 1})))
        print("| request | MB | answer | seconds | worst /health ms |\n|---|---|---|---|---|")
        for name, path, raw in cases:
            result = {}

            def send():
                t0 = time.perf_counter()
                result["r"] = httpx.post(url + path, content=raw, headers=headers, timeout=600)
                result["s"] = time.perf_counter() - t0

            sender = threading.Thread(target=send)
            sender.start()
            worst = 0.0
            while sender.is_alive():
                t0 = time.perf_counter()
                httpx.get(url + "/health", timeout=60)
                worst = max(worst, time.perf_counter() - t0)
                time.sleep(0.01)
            r = result["r"]
            why = r.json()["error"]["message"][:90] if r.status_code >= 400 else ""
            print(f"| {name} | {len(raw) / 1e6:.2f} | {r.status_code} {why} | {result['s']:.2f} | {worst * 1000:.0f} |")


if __name__ == "__main__":
    main(sys.argv[2:] if sys.argv[1:2] == ["--"] else sys.argv[1:])
