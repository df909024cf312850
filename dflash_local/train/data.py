"""Training data for a drafter, made by the target itself: its greedy continuations of prompts and the hidden states
of the selected layers at every position (the native feature export, as the engine uses it while drafting).

Several prompts are decoded side by side, one sequence each in a shared cache, and every target batch holds one row
per running sequence (plus the prompts of those just started): a batch of 16 rows costs a few single decodes, so the
data stage makes several times more tokens per hour than decoding one prompt at a time (docs/training.md).
A finished sequence's slot takes the next prompt at once (continuous batching). With max_new = 0 the target only
reads the texts (passages), teacher-forced, a few per batch: longer contexts of real code and prose, and the
target's own next token after each position still gives exact labels wherever the text so far agrees with it
(train.py). On this CPU that is only 1.4x the tokens per CPU-second of continuations (docs/measurements.md).

One sample per file, `DIR/sample-NNNNNN.npz`: `prompt` (its text), `tokens` (prompt + continuation, int32),
`n_prompt`, `features` [len(tokens) - 1, n_layers * n_embd] as bfloat16 bits (uint16: gemma's hidden states exceed
float16's range, bfloat16's 8 exponent bits hold them; the last token was never decoded), and the target's own
distribution after each decoded position: `top_ids` / `top_logprobs` [len(tokens) - 1, TOP_K] (its TOP_K most likely
next tokens, best first, and their log-probabilities), for soft labels. `DIR/meta.json` records what made them.
Sample i always comes from prompt i and files are written atomically, so an interrupted run resumes at the first
missing files; a file made from another prompt is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..atomic import atomic_output
from ..chat.templates import render
from ..gguf_file import read_gguf
from ..engine.placement import FLASH_ATTN, Placement

FORMAT = 2  # bfloat16 features and top-k distributions
TOP_K = 8
PASSAGE_TOKENS = 512  # a passage's tokens at most: one target batch


@dataclass
class Sample:
    tokens: np.ndarray  # int32 [n]
    n_prompt: int
    features: np.ndarray  # bfloat16 bits, uint16 [n - 1, width]
    prompt: str = ""
    top_ids: np.ndarray | None = None  # int32 [n - 1, TOP_K]
    top_logprobs: np.ndarray | None = None  # float16 [n - 1, TOP_K]

    def features_f32(self, end: int | None = None) -> np.ndarray:
        return from_bf16(self.features[:end])


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(u: np.ndarray) -> np.ndarray:
    return (u.astype(np.uint32) << 16).view(np.float32)


def sample_path(folder: Path, i: int) -> Path:
    return folder / f"sample-{i:06d}.npz"


def save_sample(path: Path, s: Sample) -> None:
    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, prompt=np.array(s.prompt), tokens=s.tokens, n_prompt=np.int32(s.n_prompt), features=s.features,
                 top_ids=s.top_ids, top_logprobs=s.top_logprobs)


def load_sample(path: Path) -> Sample:
    with np.load(path) as z:
        return Sample(z["tokens"], int(z["n_prompt"]), z["features"], str(z["prompt"]), z["top_ids"],
                      z["top_logprobs"])


@dataclass
class Running:
    """One prompt being continued in sequence `seq` of the shared cache."""
    index: int  # its prompt's (and sample's) number
    seq: int
    tokens: list[int]
    n_prompt: int
    fresh: bool = True  # its prompt is not decoded yet
    features: list[np.ndarray] = field(default_factory=list)
    top_ids: list[np.ndarray] = field(default_factory=list)
    top_logprobs: list[np.ndarray] = field(default_factory=list)

    def rows(self) -> list[int]:
        """The tokens this sequence adds to the next batch: its whole prompt, then its last token."""
        return self.tokens[: self.n_prompt] if self.fresh else self.tokens[-1:]

    def sample(self, prompt: str) -> Sample:
        n = len(self.tokens) - 1  # the last token was never decoded
        return Sample(np.asarray(self.tokens, dtype=np.int32), self.n_prompt,
                      to_bf16(np.concatenate(self.features)[:n]), prompt,
                      np.concatenate(self.top_ids)[:n].astype(np.int32),
                      np.concatenate(self.top_logprobs)[:n].astype(np.float16))


def chat_texts(target_path, model, messages: dict[int, str]) -> dict[int, str]:
    """Each user message as the target's chat template renders it, ready for the answer."""
    info = read_gguf(target_path)
    bos, eos = (model.piece(t, True).decode(errors="replace") if t >= 0 else "" for t in (model.bos, model.eos))
    template = info.kv.get("tokenizer.chat_template")
    return {i: render([{"role": "user", "content": m}], template, info.arch, bos, eos) for i, m in messages.items()}


def generate(session, model, prompts: dict[int, str], n_parallel: int, max_new: int, n_prompt_max: int,
             chat: bool = False, temperature: float = 0.0):
    """Continuations of the given prompts, decoded side by side; yields (index, Sample) as each finishes. Greedy, or
    with temperature > 0 the odd-numbered ones sampled from the target's top TOP_K (seeded by the index). chat: the
    prompts are chat-template output, their control tokens parsed."""
    queue = sorted(prompts)
    rngs = {i: np.random.default_rng(i) for i in prompts if temperature > 0 and i % 2}
    running: list[Running] = []
    free = list(range(n_parallel))
    per_seq = session.n_ctx // n_parallel  # the room each sequence is allowed in the shared cache
    while queue or running:
        # start prompts while their rows fit in one batch
        n_rows = sum(len(r.rows()) for r in running)
        while queue and free:
            ids = model.tokenize(prompts[queue[0]], True, chat)[:n_prompt_max]
            if n_rows + len(ids) > session.n_batch:
                break
            running.append(Running(queue.pop(0), free.pop(), ids, len(ids)))
            n_rows += len(ids)
        tokens, pos, seq = [], [], []
        for r in running:
            rows = r.rows()
            p0 = 0 if r.fresh else len(r.tokens) - 1
            tokens += rows
            pos += range(p0, p0 + len(rows))
            seq += [r.seq] * len(rows)
        top_ids, top_logprobs = session.decode_rows(tokens, pos, seq, TOP_K)
        feats = session.features()
        off, still = 0, []
        for r in running:
            n = len(r.rows())
            r.features.append(feats[off : off + n])
            r.top_ids.append(top_ids[off : off + n])
            r.top_logprobs.append(top_logprobs[off : off + n])
            off += n
            r.fresh = False
            nxt = int(top_ids[off - 1, 0])
            if r.index in rngs:
                p = np.exp((top_logprobs[off - 1] - top_logprobs[off - 1].max()) / temperature)
                nxt = int(top_ids[off - 1, rngs[r.index].choice(TOP_K, p=p / p.sum())])
            if model.is_eog(nxt) or max_new == 0:  # the end-of-generation token is never drafted: it is not kept
                done = True
            else:
                r.tokens.append(nxt)
                done = len(r.tokens) - r.n_prompt == max_new or len(r.tokens) >= per_seq
            if done:
                session.drop_sequence(r.seq)
                free.append(r.seq)
                yield r.index, r.sample(prompts[r.index])
            else:
                still.append(r)
        running = still


def data_meta(target_path, layers: list[int], max_new: int, n_prompt_max: int, chat: bool = False,
              temperature: float = 0.0) -> dict:
    """What made a data folder (its meta.json): a run adds to or trains on data only where this matches."""
    meta = {"target": Path(target_path).name, "layers": list(layers), "max_new": max_new, "n_prompt_max": n_prompt_max,
            "format": FORMAT}
    if chat or temperature:  # recorded only when set, so data made before these existed still matches
        meta |= {"chat": chat, "temperature": temperature}
    return meta


def make_data(target_path, folder, layers: list[int], prompts: list[str], n_samples: int, max_new: int,
              n_prompt_max: int = 256, n_parallel: int = 16, progress=None,
              placement: Placement | None = None, chat: bool = False, temperature: float = 0.0) -> list[Path]:
    """Make samples 0..n_samples-1 in `folder`, skipping those already there. Returns their paths. chat: each prompt
    is a user message, rendered by the target's chat template; temperature > 0: every other answer sampled."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta = data_meta(target_path, layers, max_new, n_prompt_max, chat, temperature)
    meta_path = folder / "meta.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old != meta:
            diff = ", ".join(k for k in {**old, **meta} if old.get(k) != meta.get(k))
            raise ValueError(f"{folder} holds data made differently ({diff}); use another --out or delete it")
    else:
        with atomic_output(meta_path) as tmp:
            tmp.write_text(json.dumps(meta, indent=1))
    if n_samples > len(prompts):
        raise ValueError(f"{n_samples} samples asked for, but the corpus has {len(prompts)} prompts")
    todo = {}
    for i in range(n_samples):
        path = sample_path(folder, i)
        if not path.exists():
            todo[i] = prompts[i]
            continue
        with np.load(path) as z:
            if "prompt" not in z or str(z["prompt"]) != prompts[i]:
                raise ValueError(f"{path} was made from another prompt than the corpus's prompt {i} (another corpus, "
                                 f"seed or set of installed packages); use another --out or delete it")
    if todo:
        from .. import _native  # here: a run whose data is all made (elsewhere, say) needs no llama.cpp

        pl = placement or Placement()
        model = _native.Model(str(target_path), **pl.model_kwargs())
        n_parallel = max(1, min(n_parallel, len(todo)))
        per_seq = n_prompt_max + max_new + 1
        kw = pl.session_kwargs() | {"n_batch": max(pl.n_batch, n_prompt_max + n_parallel), "n_seq": n_parallel,
                                    "kv_unified": True}
        kw["n_ubatch"] = kw["n_batch"]
        session = _native.Session(model, None, layers, n_parallel * per_seq, pl.threads,
                                  _native.arch_records_layer_inputs(model.arch), FLASH_ATTN[pl.fa], **kw)
        texts = chat_texts(target_path, model, todo) if chat else todo
        for i, s in generate(session, model, texts, n_parallel, max_new, n_prompt_max, chat, temperature):
            s.prompt = todo[i]
            save_sample(sample_path(folder, i), s)
            if progress:
                progress(i, len(s.tokens) - s.n_prompt if max_new else len(s.tokens))  # passages: tokens read
    return [sample_path(folder, i) for i in range(n_samples)]
