"""Training prompts for `dflash-local train`.

The default corpus needs no network and exists wherever Python does: code prompts are the openings of functions and
classes in the Python standard library's sources; prose prompts are the opening words of paragraphs from the
descriptions of the installed Python packages (their METADATA), so it varies with what is installed: each data
file records its prompt. A drafter learns the target's own continuations of
these prompts, so the prompts only need to be varied, not good. `--corpus FILE` replaces them: a text file (one
prompt per paragraph, paragraphs separated by a blank line) or JSONL (one object per line with "prompt" or "text").
"""

from __future__ import annotations

import json
import random
import re
import sysconfig
from importlib import metadata
from pathlib import Path

_DEF = re.compile(r"^\s*(def|class|async def) \w+")


def code_prompts() -> list[str]:
    """A def/class line of the standard library and the 0-3 lines after it."""
    rng = random.Random(0)
    out = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        for i, line in enumerate(lines):
            if _DEF.match(line) and len(line) < 120:
                out.append("\n".join(lines[i : i + 1 + rng.randint(0, 3)]) + "\n")
    return out


def prose_prompts() -> list[str]:
    """The first 6-40 words of the prose paragraphs in the installed packages' descriptions."""
    rng = random.Random(0)
    out, seen = [], set()
    for dist in sorted(metadata.distributions(), key=lambda d: d.metadata.get("Name") or ""):
        name = dist.metadata.get("Name")
        text = dist.metadata.get_payload() if hasattr(dist.metadata, "get_payload") else None
        text = text or dist.metadata.get("Description") or ""
        if not name or name.lower() in seen or name.lower() == "dflash-local":  # not our own, ever-changing README
            continue
        seen.add(name.lower())
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            words = para.split()
            wordy = sum(w.strip(".,;:!?'\"").isalpha() for w in words)
            if len(para) < 120 or wordy < 0.9 * len(words) or para.startswith(("#", "|", "..", ">>>", "*", "-", "@")):
                continue
            out.append(" ".join(words[: rng.randint(6, min(40, len(words)))]))
    return out


def read_corpus(path: str | Path) -> list[str]:
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        prompts = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("prompt", row.get("text")), str):
                    raise ValueError(f"{path}:{i}: each line needs a string 'prompt' or 'text'")
                prompts.append(row.get("prompt", row.get("text")))
    else:
        prompts = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def training_prompts(corpus: str | Path | None = None, seed: int = 0) -> list[str]:
    """The prompts in a fixed shuffled order (so that a resumed run continues where it stopped): code and prose
    alternate for the default corpus."""
    if corpus is not None:
        prompts = read_corpus(corpus)
        random.Random(seed).shuffle(prompts)
        return prompts
    code, prose = code_prompts(), prose_prompts()
    random.Random(seed).shuffle(code)
    random.Random(seed + 1).shuffle(prose)
    mixed = [p for pair in zip(code, prose) for p in pair]
    return mixed + code[len(prose) :] + prose[len(code) :]
