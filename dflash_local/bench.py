"""`dflash-local bench`: baseline vs DFlash on a prompt set, in one process, with the costs that explain the result.

Per prompt and overall: baseline and DFlash tokens/s (with the adaptive draft length, the default, and with full
blocks), speedup, mean acceptance length tau and acceptance per block position (of the full-block runs, where every
position is tried); the target's verify cost T(k) for k = 1..B, the draft cost, and the ideal speedup they imply
(tau * T(1) / (T(B) + draft)); with the engine's n-gram lookup (--spec-type ngram-simple), DFlash with n-gram drafts
too (the other DFlash rows leave them out: they measure the drafter); llama-cpp-python's prompt-lookup decoding as a
peer row; with --llama-server, upstream llama-server's plain and speculative configurations over the same prompts
(peers.py), after ours. Greedy outputs must be token-identical to the baseline: any mismatch fails the run.

With --temp above 0 every row samples (the chain --top-k, --top-p, --min-p, llama.cpp's defaults unless given; prompt i
with seed --seed + i, llama-server's rows too): the DFlash rows verify by matching the target's own sample, so their
outputs must equal the sampled baseline's, and a row verifying by rejection sampling (--spec-sampling rejection: the
same distribution, other tokens) reports its speed and acceptance beside them. The prompt-lookup peer is greedy only
and is left out.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from . import _native, peers
from .engine.engine import Engine
from .extras import install_hint
from .engine.stats import pooled

NO_PLOT = f"dflash-local bench: matplotlib is not installed, so no bench.png ({install_hint('bench')})"

DEFAULT_PROMPTS = [
    {"prompt": "Write a Python function that checks whether a string is a palindrome.\n\n```python\n"},
    {"prompt": "The three most important inventions of the nineteenth century were"},
    {"prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
    {"prompt": "A recipe for a simple tomato soup:\n\nIngredients:\n"},
    {"prompt": "Explain how a hash table works, step by step."},
    {"prompt": "class Stack:\n    def __init__(self):\n"},
    {"prompt": "The history of the bicycle begins in"},
    {"prompt": "SELECT name, COUNT(*) FROM orders"},
    {"prompt": "Once upon a time, in a small village by the sea,"},
    {"prompt": "The main differences between TCP and UDP are"},
]


def load_prompts(path: str | None) -> list[dict]:
    if path is None:
        return DEFAULT_PROMPTS
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row, dict) or sum(k in row for k in ("prompt", "messages", "turns")) != 1:
            raise ValueError(f"{path}:{i}: each line needs exactly one of 'prompt', 'messages' or 'turns'")
        turns = row.get("turns", ["-"])
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(f"{path}:{i}: 'turns' is a list of user messages (non-empty strings), the chat's turns")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def own_continuation(s, last: int, n: int, sp) -> list[int]:
    """`last` and the target's own continuation of n tokens (plain steps, sampling sp); the session is put back."""
    p0, out = s.n_past, [last]
    for i in range(n):
        out += s.step(out[-1], [], sp, i + 1).tokens
    s.truncate(p0)
    return out


def verify_cost_curve(engine: Engine, block: int, repeats: int = 5, rejected: bool = False) -> dict[int, float]:
    """Median target time T(k) for verifying k tokens, k = 1..block, whose drafts are all accepted (the target's own
    greedy continuation: on CPUs the LM head runs only for the rows read, so this is a batch's full cost); rejected:
    whose first draft is rejected instead (the layers of k rows and one row of the head)."""
    s, sp = engine.session, _native.Sampling()
    s.set_capture(False)
    s.truncate(0)
    engine.cache.clear()  # the session is driven by hand here
    ids = engine.prompt_tokens(DEFAULT_PROMPTS[1]["prompt"])
    last = s.prefill(ids, sp, 0)
    s.checkpoint()  # a recurrent or window target comes back to p0 from here (a no-op for others)
    p0, own = s.n_past, own_continuation(s, last, block - 1, sp)
    if rejected:  # drafts of a token that is not the target's next one
        own = [last] + [(own_continuation(s, last, 1, sp)[1] + 1) % engine.target.n_vocab] * (block - 1)
    s.step(last, own[1:block], sp, 1, block)  # untimed: the first batch of a size pays for its buffers
    s.truncate(p0)
    curve = {}
    for k in range(1, block + 1):
        times = []
        for _ in range(repeats):
            r = s.step(last, own[1:k], sp, 1, 1 if rejected else k)
            times.append(r.verify_ms)
            s.truncate(p0)  # measure every k at the same place
        curve[k] = statistics.median(times)
    s.truncate(0)
    return curve


# the peer runs in a process of its own: one that crashes (llama.cpp's AMX matmul does, on Intel CPUs with AMX) is a
# row that says so, not the end of the bench
PEER_CHILD = [sys.executable, "-c", "from dflash_local.bench import prompt_lookup_child; prompt_lookup_child()"]


def run_peer(argv: list[str], job: dict, timeout: float = 3600) -> tuple[dict | None, str | None]:
    """Run a peer process with `job` as JSON on its stdin: (its JSON result, None), or (None, why it failed)."""
    try:
        # from a neutral folder: `python -c` puts the working directory first on sys.path, and in the repository root
        # that is the source tree, without the built native module
        r = subprocess.run(argv, input=json.dumps(job), capture_output=True, text=True, timeout=timeout,
                           cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:g} s"
    if r.returncode < 0:
        return None, f"crashed ({signal.Signals(-r.returncode).name})"
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"failed (exit {r.returncode}): {last[:200]}"
    return json.loads(lines[-1]), None


def prompt_lookup_child() -> None:
    """The peer process: llama-cpp-python's own prompt-lookup speculative decoding (what a user might pick instead)
    on one prompt; prints its tokens/s."""
    import llama_cpp.llama_cpp as ll
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    job = json.load(sys.stdin)
    # Llama() has no switch for ggml's extra buffer types and turns them on; our models load without them (AMX CPUs
    # crash in them), and so does the peer
    defaults = ll.llama_model_default_params

    def without_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    ll.llama_model_default_params = without_extra_buffers
    llm = Llama(job["model"], n_ctx=job["n_ctx"], n_threads=job["n_threads"], verbose=False,
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))
    row = job["row"]
    t0 = time.perf_counter()
    if "messages" in row:
        out = llm.create_chat_completion(row["messages"], max_tokens=job["max_tokens"], temperature=0)
    else:
        out = llm.create_completion(row["prompt"], max_tokens=job["max_tokens"], temperature=0)
    print(json.dumps({"tokens_per_second": out["usage"]["completion_tokens"] / (time.perf_counter() - t0)}))


def prompt_lookup_speed(model_path, row: dict, max_tokens: int, n_threads: int, n_ctx: int):
    """(tokens/s, None) of the prompt-lookup peer on one prompt, or (None, why it failed)."""
    job = {"model": str(model_path), "row": row, "max_tokens": max_tokens, "n_threads": n_threads, "n_ctx": n_ctx}
    out, error = run_peer(PEER_CHILD, job)
    return (out["tokens_per_second"] if out else None), error


def row_request(row: dict) -> dict:
    """Engine.complete's arguments for a prompt row: a raw prompt or chat messages (a 'turns' row: its first turn)."""
    if "turns" in row:
        return {"messages": [{"role": "user", "content": row["turns"][0]}]}
    return {"messages": row["messages"]} if "messages" in row else {"prompt": row["prompt"]}


def prompt_sampling(sampling: dict | None, i: int) -> dict:
    """Prompt i's sampling: the bench's, with seed + i; {} when greedy."""
    return sampling | {"seed": sampling["seed"] + i} if sampling else {}


def run_bench(engine: Engine, prompts: list[dict], max_tokens: int, peer: bool = True, log=print,
              llama_server: str | None = None, llama_server_args: list[str] = (), out: Path | None = None,
              sampling: dict | None = None) -> dict:
    """Our rows for every prompt; with llama_server (its path), its rows after ours, logs in `out`. sampling:
    temperature, top_k, top_p, min_p and seed of sampled rows (None: greedy)."""
    # the peers' requests: every turn of every row, a turn after the previous turn's cache (reuse), with its row's
    # sampling
    rows, prompt_ids, plain_ids, reuse, request_sampling = [], [], [], [], []
    peer = peer and not sampling
    for i, row in enumerate(prompts):
        r, ids, plain = bench_prompt(engine, row, max_tokens, peer, prompt_sampling(sampling, i))
        rows.append(r)
        prompt_ids += ids
        plain_ids += plain
        reuse += [k > 0 for k in range(len(ids))]
        request_sampling += [prompt_sampling(sampling, i)] * len(ids)
        log(f"[{i + 1}/{len(prompts)}] baseline {r['baseline_tokens_per_second']:.1f} tok/s, dflash "
            f"{r['dflash_tokens_per_second']:.1f} tok/s, tau {r['mean_acceptance_length']:.2f}"
            + (f", with n-gram drafts {r['ngram_tokens_per_second']:.1f} tok/s" if engine.ngram else "")
            + (f", rejection sampling {r['rejection_tokens_per_second']:.1f} tok/s, tau "
               f"{r['rejection_mean_acceptance_length']:.2f}" if "rejection_tokens_per_second" in r else "")
            + (f", prompt-lookup peer {r['prompt_lookup_error']}" if r.get("prompt_lookup_error") else "")
            + ("" if r["lossless"] else "  OUTPUT MISMATCH"))
    overall = summarize(engine, rows, max_tokens, peer)
    overall["sampling"] = sampling
    if rows and "rejection_tokens_per_second" in rows[0]:
        overall["rejection_tokens_per_second"] = _pooled_speed(rows, "rejection_tokens_per_second")
        overall["rejection_mean_acceptance_length"] = statistics.mean(
            r["rejection_mean_acceptance_length"] for r in rows)
    elif sampling:
        overall["rejection_unsupported"] = engine.rejection_unsupported()
    if llama_server:
        overall["peers"] = peers.run_peers(llama_server, list(llama_server_args), engine, prompt_ids, plain_ids,
                                           max_tokens, overall["baseline_tokens_per_second"], out, log,
                                           request_sampling if sampling else None, reuse)
    return {"rows": rows, "overall": overall}


def _pooled_speed(rows: list[dict], key: str) -> float:
    """Total tokens over total time of the rows' runs at `key` tokens/s."""
    seconds = sum(r["tokens"] / r[key] for r in rows if r[key])
    return sum(r["tokens"] for r in rows) / seconds if seconds else 0.0


def converse(engine: Engine, row: dict, max_tokens: int, afresh: bool, **kw) -> tuple[list, list[dict]]:
    """One mode's pass over a row: its completions and their requests. A 'turns' row is a chat whose history grows:
    each user turn after the conversation so far (this pass's own answers), reusing the cache the previous turn
    left. afresh: the first prompt decoded from nothing, as a new conversation's is; else it may reuse the cache."""
    turns = row.get("turns")
    done, requests, messages = [], [], []
    for k in range(len(turns) if turns else 1):
        if turns:
            messages = messages + [{"role": "user", "content": turns[k]}]
        requests.append({"messages": messages} if turns else row_request(row))
        done.append(engine.complete(**requests[k], **kw, max_tokens=max_tokens, cache_prompt=not (afresh and k == 0)))
        if turns:
            messages = messages + [{"role": "assistant", "content": done[k].text}]
    return done, requests


def decode_speed(done: list) -> float:
    """Decode tokens/s of a pass: tokens made by decode steps over their time (each turn's first token comes with
    its prompt)."""
    ms = sum(d.summary.decode_ms for d in done)
    return sum(max(len(d.token_ids) - 1, 0) for d in done) / (ms / 1000) if ms else 0.0


def end_to_end_s(done: list) -> float:
    return sum(d.summary.prompt_ms + d.summary.decode_ms for d in done) / 1000


def bench_prompt(engine: Engine, row: dict, max_tokens: int, peer: bool,
                 sampling: dict | None = None) -> tuple[dict, list[list[int]], list[list[int]]]:
    """One row's figures (plain, fixed blocks, the adaptive policy, the default with n-gram drafts, the prompt-lookup
    peer; sampled: rejection sampling too), each turn's prompt token ids and plain decoding's output. Plain and the
    default process their prompts themselves (a turn after the previous turn's cache, as a chat does); the DFlash-only
    runs may reuse what the cache holds."""
    kw = sampling or {}
    base, requests = converse(engine, row, max_tokens, True, **kw, draft=False)
    engine.draft_policy = "auto"
    default, _ = converse(engine, row, max_tokens, True, **kw, draft=True)  # n-gram drafts too, when on
    engine.draft_policy = "fixed"
    fixed, _ = converse(engine, row, max_tokens, False, **kw, draft=True, ngram=False)
    engine.draft_policy = "auto"
    spec = converse(engine, row, max_tokens, False, **kw, draft=True, ngram=False)[0] if engine.ngram else default
    s, f = pooled([d.summary for d in spec]), pooled([d.summary for d in fixed])
    plain_speed = decode_speed(base)
    first = row["prompt"] if "prompt" in row else row["turns"][0] if "turns" in row else row["messages"][-1]["content"]
    r = {
        "prompt": first[:60],
        "turns": len(base),
        "tokens": sum(len(d.token_ids) for d in base),
        # prompt tokens each mode decoded (less what a turn reused from the previous turn's cache), the time to each
        # turn's first token, and each run's end to end: what a client waits for the whole answer
        "prompt_tokens": sum(d.summary.n_prompt - d.summary.n_cached for d in base),
        "context_tokens": base[-1].summary.n_prompt + len(base[-1].token_ids),
        "prompt_ms": sum(d.summary.prompt_ms for d in base),
        "first_token_s": [d.summary.prompt_ms / 1000 for d in base],
        "ngram_first_token_s": [d.summary.prompt_ms / 1000 for d in default],
        "baseline_end_to_end_s": end_to_end_s(base),
        "ngram_end_to_end_s": end_to_end_s(default),
        "baseline_tokens_per_second": plain_speed,
        "dflash_tokens_per_second": decode_speed(spec),
        "speedup": decode_speed(spec) / plain_speed if plain_speed else 0,
        "mean_acceptance_length": s.mean_acceptance_length,
        "acceptance_rate": s.acceptance_rate,
        "draft_ms_per_step": s.draft_ms / s.steps if s.steps else 0.0,
        "verify_ms_per_step": s.verify_ms / s.steps if s.steps else 0.0,
        "rollback_ms_per_step": s.rollback_ms / s.steps if s.steps else 0.0,
        "dflash_fixed_tokens_per_second": decode_speed(fixed),
        "fixed_mean_acceptance_length": f.mean_acceptance_length,
        "lossless": all(len({tuple(d.token_ids) for d in turn}) == 1 for turn in zip(base, default, fixed, spec)),
        "_summary": f,
    }
    if sampling and not engine.rejection_unsupported():  # a DFlash2 or DSpark drafter has no rejection row
        rej, _ = converse(engine, row, max_tokens, False, **kw, draft=True, ngram=False, spec_sampling="rejection")
        r["rejection_tokens_per_second"] = decode_speed(rej)
        r["rejection_mean_acceptance_length"] = pooled([d.summary for d in rej]).mean_acceptance_length
    if engine.ngram:
        r["ngram_tokens_per_second"] = decode_speed(default)
        r["ngram_speedup"] = decode_speed(default) / plain_speed if plain_speed else 0
        r["_ngram_summary"] = pooled([d.summary for d in default])
    if peer:  # llama-cpp-python has no prompt cache across its processes: a conversation's last turn, whole
        r["prompt_lookup_tokens_per_second"], r["prompt_lookup_error"] = prompt_lookup_speed(
            engine.target_info.path, requests[-1], max_tokens, engine.n_threads, engine.n_ctx)
    return r, [engine.prompt_tokens(**q) for q in requests], [d.token_ids for d in base]


def summarize(engine: Engine, rows: list[dict], max_tokens: int, peer: bool) -> dict:
    """bench.json's overall figures: speeds as total tokens over total time, the fixed-block runs' acceptance and
    costs, the verify cost curve (measured here)."""
    block = engine.max_draft + 1  # tokens a full block verifies
    curve = verify_cost_curve(engine, block)
    fixed = pooled([r.pop("_summary") for r in rows])
    both = pooled([r.pop("_ngram_summary") for r in rows]) if engine.ngram else None
    steps = fixed.steps

    tau = fixed.mean_acceptance_length
    draft_ms = fixed.draft_ms / steps if steps else 0.0
    n_rollbacks = fixed.n_rollbacks
    overall = {
        "baseline_tokens_per_second": _pooled_speed(rows, "baseline_tokens_per_second"),
        "prompt_tokens_per_second": sum(r["prompt_tokens"] for r in rows) / (sum(r["prompt_ms"] for r in rows) / 1000),
        "baseline_end_to_end_s": sum(r["baseline_end_to_end_s"] for r in rows),
        "ngram_end_to_end_s": sum(r["ngram_end_to_end_s"] for r in rows),
        # time to first token: the mean over every turn of every row, and the longest
        "first_token_s": statistics.mean(t for r in rows for t in r["first_token_s"]),
        "first_token_max_s": max(t for r in rows for t in r["first_token_s"]),
        "ngram_first_token_s": statistics.mean(t for r in rows for t in r["ngram_first_token_s"]),
        "requests": sum(r["turns"] for r in rows),
        "dflash_tokens_per_second": _pooled_speed(rows, "dflash_tokens_per_second"),
        "dflash_fixed_tokens_per_second": _pooled_speed(rows, "dflash_fixed_tokens_per_second"),
        "mean_acceptance_length": tau,
        "acceptance_rate": fixed.acceptance_rate,
        "verify_ms": curve,
        "draft_ms_per_step": draft_ms,
        # fixed-block runs: the time dropping rejected drafts, per step and per step that rolled back
        "rollback_ms_per_step": fixed.rollback_ms / steps if steps else 0.0,
        "rollback_ms_per_rollback": fixed.rollback_ms / n_rollbacks if n_rollbacks else 0.0,
        "checkpoint_rollbacks": fixed.n_checkpoint_rollbacks,
        "rollbacks": n_rollbacks,
        "ideal_speedup": tau * curve[1] / (curve[block] + draft_ms) if block in curve else 0.0,
        "lossless": all(r["lossless"] for r in rows),
        "block_size": engine.block_size,
        "prompts": len(rows),
        "max_tokens": max_tokens,
        "model": engine.model_info(),
    }
    base_speed = overall["baseline_tokens_per_second"]
    overall["speedup"] = overall["dflash_tokens_per_second"] / base_speed if base_speed else 0.0
    overall["speedup_fixed"] = overall["dflash_fixed_tokens_per_second"] / base_speed if base_speed else 0.0
    if both is not None:
        overall["ngram_tokens_per_second"] = _pooled_speed(rows, "ngram_tokens_per_second")
        overall["speedup_ngram"] = overall["ngram_tokens_per_second"] / base_speed if base_speed else 0.0
        overall["ngram"] = {"size_n": engine.ngram.size_n, "size_m": engine.ngram.size_m,
                            "steps": both.steps, "ngram_steps": both.ngram_steps,
                            "ngram_accepted": both.ngram_accepted,
                            "mean_acceptance_length": both.mean_acceptance_length}
    if peer:
        speeds = [r["prompt_lookup_tokens_per_second"] for r in rows if r["prompt_lookup_tokens_per_second"]]
        overall["prompt_lookup_tokens_per_second"] = statistics.mean(speeds) if speeds else None
        overall["prompt_lookup_errors"] = sum(1 for r in rows if r["prompt_lookup_error"])
    return overall


def _speed(tokens_per_second: float | None, error: str | None) -> str:
    return f"{tokens_per_second:.1f}" if tokens_per_second else str(error)


def markdown(result: dict) -> str:
    o = result["overall"]
    peer = "prompt_lookup_tokens_per_second" in o
    ngram = "ngram_tokens_per_second" in o
    head = ("| prompt | tokens | first token s | baseline tok/s | DFlash tok/s | speedup | fixed-block DFlash tok/s | "
            "tau (fixed) |"
            + (" DFlash + n-gram tok/s | speedup |" if ngram else "") + (" prompt lookup tok/s |" if peer else ""))
    sampling = o.get("sampling")
    rejection = "rejection_tokens_per_second" in o
    if rejection:
        head += " rejection sampling tok/s | tau (rejection) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in result["rows"]:
        lines.append(f"| {r['prompt'][:40]!r}{' (%d turns)' % r['turns'] if r['turns'] > 1 else ''} | {r['tokens']} | "
                     f"{statistics.mean(r['first_token_s']):.2f} | {r['baseline_tokens_per_second']:.1f} | "
                     f"{r['dflash_tokens_per_second']:.1f} | {r['speedup']:.2f} | "
                     f"{r['dflash_fixed_tokens_per_second']:.1f} | {r['fixed_mean_acceptance_length']:.2f} |"
                     + (f" {r['ngram_tokens_per_second']:.1f} | {r['ngram_speedup']:.2f} |" if ngram else "")
                     + (f" {_speed(r['prompt_lookup_tokens_per_second'], r['prompt_lookup_error'])} |" if peer
                        else "")
                     + (f" {r['rejection_tokens_per_second']:.1f} | {r['rejection_mean_acceptance_length']:.2f} |"
                        if rejection else ""))
    lines.append(f"| **overall** | | {o['first_token_s']:.2f} | {o['baseline_tokens_per_second']:.1f} | {o['dflash_tokens_per_second']:.1f} | "
                 f"{o['speedup']:.2f} | {o['dflash_fixed_tokens_per_second']:.1f} | {o['mean_acceptance_length']:.2f} |"
                 + (f" {o['ngram_tokens_per_second']:.1f} | {o['speedup_ngram']:.2f} |" if ngram else "")
                 + (f" {_speed(o['prompt_lookup_tokens_per_second'], 'failed on every prompt')} |" if peer
                    else "")
                 + (f" {o['rejection_tokens_per_second']:.1f} | {o['rejection_mean_acceptance_length']:.2f} |"
                    if rejection else ""))
    curve = ", ".join(f"T({k})={v:.1f}" for k, v in o["verify_ms"].items())
    lines += ["", f"Verify cost (ms): {curve}. Draft cost {o['draft_ms_per_step']:.1f} ms per step. "
              f"Rollback {o['rollback_ms_per_rollback']:.3f} ms per rejected draft ({o['rollbacks']} rollbacks, "
              f"{o['checkpoint_rollbacks']} by checkpoint + replay). "
              f"Ideal speedup tau*T(1)/(T(B)+draft) = {o['ideal_speedup']:.2f}. "
              f"Acceptance by block position: {' '.join(f'{a:.2f}' for a in o['acceptance_rate'])}. "
              f"Lossless: {o['lossless']}. Prompt processing {o['prompt_tokens_per_second']:.1f} tok/s "
              f"({sum(r['prompt_tokens'] for r in result['rows'])} prompt tokens decoded: each row's first prompt "
              f"afresh, a later turn after the previous turn's cache); time to first token {o['first_token_s']:.2f} s "
              f"mean, {o['first_token_max_s']:.2f} s the longest (plain)"
              + (f", {o['ngram_first_token_s']:.2f} s mean the default" if ngram else "")
              + f"; end to end (prompt processing and decoding, all {o['requests']} requests) "
              f"{o['baseline_end_to_end_s']:.1f} s plain"
              + (f", {o['ngram_end_to_end_s']:.1f} s the default (DFlash + n-gram)" if ngram else "") + "."]
    if sampling:
        lines[-1] += (f" Sampled: temperature {sampling['temperature']:g}, top-k {sampling['top_k']}, top-p "
                      f"{sampling['top_p']:g}, min-p {sampling['min_p']:g}, prompt i with seed {sampling['seed']} + i; "
                      "the DFlash rows verify by matching the target's sample (lossless: the sampled baseline's "
                      "tokens)" + (", the rejection-sampling row by speculative sampling (the same distribution)."
                                   if rejection else "; no rejection-sampling row: "
                                   + str(o.get("rejection_unsupported")) + "."))
    if peer and o["prompt_lookup_errors"]:
        errors = [r["prompt_lookup_error"] for r in result["rows"] if r["prompt_lookup_error"]]
        lines[-1] += f" The prompt-lookup peer failed on {len(errors)} of {o['prompts']} prompts ({errors[0]})."
    if ngram:
        g = o["ngram"]
        lines[-1] += (f" With n-gram drafts (ngram-simple, n = {g['size_n']}, m = {g['size_m']}): "
                      f"{g['ngram_steps']} of {g['steps']} steps drafted by the lookup, {g['ngram_accepted']} of "
                      f"their tokens accepted; tau {g['mean_acceptance_length']:.2f}.")
    if "peers" in o:
        lines += ["", peers.markdown(o["peers"], o["requests"]).rstrip("\n")]
    return "\n".join(lines) + "\n"


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    o = result["overall"]
    ran = [r for r in o.get("peers", []) if r["error"] is None]
    fig, axes = plt.subplots(1, 3 if ran else 2, figsize=(16 if ran else 10, 4))
    a, b = axes[:2]
    ks = list(o["verify_ms"])
    a.plot(ks, [o["verify_ms"][k] for k in ks], marker="o")
    a.set(xlabel="tokens verified (k)", ylabel="target verify time T(k), ms", title="Verify cost")
    b.bar(range(1, len(o["acceptance_rate"]) + 1), o["acceptance_rate"])
    b.set(xlabel="block position", ylabel="acceptance rate", ylim=(0, 1),
          title=f"tau {o['mean_acceptance_length']:.2f}, speedup {o['speedup']:.2f}x")
    if ran:  # a bar per llama-server configuration that ran, under ours
        ours = [("ours: plain", o["baseline_tokens_per_second"]), ("ours: DFlash", o["dflash_tokens_per_second"])]
        if "ngram_tokens_per_second" in o:
            ours.append(("ours: DFlash + n-gram", o["ngram_tokens_per_second"]))
        bars = ours + [(f"llama-server {r['name']}", r["tokens_per_second"]) for r in ran]
        axes[2].barh(range(len(bars)), [v for _, v in bars], color=["C1"] * len(ours) + ["C0"] * len(ran))
        axes[2].set_yticks(range(len(bars)), [n for n, _ in bars], fontsize=6)
        axes[2].invert_yaxis()
        axes[2].set(xlabel="decode tokens/s", title="Ours and llama-server")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(result: dict, out: Path, with_plot: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "bench.md").write_text(markdown(result))
    if with_plot:
        plot(result, out / "bench.png")
    else:
        (out / "bench.png").unlink(missing_ok=True)  # an earlier run's picture would not match these results


def llama_server_args(path: str | None, extra: str | None) -> list[str]:
    """--llama-server-args as a list, after checking that --llama-server is a program."""
    if extra is not None and path is None:
        raise ValueError("--llama-server-args goes with --llama-server PATH")
    if path is not None and not (Path(path).is_file() and os.access(path, os.X_OK)):
        raise ValueError(f"--llama-server {path}: not an executable file")
    try:
        return shlex.split(extra or "")
    except ValueError as e:
        raise ValueError(f"--llama-server-args {extra!r}: {e}") from None


def cmd_bench(args, load_engine: Callable[[], Engine]) -> int:
    # the plot is the only part that needs matplotlib (the bench extra): without it the run goes on, said up front
    with_plot = have_matplotlib()
    if not with_plot:
        print(NO_PLOT, file=sys.stderr)
    prompts = load_prompts(args.prompts)
    if args.reasoning != "auto" and all("prompt" in row for row in prompts):
        raise ValueError("--reasoning sets enable_thinking in the chat template: it needs chat prompts ('messages' "
                         "or 'turns' rows in --prompts)")
    server_args = llama_server_args(args.llama_server, args.llama_server_args)  # bad flags fail before the models load
    engine = load_engine()
    sampling = {"temperature": args.temp, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
                "seed": args.seed} if args.temp > 0 else None
    result = run_bench(engine, prompts, args.max_tokens, peer=not args.no_peer,
                       log=lambda m: print(m, file=sys.stderr), llama_server=args.llama_server,
                       llama_server_args=server_args, out=Path(args.out), sampling=sampling)
    result["overall"]["reasoning"] = args.reasoning  # thinking on/off for the chat prompts, or the template's default
    write_outputs(result, Path(args.out), with_plot)
    print(markdown(result))
    if not with_plot:
        print(NO_PLOT, file=sys.stderr)
    if not result["overall"]["lossless"]:
        print("dflash-local: error: a DFlash output differs from the baseline", file=sys.stderr)
        return 1
    return 0
