"""`dflash-local bench --llama-server PATH`: the bench's prompts through upstream llama-server, plain and with its
speculative decoding, as rows beside ours.

One llama-server process per configuration, started once for all prompts (its start is not timed), with the engine's
threads, context size and GPU layers, one slot, on 127.0.0.1; otherwise with upstream's defaults (weight repacking
on, -fa auto, where ours are off), which --llama-server-args can change. Every prompt goes to /completion as the token
ids our rows decode from (chat prompts: our engine's chat template, so both sides read the same tokens), n_predict = -n,
temperature 0 (with --temp: the bench's temperature, top_k, top_p, min_p and each prompt's seed), each row's first
prompt afresh (`cache_prompt: false`) and a chat's later turns after its cache (`cache_prompt: true`: the turn's
prompt is the history with our plain answers, which where llama-server answered otherwise shares only a prefix with
what it holds); the output comes back as token ids (`return_tokens`) and is compared with ours.

Configurations: plain; --spec-type ngram-simple and ngram-mod (they draft with their own lengths, size_m 48 and
ngram-mod's n_max 64, and read neither --spec-draft-n-max nor --spec-draft-p-min, so they run once, with upstream's
defaults); --spec-type draft-dflash -md OUR_DRAFTER and draft-dflash,ngram-simple, each over --spec-draft-n-max 3/7 x
--spec-draft-p-min 0/0.5/0.75, of which n_max 3 and p_min 0 are upstream's defaults, and the fastest is marked best.
A configuration that fails to start, aborts or times out is a row with the reason, and the next one runs.
"""

from __future__ import annotations

import shlex
import statistics
from pathlib import Path

from .llama_server import Server, ServerError, free_port

SWEEP = [(n_max, p_min) for n_max in (3, 7) for p_min in (0.0, 0.5, 0.75)]
UPSTREAM_DEFAULTS = (3, 0.0)  # --spec-draft-n-max, --spec-draft-p-min (common/common.h)


def configurations(drafter: str) -> list[dict]:
    """name, spec-type, n_max, p_min and the flags of every configuration, plain first."""
    configs = [{"name": "plain", "type": None, "n_max": None, "p_min": None, "args": []}]
    for kind in ("ngram-simple", "ngram-mod"):
        configs.append({"name": kind, "type": kind, "n_max": None, "p_min": None, "args": ["--spec-type", kind]})
    for kind in ("draft-dflash", "draft-dflash,ngram-simple"):
        for n_max, p_min in SWEEP:
            configs.append({"name": f"{kind} n_max={n_max} p_min={p_min:g}", "type": kind, "n_max": n_max,
                            "p_min": p_min, "args": ["--spec-type", kind, "-md", drafter, "--spec-draft-n-max",
                                                     str(n_max), "--spec-draft-p-min", f"{p_min:g}"]})
    return configs


def run_configuration(binary: str, base_args: list[str], config: dict, extra_args: list[str],
                      prompt_ids: list[list[int]], max_tokens: int, log: Path, sampling: list[dict] | None = None,
                      reuse: list[bool] | None = None) -> tuple[list[dict] | None, str, str | None]:
    """(one completion per prompt, the command line, None), or (None, the command line, why it failed). reuse[i]:
    prompt i is a chat's next turn, after the cache the previous one left."""
    port = free_port()
    # the user's extra flags come last: llama.cpp takes the last value of a flag given twice
    argv = [binary, *base_args, "--port", str(port), *config["args"], *extra_args]
    try:
        with Server(argv, port, log) as server:
            done = []
            for i, ids in enumerate(prompt_ids):
                try:
                    done.append(server.complete(ids, max_tokens, sampling=sampling[i] if sampling else None,
                                                cache_prompt=bool(reuse and reuse[i])))
                except ServerError as e:
                    raise ServerError(f"prompt {i + 1} of {len(prompt_ids)}: {e}") from None
    except ServerError as e:
        return None, shlex.join(argv), f"{e} (log: {log.name})"
    return done, shlex.join(argv), None


def peer_row(config: dict, command: str, done: list[dict] | None, error: str | None, ours_plain: list[list[int]],
             its_plain: list[list[int]] | None, our_speed: float) -> dict:
    """bench.json's entry for one configuration. tokens_per_second is total decode tokens over total decode time
    (as our overall figures); mean_tokens_per_second the mean of llama-server's per-prompt predicted_per_second;
    wall_tokens_per_second all tokens over the requests' wall-clock time (prompt processing and HTTP included);
    prompt_tokens_per_second its prompt processing (the tokens it decoded: a chat's later turns reuse its cache);
    first_token_s its mean prompt time (its first token comes with it); end_to_end_s the requests' wall-clock seconds,
    summed."""
    row = {k: config[k] for k in ("name", "type", "n_max", "p_min")} | {
        "command": command, "upstream_defaults": config["type"] is not None and (
            config["n_max"] is None or (config["n_max"], config["p_min"]) == UPSTREAM_DEFAULTS),
        "best_of_sweep": False, "error": error, "prompts": 0, "tokens": 0, "tokens_per_second": None,
        "mean_tokens_per_second": None, "wall_tokens_per_second": None, "speedup_vs_our_plain": None,
        "prompt_tokens_per_second": None, "first_token_s": None, "end_to_end_s": None,
        "drafted": None, "accepted": None, "acceptance": None, "identical_to_our_plain": None,
        "identical_to_its_plain": None}
    if done is None:
        return row
    decode_ms = sum(d["predicted_ms"] for d in done)
    speed = sum(max(d["predicted_n"] - 1, 0) for d in done) / (decode_ms / 1000) if decode_ms else 0.0
    drafted, accepted = sum(d["draft_n"] for d in done), sum(d["draft_n_accepted"] for d in done)
    row |= {
        "prompts": len(done), "tokens": sum(d["predicted_n"] for d in done), "tokens_per_second": speed,
        "mean_tokens_per_second": statistics.mean(d["predicted_per_second"] for d in done),
        "wall_tokens_per_second": sum(d["predicted_n"] for d in done) / sum(d["wall_s"] for d in done),
        "prompt_tokens_per_second": sum(d["prompt_n"] for d in done) / (sum(d["prompt_ms"] for d in done) / 1000),
        "first_token_s": statistics.mean(d["prompt_ms"] for d in done) / 1000,
        "end_to_end_s": sum(d["wall_s"] for d in done),
        "speedup_vs_our_plain": speed / our_speed if our_speed else None,
        "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None,
        "identical_to_our_plain": sum(d["tokens"] == ours for d, ours in zip(done, ours_plain)),
        "identical_to_its_plain": None if its_plain is None else sum(
            d["tokens"] == its for d, its in zip(done, its_plain)),
    }
    return row


def run_peers(binary: str, extra_args: list[str], engine, prompt_ids: list[list[int]], ours_plain: list[list[int]],
              max_tokens: int, our_speed: float, log_dir: Path, log=print,
              sampling: list[dict] | None = None, reuse: list[bool] | None = None) -> list[dict]:
    """Every configuration over every prompt (greedy, or each prompt with its `sampling`; reuse: run_configuration's):
    bench.json's overall["peers"]."""
    log_dir.mkdir(parents=True, exist_ok=True)
    p = engine.placement
    ngl = "all" if p.n_gpu_layers < 0 else str(p.n_gpu_layers)
    base_args = ["-m", str(engine.target_info.path), "--host", "127.0.0.1", "-np", "1", "-c", str(engine.n_ctx),
                 "-t", str(engine.n_threads), "-tb", str(p.n_threads_batch or engine.n_threads), "-ngl", ngl]
    rows, its_plain = [], None
    for config in configurations(str(engine.draft_path)):
        name = config["name"].replace(",", "+").replace(" ", "_")
        done, command, error = run_configuration(binary, base_args, config, extra_args, prompt_ids, max_tokens,
                                                 log_dir / f"llama-server-{name}.log", sampling, reuse)
        if config["type"] is None and done is not None:
            its_plain = [d["tokens"] for d in done]
        rows.append(peer_row(config, command, done, error, ours_plain, its_plain, our_speed))
        r = rows[-1]
        log(f"llama-server {r['name']}: " + (r["error"] if error else f"{r['tokens_per_second']:.1f} tok/s"
            + (f", acceptance {r['acceptance']:.2f}" if r["acceptance"] is not None else "")))
    for kind in ("draft-dflash", "draft-dflash,ngram-simple"):
        ran = [r for r in rows if r["type"] == kind and r["error"] is None]
        if ran:
            max(ran, key=lambda r: r["tokens_per_second"])["best_of_sweep"] = True
    return rows


def markdown(peers: list[dict], n_prompts: int) -> str:
    lines = ["| llama-server | tok/s | mean tok/s | wall tok/s | vs our plain | acceptance | = our plain | "
             "= its plain | prompt tok/s | first token s | end to end s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in peers:
        name = r["name"] + (" (upstream defaults)" if r["upstream_defaults"] and r["n_max"] is not None else "") + (
            " **best of sweep**" if r["best_of_sweep"] else "")
        if r["error"]:
            lines.append(f"| {name} | {r['error'].replace('|', '/')} | | | | | | | | | |")
            continue
        acceptance = "" if r["type"] is None else "none drafted" if not r["drafted"] else f"{r['acceptance']:.2f}"
        lines.append(f"| {name} | {r['tokens_per_second']:.1f} | {r['mean_tokens_per_second']:.1f} | "
                     f"{r['wall_tokens_per_second']:.1f} | {r['speedup_vs_our_plain']:.2f} | "
                     f"{acceptance} | {r['identical_to_our_plain']}/{n_prompts} | "
                     + (f"{r['identical_to_its_plain']}/{n_prompts} |" if r["identical_to_its_plain"] is not None
                        else " |")
                     + f" {r['prompt_tokens_per_second']:.1f} | {r['first_token_s']:.2f} | {r['end_to_end_s']:.1f} |")
    command = next((r["command"] for r in peers if r["type"] is None), peers[0]["command"])
    lines += ["", "tok/s: total decode tokens over total decode time (llama-server's timings; the first token of each "
              "prompt comes with its prompt, as in our rows); mean tok/s: mean of its per-prompt predicted_per_second; "
              "wall tok/s: tokens over each request's wall-clock time, prompt processing and HTTP included; prompt "
              "tok/s: its prompt processing (a chat's later turns after its cache); first token s: its mean prompt "
              "time; end to end s: the requests' wall-clock seconds. "
              "Acceptance: draft tokens accepted / drafted. = our plain, = its plain: outputs token-identical to our "
              "plain greedy decoding, to llama-server's plain run. Prompts sent as our token ids (chat prompts through "
              "our chat template). n-gram types ignore --spec-draft-n-max/--spec-draft-p-min and run once. Upstream's "
              "defaults apply beyond threads, context and GPU layers (weight repacking on, -fa auto; ours: repacking "
              "off, -fa on for a CPU target). "
              f"Plain: `{command}`."]
    return "\n".join(lines) + "\n"
