"""Training data for a drafter, made by the target itself: its greedy continuations of prompts and the hidden states
of the selected layers at every position (the native feature export, as the engine uses it while drafting).

One sample per file, `DIR/sample-NNNNNN.npz`: `prompt` (its text), `tokens` (prompt + continuation, int32),
`n_prompt`, and `features` [len(tokens) - 1, n_layers * n_embd] (float32: the last token was never decoded; gemma's hidden states exceed
float16's range). `DIR/meta.json` records what made them. Sample i always comes from prompt i and files are written
atomically, so an interrupted run resumes at the first missing file; a file made from another prompt is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _native
from .atomic import atomic_output
from .placement import FLASH_ATTN, Placement
from .sampling import SamplingParams

@dataclass
class Sample:
    tokens: np.ndarray  # int32 [n]
    n_prompt: int
    features: np.ndarray  # [n - 1, width]
    prompt: str = ""


def sample_path(folder: Path, i: int) -> Path:
    return folder / f"sample-{i:06d}.npz"


def generate_sample(session, model, prompt: str, max_new: int, n_prompt_max: int) -> Sample:
    """Greedy continuation of one prompt, with the target features of every decoded position."""
    ids = model.tokenize(prompt, True, False)[:n_prompt_max]
    greedy = SamplingParams(temperature=0.0).native()
    session.truncate(0)
    feats = []
    last = None
    for off in range(0, len(ids), session.n_batch):  # features() holds the last decode's rows only
        last = session.prefill(ids[off : off + session.n_batch], greedy, 0)
        feats.append(session.features())
    tokens = list(ids)
    while not model.is_eog(last):  # the end-of-generation token is never drafted: it is not kept
        tokens.append(last)
        if len(tokens) - len(ids) == max_new or session.n_past + 1 >= session.n_ctx:
            break
        last = session.step(last, [], greedy, 0).tokens[0]
        feats.append(session.features())
    return Sample(np.asarray(tokens, dtype=np.int32), len(ids), np.concatenate(feats)[: len(tokens) - 1], prompt)


def save_sample(path: Path, s: Sample) -> None:
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, prompt=np.array(s.prompt), tokens=s.tokens, n_prompt=np.int32(s.n_prompt), features=s.features)


def load_sample(path: Path) -> Sample:
    with np.load(path) as z:
        return Sample(z["tokens"], int(z["n_prompt"]), z["features"], str(z["prompt"]))


def make_data(target_path, folder, layers: list[int], prompts: list[str], n_samples: int, max_new: int,
              n_ctx: int = 1024, n_prompt_max: int = 256, progress=None,
              placement: Placement | None = None) -> list[Path]:
    """Make samples 0..n_samples-1 in `folder`, skipping those already there. Returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"target": Path(target_path).name, "layers": list(layers), "max_new": max_new, "n_prompt_max": n_prompt_max}
    meta_path = folder / "meta.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old != meta:
            diff = ", ".join(k for k in meta if old.get(k) != meta[k])
            raise ValueError(f"{folder} holds data made differently ({diff}); use another --out or delete it")
    else:
        meta_path.write_text(json.dumps(meta, indent=1))
    if n_samples > len(prompts):
        raise ValueError(f"{n_samples} samples asked for, but the corpus has {len(prompts)} prompts")
    todo = []
    for i in range(n_samples):
        path = sample_path(folder, i)
        if not path.exists():
            todo.append(i)
            continue
        with np.load(path) as z:
            if "prompt" not in z or str(z["prompt"]) != prompts[i]:
                raise ValueError(f"{path} was made from another prompt than the corpus's prompt {i} (another corpus, "
                                 f"seed or set of installed packages); use another --out or delete it")
    if todo:
        pl = placement or Placement()
        model = _native.Model(str(target_path), **pl.model_kwargs())
        session = _native.Session(model, None, layers, n_ctx, pl.threads, _native.arch_records_layer_inputs(model.arch),
                                  FLASH_ATTN[pl.fa], **pl.session_kwargs())
        for i in todo:
            s = generate_sample(session, model, prompts[i], max_new, n_prompt_max)
            save_sample(sample_path(folder, i), s)
            if progress:
                progress(i, len(s.tokens) - s.n_prompt)
    return [sample_path(folder, i) for i in range(n_samples)]
