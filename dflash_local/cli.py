"""The `dflash-local` command line. Each command imports what it runs when it runs: torch (train, --draft-backend
torch) and matplotlib (bench's plot) are optional extras, and convert, inspect and pull do not load llama.cpp."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from .extras import MissingExtraError
from .gguf_file import GGUFError
from .engine.ngram import NgramSpec
from .engine.placement import add_placement_args, from_args


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="target GGUF, or a built-in pair: smollm2 (SmolLM2-135M-Instruct, the "
                   "default) or gemma (gemma-3-270m, a base model), each with its shipped drafter")
    p.add_argument("-d", "--draft", help="DFlash drafter GGUF for the target")
    p.add_argument("--no-draft", action="store_true", help="plain decoding (the baseline), drafter not loaded")
    p.add_argument("--spec-type", type=_spec_types, default="ngram-simple,dflash", metavar="TYPES",
                   help="comma-separated speculative types, as llama.cpp names them: ngram-simple (repeats in the "
                   "context, no model; tried first at each step) and dflash (the drafter); default: both")
    p.add_argument("--spec-ngram-simple-size-n", type=int, default=NgramSpec.size_n, metavar="N",
                   help=f"ngram-simple: tokens matched, the context's newest N (default {NgramSpec.size_n})")
    p.add_argument("--spec-ngram-simple-size-m", type=int, default=NgramSpec.size_m, metavar="M",
                   help=f"ngram-simple: tokens drafted at most, those that followed the match (default "
                   f"{NgramSpec.size_m})")
    p.add_argument("-c", "--ctx-size", type=int,
                   help="context size in tokens (default 4096; 0: the model's trained context); serve splits it "
                   "across its slots (default: 4096 each)")
    p.add_argument("--block-size", type=int, help="draft block size (default: the drafter's trained size)")
    p.add_argument("--draft-backend", choices=["ggml", "torch"], default="ggml",
                   help="run the drafter in llama.cpp (ggml, default) or in PyTorch (torch)")
    p.add_argument("--draft-device", choices=["cpu", "cuda", "mps"], default="cpu",
                   help="device of the PyTorch drafter (with --draft-backend torch)")
    p.add_argument("--draft-policy", choices=["auto", "fixed"], default="auto",
                   help="auto (default): draft as many tokens as a cost model expects to be fastest; fixed: full blocks")
    p.add_argument("--spec-sampling", choices=["match", "rejection"], default="match",
                   help="how sampled drafts are verified: match (default: output identical to plain decoding with "
                   "the same seed) or rejection (speculative sampling with the drafter's distribution: the target's "
                   "distribution, more drafts accepted at temperatures > 0; llama.cpp drafter only)")
    p.add_argument("--capture", choices=["auto", "layer_api", "callback"], default="auto", help=argparse.SUPPRESS)
    p.add_argument("--rpc", metavar="SERVERS", help="comma-separated rpc-servers (HOST:PORT) whose devices take the "
                   "offloaded layers (-ngl), see `dflash-local rpc-server`")
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")
    add_placement_args(p)


SPEC_TYPES = ("ngram-simple", "dflash")


def _spec_types(text: str) -> list[str]:
    types = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in types if t not in SPEC_TYPES]
    if unknown or not types:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'nothing'}: the types are {', '.join(SPEC_TYPES)}")
    return types


def _template_file(path: str) -> str:
    from .chat.templates import read_template

    try:
        return read_template(path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('must be a JSON object, such as \'{"enable_thinking": false}\'')
    return value


def _slots(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= 256:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of slots, 1 to 256")
    return n


def _slot_ctx(args) -> int:
    """Each slot's context: -c split across serve's slots, as llama-server splits it (0 stays the model's trained
    context, per slot); without -c, 4096 tokens each."""
    if args.ctx_size is None:
        return 4096
    return args.ctx_size // getattr(args, "slots", 1) if args.ctx_size > 0 else args.ctx_size


def _n_predict(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1 and n != -1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a token count (1 or more), or -1 for no limit")
    return n


def _seconds(text: str) -> float:
    try:
        t = float(text)
    except ValueError:
        t = 0.0
    if not 0 < t < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds above 0")
    return t


def _temperature(text: str) -> float:
    from .engine.sampling import check_temperature

    try:
        t = float(text)
        check_temperature(t)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return t


def _chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template-file", dest="chat_template", type=_template_file, metavar="FILE",
                   help="Jinja chat template to use instead of the GGUF's")
    p.add_argument("--chat-template-kwargs", type=_json_object, metavar="JSON",
                   help='extra chat template variables, e.g. \'{"enable_thinking": false}\'')


def _budget(text: str) -> int:
    from .chat.reasoning import budget_kwargs

    try:
        budget_kwargs(int(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return int(text)


def _reasoning_args(p: argparse.ArgumentParser, server: bool) -> None:
    p.add_argument("-rea", "--reasoning", choices=["on", "off", "auto"], default="auto",
                   help="thinking on or off for templates that read enable_thinking (default auto: the template's "
                        "own default)")
    if server:
        p.add_argument("--reasoning-format", choices=["auto", "deepseek", "deepseek-legacy", "none"], default="auto",
                       help="deepseek (and auto): reasoning apart in reasoning_content; none: left in the content; "
                            "deepseek-legacy: both")
        p.add_argument("--reasoning-budget", type=_budget, default=-1, metavar="N",
                       help="-1: unrestricted (default); 0: no thinking (enable_thinking=false)")


def _template_kwargs(args) -> dict:
    """The chat template variables for every prompt: -rea and --reasoning-budget, under --chat-template-kwargs."""
    from .chat.reasoning import budget_kwargs

    kwargs = budget_kwargs(getattr(args, "reasoning_budget", -1))
    if getattr(args, "reasoning", "auto") != "auto":
        kwargs["enable_thinking"] = args.reasoning == "on"
    return kwargs | (getattr(args, "chat_template_kwargs", None) or {})


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror}")


def _logit_bias(text: str) -> tuple[int, float]:
    """llama.cpp's -l TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-inf."""
    m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*([0-9.eE+-]+|inf)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID(+/-)BIAS such as 15043+1 or 15043-inf, got {text!r}")
    try:
        bias = float(m[3])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{m[3]!r} is not a number")
    return int(m[1]), -bias if m[2] == "-" else bias


def _chain_args(p: argparse.ArgumentParser, seed: int | None = None) -> None:
    """The sampler chain, with llama.cpp's spellings and defaults (they apply once --temp is above 0)."""
    p.add_argument("--temp", type=_temperature, default=0.0, help="temperature (0 = greedy, the default)")
    p.add_argument("--top-k", type=int, default=40, help="top-k sampling (default 40, as llama.cpp; 0 = off)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p sampling (default 0.95, as llama.cpp; 1.0 = off)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p sampling (default 0.05, as llama.cpp; 0.0 = off)")
    p.add_argument("--seed", type=int, default=seed, help="RNG seed" + (f" (default {seed})" if seed is not None
                                                                         else " (default: random)"))


def _sampling_args(p: argparse.ArgumentParser) -> None:
    """llama.cpp's sampling controls, with its spellings."""
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="penalize repeated tokens (1.0 = off)")
    p.add_argument("--repeat-last-n", type=int, default=64,
                   help="last n tokens (prompt included) to penalize (default 64, 0 = off, -1 = context size)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="presence penalty (0.0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="frequency penalty (0.0 = off)")
    p.add_argument("-l", "--logit-bias", type=_logit_bias, action="append", metavar="TOKEN_ID(+/-)BIAS",
                   help="add BIAS to the token's logit, e.g. 15043+1; 15043-inf bans it (repeatable)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--grammar", help="GBNF grammar the output must follow")
    g.add_argument("--grammar-file", dest="grammar", type=_read_text, metavar="FILE", help="GBNF grammar from a file")
    g.add_argument("-j", "--json-schema", help="JSON schema the output must follow (e.g. {} for any JSON object)")
    g.add_argument("-jf", "--json-schema-file", dest="json_schema", type=_read_text, metavar="FILE",
                   help="JSON schema from a file")


def _sampling_kwargs(args) -> dict:
    bias = {}
    for tok, b in args.logit_bias or ():
        bias[tok] = bias.get(tok, 0.0) + b
    return dict(repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                logit_bias=bias or None, grammar=args.grammar, json_schema=args.json_schema)


def _pair(args):
    """The target and drafter to load: a built-in pair's (the default without -m) or the files given."""
    from . import models

    no_drafter = args.no_draft or "dflash" not in args.spec_type
    if args.draft and no_drafter:
        raise ValueError(f"-d {args.draft} with " + ("--no-draft" if args.no_draft else "--spec-type "
                         + ",".join(args.spec_type)) + ": the drafter would not be used")
    model, draft = models.pair(args.model, args.draft)
    return model, None if no_drafter else draft


def _load_engine(args, drafter: bool = True):
    """The engine the flags ask for; drafter=False: the same without the DFlash drafter (the n-gram lookup stays)."""
    from .engine.engine import Engine

    if args.rpc:
        from .rpc import add_servers

        add_servers(args.rpc)
    model, draft = _pair(args)
    draft = draft if drafter else None
    print(f"dflash-local: loading {Path(model).name}" + (f" and {Path(draft).name}" if draft else ""),
          file=sys.stderr)
    return Engine(
        model,
        draft,
        n_ctx=_slot_ctx(args),
        n_slots=getattr(args, "slots", 1),  # serve's -np
        placement=from_args(args),
        block_size=args.block_size,
        capture=args.capture,
        draft_backend=args.draft_backend,
        draft_device=args.draft_device,
        draft_policy=args.draft_policy,
        spec_sampling=args.spec_sampling,
        ngram=None if args.no_draft or "ngram-simple" not in args.spec_type else
        NgramSpec(args.spec_ngram_simple_size_n, args.spec_ngram_simple_size_m),
        verbose=args.verbose,
        chat_template=getattr(args, "chat_template", None),  # bench has no chat options
        chat_template_kwargs=_template_kwargs(args),
    )


def stats_line(s) -> str:
    line = (
        f"{s.n_generated} tokens, {s.tokens_per_second:.1f} tok/s, prompt {s.n_prompt} tokens "
        f"({s.prompt_tokens_per_second:.0f} tok/s), finish: {s.finish_reason}"
    )
    if s.steps:
        line += (
            f"\nsteps {s.steps}, mean acceptance length {s.mean_acceptance_length:.2f}; per step: "
            f"draft {s.draft_ms / s.steps:.1f} ms, verify {s.verify_ms / s.steps:.1f} ms, "
            f"rollback {s.rollback_ms / s.steps:.2f} ms, other {s.other_ms / s.steps:.2f} ms ({100 * s.other_fraction:.1f}%)"
        )
    if s.drafting and s.acceptance_rate:
        line += "\nacceptance by block position: " + " ".join(f"{r:.2f}" for r in s.acceptance_rate)
    if s.ngram_steps:
        line += f"\nn-gram drafts: {s.ngram_steps} of {s.steps} steps, {s.ngram_accepted} tokens accepted"
    return line


def cmd_generate(args) -> int:
    from .engine.engine import Finished, TextDelta

    if (args.chat_template or args.chat_template_kwargs) and not args.chat:
        raise ValueError("--chat-template-file and --chat-template-kwargs apply to chat messages: add --chat")
    engine = _load_engine(args)
    if args.prompt is None:
        args.prompt = sys.stdin.read()
    kwargs = dict(
        max_tokens=None if args.max_tokens == -1 else args.max_tokens,
        stop=args.stop or (),
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        **_sampling_kwargs(args),
    )
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        events = engine.generate(messages=messages, **kwargs)
    else:
        events = engine.generate(args.prompt, **kwargs)
    for ev in events:
        if isinstance(ev, TextDelta) and not args.json:
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        elif isinstance(ev, Finished):
            s = ev.summary
            if args.json:
                print(
                    json.dumps(
                        {
                            "token_ids": ev.token_ids,
                            "text": ev.text,
                            "finish_reason": s.finish_reason,
                            "tokens_per_second": s.tokens_per_second,
                            "mean_acceptance_length": s.mean_acceptance_length,
                            "draft_ms": s.draft_ms,
                            "verify_ms": s.verify_ms,
                            "rollback_ms": s.rollback_ms,
                            "n_rollbacks": s.n_rollbacks,
                            "n_checkpoint_rollbacks": s.n_checkpoint_rollbacks,
                            "other_ms": s.other_ms,
                            "steps": s.steps,
                            "n_prompt": s.n_prompt,
                            "prompt_ms": s.prompt_ms,
                            "acceptance_rate": s.acceptance_rate,
                            "accepted_at": s.accepted_at,
                            "drafted_at": s.drafted_at,
                            "drafting": s.drafting,
                        }
                    )
                )
            else:
                print()
                print(stats_line(s), file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from .server.app import serve

    alias = args.alias or Path(_pair(args)[0]).stem
    return serve(args, lambda: _load_engine(args), alias, lambda: _load_engine(args, drafter=False))


def cmd_tui(args) -> int:
    from dflash_local.tui.app import run

    return run(_load_engine(args), args.n_gpu_layers)


def cmd_bench(args) -> int:
    from .bench import cmd_bench as run

    if _pair(args)[1] is None:
        raise ValueError("bench compares DFlash with plain decoding: give a drafter with -d"
                         + ("" if "dflash" in args.spec_type else ", and keep dflash in --spec-type"))
    return run(args, lambda: _load_engine(args))


def cmd_init_drafter(args) -> int:
    from dflash_local.convert.init_drafter import init_drafter

    from .models import pair

    out = init_drafter(
        args.output,
        pair(args.target)[0],
        n_layer=args.layers,
        n_target_layers=args.target_layers,
        block_size=args.block_size,
        seed=args.seed,
    )
    print(out)
    return 0


def _layer_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give layer numbers separated by commas, e.g. 2,9,16") from None


def _train_args(p: argparse.ArgumentParser) -> None:
    # here rather than in train.py, which needs torch: `train --help` works without it
    p.add_argument("-m", "--target", help="target GGUF, or a built-in: smollm2 (the default) or gemma")
    p.add_argument("-o", "--out", required=True, help="folder for data, checkpoints and the exported drafter")
    p.add_argument("--variant", choices=["dflash", "dflash2"], default="dflash", help="dflash2 adds DFlash2's "
                   "convolutions and candidate selector (default dflash)")
    p.add_argument("--init", metavar="DRAFTER.gguf", help="train on from this drafter for the target (ours or a "
                   "converted z-lab one): its layers, feature layers, block size and draft vocabulary are kept")
    p.add_argument("--layers", type=int, default=1, help="drafter layers (default 1)")
    p.add_argument("--ffn-size", type=int, help="drafter feed-forward size (default: the target's); its hidden "
                   "size is the target's, since it reads the target's embeddings")
    p.add_argument("--target-layers", type=_layer_list, help="comma-separated target layer-input indices to read features from "
                   "(default: z-lab's spread for --layers)")
    p.add_argument("--block-size", type=int, default=8, help="anchor + drafted tokens per block (default 8)")
    p.add_argument("--draft-vocab", type=int, help="reduced draft vocabulary: the N most frequent target tokens "
                   "(default 16384 for targets with more than 65536 tokens, else the full vocabulary)")
    p.add_argument("--corpus", help="prompts: a text file (blank-line separated) or JSONL with 'prompt'/'text' "
                   "(default: code and prose from what is installed, see `dflash-local corpus`)")
    p.add_argument("--chat", action="store_true", help="for an instruct model: each prompt is a user message and the "
                   "data is the target's answers through its chat template (default corpus: `corpus --chat`'s)")
    p.add_argument("--data-temp", type=float, default=0.0, metavar="T", help="sample every other answer in the data "
                   "at temperature T from the target's top 8 tokens (default 0: all greedy)")
    p.add_argument("--samples", type=int, default=800, help="training continuations to generate (default 800)")
    p.add_argument("-np", "--parallel", type=int, default=16, help="continuations decoded side by side in one target "
                   "batch while making data (default 16)")
    p.add_argument("--max-new", type=int, default=192, help="tokens per continuation (default 192)")
    p.add_argument("--text-samples", type=int, default=0, help="corpus passages (up to 512 tokens) the target reads "
                   "rather than continues, for more data per hour: labelled where the text agrees with the target "
                   "(default 0)")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--train-seconds", type=float, default=0.0, metavar="S", help="train for about S seconds: the "
                   "steps are set from the first 20 steps' rate, at most --steps (default 0: --steps)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--anchors", type=int, default=16, help="blocks per sequence (default 16)")
    p.add_argument("--window", type=int, default=512, help="the drafter attends to the context's last N positions, "
                   "in training and in its GGUF (a sliding window: at long context a drafter trained on short "
                   "sequences drafts better so; default 512, 0: the whole context)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--soft-labels", type=float, default=0.0, metavar="W", help="share of the loss taken against the "
                   "target's distribution (its top 8 tokens) instead of its greedy token (default 0)")
    p.add_argument("--device", choices=["cpu", "cuda", "mps"], default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=500, help="steps between held-out validations (0: none)")
    p.add_argument("--eval-prompts", type=int, default=4)
    p.add_argument("--eval-tokens", type=int, default=96)
    p.add_argument("--outtype", default="q8_0", help="type of the exported GGUF (default q8_0)")
    add_placement_args(p)  # for data generation and validation


def cmd_rpc_server(args) -> int:
    from .rpc import serve

    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print("dflash-local: warning: the RPC server has no authentication; listen on a trusted network only",
              file=sys.stderr)
    print(f"dflash-local: rpc-server listening on {args.host}:{args.port} (Ctrl-C stops it)", file=sys.stderr)
    serve(args.host, args.port, args.threads or os.cpu_count() or 1, args.cache)
    return 1


def cmd_corpus(args) -> int:
    from collections import Counter

    from .train.corpus import write_corpus

    rows = write_corpus(args.out, args.seed, args.chat, args.n)
    kinds = Counter(r.kind for r in rows)
    print(f"dflash-local: wrote {len(rows)} prompts ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}) with "
          f"their source and licence to {args.out}", file=sys.stderr)
    return 0


def cmd_train(args) -> int:
    from .train.run import run_train

    return run_train(args)


def build_parser() -> argparse.ArgumentParser:
    """Every command and its flags."""
    parser = argparse.ArgumentParser(prog="dflash-local", description="DFlash speculative decoding for GGUF models")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    _engine_args(g)
    g.add_argument("-p", "--prompt", help="prompt text (default: read standard input)")
    g.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    g.add_argument("--system", help="system message (with --chat)")
    _chat_args(g)
    g.add_argument("-n", "--max-tokens", type=_n_predict, default=256, help="tokens to generate (default 256; -1: "
                   "until the context is full)")
    _chain_args(g)
    _sampling_args(g)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streamed text")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--api-key", default=os.environ.get("DFLASH_API_KEY"), help="require this key (Bearer or x-api-key)")
    s.add_argument("--alias", help="model name clients use (default: the target file's name)")
    s.add_argument("--max-queue", type=int, default=32, help="requests allowed to wait; more get 429")
    s.add_argument("-np", "--parallel", dest="slots", type=_slots, default=4, metavar="N",
                   help="generation slots: requests served side by side, each in a cache of its own (default 4, as "
                   "llama-server); -c is split across them; more requests queue")
    s.add_argument("-n", "--n-predict", "--predict", type=_n_predict, metavar="N",
                   help="tokens to generate for a request that sets no max_tokens (default 2048; -1: until the "
                   "context is full)")
    s.add_argument("-to", "--timeout", type=_seconds, default=600, metavar="N",
                   help="seconds a client may leave its stream unread before its generation is cancelled and its "
                   "slot freed (default 600, as llama-server's)")
    s.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web page allowed to call the server from a browser, such as http://localhost:3000 "
                   "(repeatable; '*' for any); by default only the server's own page")
    _chat_args(s)
    _reasoning_args(s, server=True)
    s.set_defaults(func=cmd_serve)

    t = sub.add_parser("tui", help="chat in the terminal with live tokens/s and acceptance")
    _engine_args(t)
    _chat_args(t)
    _reasoning_args(t, server=False)
    t.set_defaults(func=cmd_tui)

    b = sub.add_parser("bench", help="baseline vs DFlash on a prompt set: speed, acceptance, costs")
    _engine_args(b)
    b.add_argument("--prompts", help="JSONL file, one object per line with 'prompt' or 'messages'")
    b.add_argument("-n", "--max-tokens", type=int, default=256)
    b.add_argument("--out", default="bench-out", help="folder for bench.json, bench.md and bench.png")
    b.add_argument("--no-peer", action="store_true", help="skip the llama-cpp-python prompt-lookup row")
    _chain_args(b, seed=1)  # sampled rows: prompt i draws with seed + i, ours and llama-server's alike
    b.add_argument("--llama-server", metavar="PATH", help="also run every prompt through this upstream llama-server, "
                   "plain and with its speculative types (ngram-simple, ngram-mod, draft-dflash with our drafter)")
    b.add_argument("--llama-server-args", metavar="ARGS", help="more flags for every llama-server run, one string "
                   "(e.g. \"--no-repack\")")
    _reasoning_args(b, server=False)
    b.set_defaults(func=cmd_bench)

    r = sub.add_parser("rpc-server", help="offer this machine's CPU or GPUs to another machine's --rpc (llama.cpp's "
                       "rpc-server)")
    r.add_argument("-H", "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    r.add_argument("-p", "--port", type=int, default=50052)
    r.add_argument("-t", "--threads", type=int, help="CPU threads (default: all cores)")
    r.add_argument("-c", "--cache", metavar="DIR", help="keep received tensors in DIR, for faster reloads")
    r.set_defaults(func=cmd_rpc_server)

    # convert, inspect and pull keep their options beside their code; those modules need only the core dependencies
    from dflash_local.convert.hf_to_gguf import add_convert_args, run_convert
    from dflash_local.convert.inspect_gguf import add_inspect_args, run_inspect

    from .pull import add_pull_args, run_pull

    c = sub.add_parser("convert", help="convert a DFlash, DFlash2 or DSpark drafter (folder or Hub id) to GGUF for a "
                                       "target GGUF")
    add_convert_args(c)
    c.set_defaults(func=run_convert)
    i = sub.add_parser("inspect", help="print a GGUF file's metadata, tensors and types")
    add_inspect_args(i)
    i.set_defaults(func=run_inspect)

    pl = sub.add_parser("pull", help="download a known target GGUF and its DFlash drafter, convert the drafter")
    add_pull_args(pl)
    pl.set_defaults(func=run_pull)

    d = sub.add_parser("init-drafter", help="write an untrained DFlash drafter GGUF for a target (for training)")
    d.add_argument("-m", "--target", help="target GGUF, or a built-in: smollm2 (the default) or gemma")
    d.add_argument("-o", "--output", required=True, help="drafter GGUF to write")
    d.add_argument("--layers", type=int, default=1, help="drafter layers (default 1)")
    d.add_argument("--target-layers", type=int, help="how many target layers feed it (default: --layers)")
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_init_drafter)

    co = sub.add_parser("corpus", help="write the default training prompts with their source and licence (JSONL)")
    co.add_argument("-o", "--out", required=True, help="the JSONL file to write")
    co.add_argument("--seed", type=int, default=0, help="the order's seed, as train's --seed (default 0)")
    co.add_argument("--chat", action="store_true", help="user messages for an instruct model's drafter (code, chat "
                    "and reasoning requests), as train --chat uses")
    co.add_argument("-n", type=int, help="the first N prompts only")
    co.set_defaults(func=cmd_corpus)

    tr = sub.add_parser("train", help="train a DFlash drafter for a target GGUF on its own greedy continuations")
    _train_args(tr)
    tr.set_defaults(func=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--llama-server-args" in argv[:-1]:
        # its value starts with "-" (--no-repack), which argparse would take for a flag of ours
        i = argv.index("--llama-server-args")
        argv[i:i + 2] = [f"--llama-server-args={argv[i + 1]}"]
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "draft_backend", None) == "torch" and not args.no_draft:
            from .engine import torch_drafter  # noqa: F401  (without torch: the error, before any model loads)
        return args.func(args)
    except (GGUFError, MissingExtraError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"dflash-local: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
