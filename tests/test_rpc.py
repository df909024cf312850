"""llama.cpp's RPC backend: a real `dflash-local rpc-server` on 127.0.0.1 holds some of the target's layers, and
DFlash output equals plain decoding through it. Each model-loading run is its own process: registering an RPC
server is process-wide in llama.cpp, and a server that went away would abort later loads."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_local import _native
from dflash_local.llama_server import free_port
from dflash_local.rpc import parse_endpoints

pytestmark = pytest.mark.skipif(not _native.supports_rpc(), reason="llama.cpp built without GGML_RPC")

TESTS = Path(__file__).parent


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "dflash_local", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def rpc_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dflash_local", "rpc-server", "-p", str(port), "-t", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail("rpc-server did not start: " + (proc.stdout.read() if proc.stdout else ""))
            time.sleep(0.2)
    yield f"127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def test_endpoints_are_parsed_as_llama_cpp_takes_them():
    assert parse_endpoints("127.0.0.1:50052,box:1") == [("127.0.0.1", 50052), ("box", 1)]
    assert parse_endpoints("[::1]:50052") == [("::1", 50052)]
    for bad in ("127.0.0.1", "host:port", ":50052", "host:0", "host:70000", "a:1,"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_endpoints(bad)


def test_an_unreachable_server_is_a_clear_error_not_an_abort(tiny_target):
    r = cli("generate", "-m", tiny_target, "--no-draft", "--rpc", f"127.0.0.1:{free_port()}", "-ngl", "1",
            "-p", "hi", "-n", "4")
    assert r.returncode == 2, r.stderr
    assert "cannot reach the RPC server at 127.0.0.1:" in r.stderr


def test_a_busy_port_is_a_clear_error(rpc_server):
    port = rpc_server.rsplit(":", 1)[1]
    r = cli("rpc-server", "-p", port, timeout=60)
    assert r.returncode == 2 and "cannot listen on 127.0.0.1:" + port in r.stderr, r.stderr


# Runs in a fresh process: the engine with the target's last layers on the RPC server, plain decoding and DFlash
# with a scripted drafter (every acceptance length, so rollback on the remote KV cache) on the same prompts.
SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from scripted import ScriptedDrafter
from dflash_local.engine.engine import Engine
from dflash_local.rpc import add_servers

n_dev = add_servers(sys.argv[2])
engine = Engine(sys.argv[3], sys.argv[4], n_ctx=512, n_gpu_layers=2, draft_policy="fixed")
prompts = json.loads(sys.argv[5])
out = {"devices": n_dev, "runs": []}
for i, p in enumerate(prompts):
    plain = engine.complete(p, max_tokens=40, draft=False)
    ids = engine.prompt_tokens(p)
    scripted = ScriptedDrafter(len(ids), plain.token_ids, engine.target.n_vocab, seed=i)
    spec = engine.complete(p, max_tokens=40, external_drafter=scripted)
    own = engine.complete(p, max_tokens=40)
    out["runs"].append([plain.token_ids, spec.token_ids, spec.summary.n_accepted, own.token_ids])
print(json.dumps(out))
"""


def test_dflash_is_lossless_with_layers_on_an_rpc_server(rpc_server, tiny_target, tiny_drafter):
    from conftest import make_prompts

    prompts = make_prompts(6, seed=7)
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(TESTS), rpc_server, str(tiny_target), str(tiny_drafter),
                        json.dumps(prompts)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "LLAMA_LOG_VERBOSITY": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["devices"] == 1
    accepted = 0
    for plain, scripted, n_accepted, own in out["runs"]:
        assert len(plain) == 40
        assert scripted == plain
        assert own == plain
        accepted += n_accepted
    assert accepted > 0  # partial acceptances happened, so rejected tokens were rolled back on the remote cache


def test_the_cli_offloads_layers_to_the_server(rpc_server, tiny_target, tiny_drafter):
    args = ["generate", "-m", tiny_target, "--rpc", rpc_server, "-ngl", "2", "--json", "-p", "Q: river code?\nA:",
            "-n", "32", "--draft-policy", "fixed"]
    spec = cli(*args, "-d", tiny_drafter, "-v")
    plain = cli(*args, "--no-draft")
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr[-2000:] + plain.stderr[-2000:]
    # llama.cpp's load log names the RPC device's buffers
    assert f"RPC0[{rpc_server}]" in spec.stderr or "RPC0" in spec.stderr, spec.stderr[-3000:]
    assert json.loads(spec.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
