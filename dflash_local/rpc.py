"""llama.cpp's RPC backend: a target too big for one machine runs with some of its layers on other machines, each
running `dflash-local rpc-server` (llama.cpp's rpc-server, from the same build). `--rpc HOST:PORT,...` on the
machine that runs the model makes those servers' devices take the offloaded layers (-ngl), as in llama.cpp."""

from __future__ import annotations

import socket
import threading

from . import _native


def parse_endpoints(servers: str) -> list[tuple[str, int]]:
    """'HOST:PORT,HOST:PORT' as llama.cpp takes it; a clear ValueError for anything else."""
    out = []
    for item in servers.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--rpc takes HOST:PORT[,HOST:PORT...], got {item.strip()!r}")
        out.append((host.strip("[]"), int(port)))
    return out


def add_servers(servers: str, timeout: float = 5.0) -> int:
    """Register every server's devices for the models loaded afterwards in this process; returns the device count.
    llama.cpp aborts the process when a server cannot be reached, so each is reached here first."""
    if not _native.supports_rpc():
        raise RuntimeError("this llama.cpp was built without the RPC backend: rerun scripts/setup.sh")
    n = 0
    for host, port in parse_endpoints(servers):
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError as e:
            raise RuntimeError(f"cannot reach the RPC server at {host}:{port}: {e}") from None
        n += _native.add_rpc_server(f"{host}:{port}")
    return n


def serve(host: str, port: int, n_threads: int, cache_dir: str | None = None) -> None:
    """Serve this machine's devices until interrupted. The server loop runs in llama.cpp and never returns, so it
    runs in a daemon thread and Ctrl-C ends the process."""
    if not _native.supports_rpc():
        raise RuntimeError("this llama.cpp was built without the RPC backend: rerun scripts/setup.sh")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:  # a clear error for a busy port
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise RuntimeError(f"cannot listen on {host}:{port}: {e}") from None
    failure: list[BaseException] = []

    def run():
        try:
            _native.serve_rpc(f"{host}:{port}", n_threads, cache_dir or "")
        except BaseException as e:  # reported by the main thread
            failure.append(e)

    t = threading.Thread(target=run, daemon=True, name="rpc-server")
    t.start()
    while t.is_alive():
        t.join(0.5)
    raise RuntimeError(f"the RPC server stopped: {failure[0] if failure else 'llama.cpp could not start it'}")
