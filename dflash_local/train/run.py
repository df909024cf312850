"""`dflash-local train`: a DFlash drafter for any GGUF target, taught by the target itself.

1. Data (data.py): the target's greedy continuations of corpus prompts, and (--text-samples) longer corpus
   passages the target only reads, with its hidden states at the chosen layers through the same native feature
   export the engine drafts with, and its most likely next tokens after every position.
2. Training, the DFlash recipe: the drafter caches K/V of the fused target features of the context; blocks
   [anchor, mask x (B-1)] anchored at random positions attend to the context before their anchor and,
   bidirectionally, to their own block; cross-entropy against the target's own greedy tokens, weighted
   exp(-(k-1)/7) at block position k. The label at block position k is the target's next token after position
   anchor + k - 1, which is its greedy continuation of the anchor as long as the tokens between are its own: always
   in a continuation, where the text agrees with it in a prompt or passage (elsewhere the position is not trained).
   Target features are scaled to unit RMS per dimension (gemma's reach 1e5) and the scale is folded into fc at
   export, so the exported drafter reads raw features as llama.cpp's graph feeds them.
3. Validation every --eval-every steps: the real engine drafts with the exported GGUF on held-out prompts (the
   corpus's last ones, never trained on) and reports the mean acceptance length.
4. Export: a z-lab checkpoint folder (`zlab/`) and a GGUF through the converter (`drafter-<outtype>.gguf`), from the
   checkpoint with the best held-out acceptance (`best.pt`), or the last one where no validation ran.

Everything lives in --out; checkpoint.pt is saved every --save-every steps and on Ctrl-C, and running the same command
again resumes (data, then training) where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..extras import needs_extra

with needs_extra("torch", "train"):
    import torch
    import torch.nn.functional as F

from dflash_local.convert.draft_vocab import target_rows
from dflash_local.convert.init_drafter import default_target_layers, init_drafter

from ..atomic import atomic_output
from ..gguf_file import read_gguf
from ..engine.placement import Placement, from_args
from ..validate import check_pair
from ..engine.torch_drafter import DFlashDrafter, load_gguf_drafter, pick_device
from .data import PASSAGE_TOKENS, Sample, from_bf16, load_sample, make_data

# changing these makes a different drafter: a resumed run must keep them
# (--samples may grow: the draft vocabulary is kept in the checkpoint)
SHAPE_FIELDS = ("variant", "init", "n_layer", "n_ff", "target_layers", "block_size", "draft_vocab", "corpus",
                "max_new", "seed", "chat")
# a DFlash2 drafter's convolution and candidate selector (z-lab's names, in dflash_config)
DFLASH2 = {"conv_kernel_size": 4, "conv_group_size": 16, "selector_rank": 32, "selector_top_k": 4}


@dataclass
class TrainConfig:
    target: str
    out: str
    variant: str = "dflash"  # or "dflash2"
    init: str | None = None  # a drafter GGUF for this target to start from: its shape replaces the shape options
    n_layer: int = 1
    n_ff: int | None = None  # default: the target's
    target_layers: list[int] | None = None  # layer-input indices as in the GGUF (z-lab ids + 1)
    block_size: int = 8
    draft_vocab: int | None = None  # None: 16384 for targets with more than 65536 tokens, else the full vocabulary
    corpus: str | None = None
    chat: bool = False  # the prompts are user messages, rendered by the target's chat template
    temperature: float = 0.0  # > 0: every other answer in the data sampled at this temperature
    samples: int = 800
    max_new: int = 192
    text_samples: int = 0  # corpus passages read (teacher-forced) by the target, besides the continuations
    parallel: int = 16  # continuations decoded side by side while making data
    steps: int = 3000
    seconds: float = 0.0  # > 0: train about this long (the steps set from the first 20 steps' rate, within --steps)
    batch: int = 4  # sequences per step
    anchors: int = 16  # blocks per sequence
    window: int = 512  # the drafter sees the context's last `window` positions (0: all), trained so and in its GGUF
    lr: float = 1e-3
    soft: float = 0.0  # share of the loss taken against the target's distribution rather than its token
    warmup: int = 100
    device: str = "cpu"
    seed: int = 0
    placement: dict = field(default_factory=dict)  # placement.Placement's fields (threads, -ngl, ...): JSON-able
    save_every: int = 100
    eval_every: int = 500
    eval_prompts: int = 4
    eval_tokens: int = 96
    outtype: str = "q8_0"


@dataclass
class Batch:
    loss: torch.Tensor
    weight: float
    accepted: list[int]  # per block: leading draft positions that match the target (the acceptance it implies)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to cfg.lr, then a cosine down to a tenth of it at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))


def position_weights(block_size: int) -> torch.Tensor:
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / 7.0)


def draft_vocabulary(samples: list[Sample], n_vocab: int, n: int, prior: np.ndarray | None = None) -> np.ndarray:
    """The n target tokens the target predicts most often in the data (its greedy next tokens, the labels), sorted
    by id. Tokens the data never shows are ranked by `prior` (the tokenizer's scores, which rank tokens by frequency
    in its own corpus), else lower ids first."""
    counts = np.zeros(n_vocab, dtype=np.int64)
    for s in samples:
        np.add.at(counts, s.top_ids[:, 0], 1)
    prior = -np.arange(n_vocab, dtype=np.float64) if prior is None else prior
    return np.sort(np.lexsort((-prior, -counts))[:n])


def label_index(model: DFlashDrafter, n_vocab: int) -> torch.Tensor:
    """Target token -> row of the drafter's LM head (-1 for tokens outside a reduced draft vocabulary)."""
    ids = model.d2t.cpu() if model.d2t is not None else torch.arange(n_vocab)
    out = torch.full((n_vocab,), -1, dtype=torch.long)
    out[ids] = torch.arange(len(ids))
    return out


def feature_scale(samples: list[Sample], rng: np.random.Generator, rows: int = 50000) -> np.ndarray:
    per = rows // len(samples) + 1
    f = np.concatenate([from_bf16(s.features[rng.choice(len(s.features), size=min(per, len(s.features)),
                                                        replace=False)])
                        for s in samples if len(s.features)])
    return np.sqrt((f.astype(np.float64) ** 2).mean(0)).astype(np.float32) + 1e-6


def sequence_loss(model: DFlashDrafter, head: torch.Tensor, emb: torch.Tensor, row_of: torch.Tensor,
                  label_of: torch.Tensor, s: Sample, scale: torch.Tensor, n_anchors: int, rng: np.random.Generator,
                  weights: torch.Tensor, soft: float = 0.0) -> Batch | None:
    """Weighted cross-entropy of up to n_anchors blocks anchored at random positions of one sample; with soft > 0,
    that share of it against the target's own distribution (its top 8, as the data stores it)."""
    B = model.shape.block_size
    n = len(s.tokens)
    candidates = np.arange(1, n - 1)  # an anchor has context before it and a label after it
    if len(candidates) == 0:
        return None
    anchors = np.sort(rng.choice(candidates, size=min(n_anchors, len(candidates)), replace=False))
    nb, T = len(anchors), int(anchors[-1])
    dev = emb.device
    ctx = model.context_kv(torch.from_numpy(s.features_f32(T)).to(dev) / scale, torch.arange(T, device=dev))

    a = torch.from_numpy(anchors).to(dev)
    pos = a[:, None] + torch.arange(B, device=dev)  # [nb, B]
    tokens = torch.from_numpy(s.tokens.astype(np.int64)).to(dev)
    noise = torch.full((nb, B), model.shape.mask_token, device=dev)
    noise[:, 0] = tokens[a]
    block = torch.arange(nb, device=dev).repeat_interleave(B)
    key_pos = torch.arange(T, device=dev)
    see_ctx = (key_pos[None, :] < a[:, None]).repeat_interleave(B, 0)  # context before the anchor
    see_block = block[:, None] == block[None, :]
    if model.shape.sliding_window:  # keys within the window, as drafting sees them (torch_drafter, llama.cpp's graph)
        q = pos.flatten()[:, None]
        see_ctx &= (q - key_pos[None, :]) < model.shape.sliding_window
        see_block &= (q - pos.flatten()[None, :]) < model.shape.sliding_window
    h = model(emb[row_of[noise.flatten()]], pos.flatten(), ctx, torch.cat([see_ctx, see_block], 1), block=B)
    h = h.view(nb, B, -1)[:, 1:]

    target_pos = pos[:, 1:]
    rows = target_pos.clamp(max=n - 1) - 1  # the label of position p is the target's next token after p - 1
    greedy = torch.from_numpy(s.top_ids[:, 0].astype(np.int64)).to(dev)
    own = tokens[1:] == greedy  # [n - 1]: the token after each position is the target's own
    # the target's greedy continuation of the anchor while the tokens between the anchor and the label are its own
    on_path = torch.cumprod(torch.cat([torch.ones_like(own[rows[:, :1]]), own[rows[:, :-1]]], 1).int(), 1).bool()
    labels = label_of[greedy[rows]]  # draft-vocabulary index, -1 outside it
    labels = torch.where((target_pos < n) & on_path, labels, -1)
    logits = h @ head.T
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-1, reduction="none").view(nb, B - 1)
    if soft > 0:
        ce = (1 - soft) * ce + soft * soft_cross_entropy(logits, s, rows, label_of)
    w = weights[None, :].to(dev) * (labels >= 0)
    right = (logits.argmax(-1) == labels) & (labels >= 0)
    if model.selector is not None:
        ce_sel, right = selector_loss(model, h, logits, tokens[rows], labels)
        ce = ce + ce_sel
    accepted = torch.cumprod(right.int(), 1).sum(1)
    return Batch((ce * w).sum(), float(w.sum()), accepted.tolist())


def soft_cross_entropy(logits: torch.Tensor, s: Sample, rows: torch.Tensor, label_of: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the target's distribution after each of `rows` (the position before the label): its
    top tokens' probabilities, renormalised over those in the draft vocabulary."""
    ids = torch.from_numpy(s.top_ids).to(logits.device)[rows]  # [nb, B-1, TOP_K] target ids
    lp = torch.from_numpy(s.top_logprobs.astype(np.float32)).to(logits.device)[rows]
    d = label_of[ids.long()]
    p = torch.softmax(lp.masked_fill(d < 0, -torch.inf), -1).nan_to_num(0.0)  # none in the vocabulary: no loss
    return -(p * torch.log_softmax(logits, -1).gather(-1, d.clamp(min=0))).sum(-1)


def selector_loss(model: DFlashDrafter, h: torch.Tensor, logits: torch.Tensor, prev: torch.Tensor,
                  labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DFlash2's candidate selector, taught along the target's own path: at each block position the top_k draft
    candidates are scored after the TRUE previous token (the anchor at the first), as the lattice walk scores them
    whenever its previous pick was right, which is the only case acceptance needs; cross-entropy towards the
    target's token where it is among them (else 0). Returns the loss [nb, B-1] and where the walk would be right."""
    k, sel = model.shape.selector_top_k, model.selector
    unary, cand = torch.topk(logits * model.shape.logit_scale, k, dim=-1)  # [nb, B-1, k] draft-vocabulary rows
    cand_ids = model.d2t[cand] if model.d2t is not None else cand
    gate = h @ sel["hidden"].T  # [nb, B-1, R]
    pair = ((sel["predecessor"][prev] * gate)[..., None, :] * sel["successor"][cand_ids]).sum(-1)
    scores = unary + pair
    hit = cand == labels[..., None]
    found = hit.any(-1)
    ce = F.cross_entropy(scores.flatten(0, 1), hit.float().argmax(-1).flatten(), reduction="none").view(found.shape)
    right = found & (scores.argmax(-1) == hit.float().argmax(-1))
    return ce * found, right


def add_dflash2(model: DFlashDrafter, n_vocab: int, rng: np.random.Generator) -> DFlashDrafter:
    """The DFlash drafter grown into a DFlash2 one: identity convolutions with small dynamic corrections, and a
    candidate selector whose pair scores start near zero, so that it first drafts as the DFlash drafter would."""
    w = model.gguf_tensors()
    H, c = model.shape.n_embd, DFLASH2
    K, g, R = c["conv_kernel_size"], c["conv_group_size"], c["selector_rank"]
    if H % g:
        raise ValueError(f"DFlash2 needs a hidden size divisible by its conv group size {g}; the target's is {H}")
    base = np.zeros((2, K, H), np.float32)
    base[:, 0] = 1.0
    for i in range(model.shape.n_layer):
        for side in ("attn", "ffn"):
            w[f"blk.{i}.{side}_conv_base"] = base
            w[f"blk.{i}.{side}_conv_proj.weight"] = (rng.standard_normal((2 * K * H // g, H)) * 0.01 / np.sqrt(H)
                                                     ).astype(np.float32)
    for side in ("predecessor", "successor"):
        w[f"selector_{side}.weight"] = (rng.standard_normal((n_vocab, R)) * 0.1).astype(np.float32)
    w["selector_hidden.weight"] = (rng.standard_normal((R, H)) / np.sqrt(H)).astype(np.float32)
    shape = dataclasses.replace(model.shape, conv_group_size=g, selector_top_k=c["selector_top_k"])
    return DFlashDrafter(shape, w)


class Trainer:
    def __init__(self, cfg: TrainConfig, log=print):
        self.cfg = cfg
        self.log = log
        self.out = Path(cfg.out)
        self.target_info = read_gguf(cfg.target)
        t = self.target_info
        if cfg.init is not None:
            self._shape_from_init()
        if cfg.target_layers is None:
            cfg.target_layers = default_target_layers(t.n_layer, cfg.n_layer)
        if cfg.draft_vocab is None and t.n_vocab > 65536:
            cfg.draft_vocab = 16384
        if cfg.draft_vocab is not None and not 1 <= cfg.draft_vocab <= t.n_vocab:
            raise ValueError(f"--draft-vocab must be between 1 and the target's {t.n_vocab} tokens")
        if cfg.block_size < 2:
            raise ValueError("--block-size must be at least 2 (the anchor and one drafted token)")
        if not 0 <= cfg.soft <= 1:
            raise ValueError(f"--soft-labels must be between 0 and 1, got {cfg.soft}")
        if cfg.window < 0:
            raise ValueError(f"--window must be 0 (the whole context) or more, got {cfg.window}")
        if cfg.samples < 1:
            raise ValueError(f"--samples must be 1 or more, got {cfg.samples}")
        if cfg.text_samples < 0:
            raise ValueError(f"--text-samples must be 0 or more, got {cfg.text_samples}")
        if not 1 <= cfg.parallel <= 256:
            raise ValueError(f"-np/--parallel must be between 1 and 256 (llama.cpp's sequences), got {cfg.parallel}")
        self._full_head = None
        self._check_resume()

    def _shape_from_init(self) -> None:
        """Train on from an existing drafter (ours, or z-lab's converted): it must be one for this target, and its
        layers, feature layers, block size and draft vocabulary are the run's."""
        cfg, t = self.cfg, self.target_info
        d = read_gguf(cfg.init)
        spec = check_pair(t, d)
        if "markov_w1.weight" in d.tensors:
            raise ValueError(f"{cfg.init}: a DSpark drafter; train makes and continues DFlash and DFlash2 drafters")
        if "selector_hidden.weight" in d.tensors:
            cfg.variant = "dflash2"
        cfg.n_layer, cfg.n_ff = d.get("block_count"), d.get("feed_forward_length")
        cfg.target_layers, cfg.block_size = list(spec.layers), spec.block_size
        cfg.draft_vocab = int(d.tensors["d2t"].shape[0]) if "d2t" in d.tensors else t.n_vocab

    def _check_resume(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "train.json"
        mine = dataclasses.asdict(self.cfg)
        if path.exists():
            old = json.loads(path.read_text())
            diff = [k for k in SHAPE_FIELDS if old.get(k) != mine[k]]
            if diff:
                raise ValueError(f"{self.out} holds a run with other {', '.join(diff)} "
                                 f"({', '.join(f'{k}={old.get(k)}' for k in diff)}); use another --out")
        with atomic_output(path) as tmp:
            tmp.write_text(json.dumps(mine, indent=1) + "\n")

    # -- data -------------------------------------------------------------------------------------------------------

    def prompts(self) -> tuple[list[str], list[str]]:
        """The corpus in training order, and its last --eval-prompts, held out: no run on this corpus trains on them
        however many samples it makes, so a drafter continued (--init) from one trained on more samples is still
        validated on text it never saw."""
        from .corpus import training_prompts

        cfg = self.cfg
        prompts = self.recorded("prompts.json", lambda: training_prompts(cfg.corpus, cfg.seed, chat=cfg.chat))
        n = len(prompts) - cfg.eval_prompts
        if cfg.samples > n:
            raise ValueError(f"the corpus has {len(prompts)} prompts: too few for {cfg.samples} samples and "
                             f"{cfg.eval_prompts} held-out prompts")
        return prompts[:n], prompts[n:]

    def recorded(self, name: str, make) -> list[str]:
        """The run's own list of prompts (or passages), written at its first sitting and read back by the later ones:
        the default corpora are built from the installed packages, so installing one between sittings would
        reorder them, and sample i must keep coming from the same prompt i."""
        path = self.out / name
        if path.exists():
            return json.loads(path.read_text())
        texts = make()
        with atomic_output(path) as tmp:
            tmp.write_text(json.dumps(texts))
        return texts

    def make_data(self, prompts: list[str], held_out: list[str]) -> list[Sample]:
        cfg = self.cfg
        t0, done = time.perf_counter(), [0]  # tokens made by this run

        def progress(i, n_new, what="sample", total=cfg.samples):
            done[0] += n_new
            rate = done[0] / (time.perf_counter() - t0)
            self.log(f"data: {what} {i + 1}/{total}, {n_new} tokens ({rate:.0f} tokens/s)")

        paths = make_data(cfg.target, self.out / "data", cfg.target_layers, prompts, cfg.samples, cfg.max_new,
                          n_parallel=cfg.parallel, progress=progress, placement=Placement(**cfg.placement),
                          chat=cfg.chat, temperature=cfg.temperature)
        if cfg.text_samples:
            from .corpus import training_prompts

            t0, done[0] = time.perf_counter(), 0
            held = set(held_out)  # a --corpus file's texts are its passages too
            passages = [p for p in self.recorded("passages.json", lambda: training_prompts(cfg.corpus, cfg.seed,
                                                                                          passages=True))
                        if p not in held]
            paths += make_data(cfg.target, self.out / "data-text", cfg.target_layers, passages, cfg.text_samples, 0,
                               n_prompt_max=PASSAGE_TOKENS, n_parallel=cfg.parallel,
                               progress=lambda i, n: progress(i, n, "passage", cfg.text_samples),
                               placement=Placement(**cfg.placement))
        return [load_sample(p) for p in paths]

    # -- model ------------------------------------------------------------------------------------------------------

    def build(self, samples: list[Sample], rng: np.random.Generator):
        cfg, t = self.cfg, self.target_info
        init = Path(cfg.init) if cfg.init else self.out / "init.gguf"
        if not init.exists():
            init_drafter(init, cfg.target, n_layer=cfg.n_layer, target_layers=cfg.target_layers,
                         block_size=cfg.block_size, n_ff=cfg.n_ff, seed=cfg.seed)
        model = load_gguf_drafter(init)
        if not cfg.init and cfg.draft_vocab is not None and cfg.draft_vocab < t.n_vocab:
            scores = read_gguf(cfg.target, full_arrays="tokenizer.ggml.scores").kv.get("tokenizer.ggml.scores")
            prior = np.asarray(scores.values, dtype=np.float64) if scores is not None else None
            ids = draft_vocabulary(samples, t.n_vocab, cfg.draft_vocab, prior)
            model.lm_head = torch.nn.Parameter(torch.from_numpy(target_rows(t, ids)))
            model.d2t = torch.from_numpy(ids)
        if cfg.variant == "dflash2" and model.selector is None:
            model = add_dflash2(model, t.n_vocab, np.random.default_rng(cfg.seed))
        model.shape = dataclasses.replace(model.shape, sliding_window=cfg.window or None, swa_layers=None)
        # embeddings of every token the blocks can hold (anchors and the mask), scaled as the drafter's graph does
        used = np.unique(np.concatenate([s.tokens for s in samples] + [[model.shape.mask_token]]))
        emb = torch.from_numpy(target_rows(t, used, "token_embd.weight")) * model.shape.embedding_scale
        row_of = torch.full((t.n_vocab,), -1, dtype=torch.long)
        row_of[torch.from_numpy(used)] = torch.arange(len(used))
        scale = torch.from_numpy(feature_scale(samples, rng))
        if cfg.init:  # a GGUF's fc reads raw features; training feeds them divided by the scale
            with torch.no_grad():
                model.fc.mul_(scale[None, :])
        return model, emb, row_of, scale

    def head(self, model: DFlashDrafter) -> torch.Tensor:
        if model.lm_head is not None:
            return model.lm_head
        if self._full_head is None:  # the target's own head, frozen
            t = self.target_info
            self._full_head = torch.from_numpy(target_rows(t, np.arange(t.n_vocab))).to(self.device)
        return self._full_head

    # -- export -----------------------------------------------------------------------------------------------------

    def export(self, model: DFlashDrafter, scale: torch.Tensor, gguf_path: Path, outtype: str,
               folder: Path | None = None) -> Path:
        """Write the z-lab checkpoint folder and convert it to a GGUF with the converter."""
        from dflash_local.convert.hf_to_gguf import convert_drafter
        from dflash_local.convert.zlab_checkpoint import write_checkpoint

        cfg, t, sh = self.cfg, self.target_info, model.shape
        tensors = model.gguf_tensors()
        tensors["fc.weight"] = tensors["fc.weight"] / scale.cpu().numpy()[None, :]  # fold the feature scale in
        if "d2t" in tensors:
            tensors["d2t"] = tensors["d2t"] - np.arange(len(tensors["d2t"]))  # z-lab stores offsets
        n_ff = tensors["blk.0.ffn_gate.weight"].shape[0]
        dflash_config = {"target_layer_ids": [i - 1 for i in sh.target_layers], "mask_token_id": sh.mask_token}
        if cfg.variant == "dflash2":
            dflash_config |= DFLASH2 | {"block_size": sh.block_size}
        config = {
            "architectures": ["DFlash2DraftModel" if cfg.variant == "dflash2" else "DFlashDraftModel"],
            "model_type": "qwen3",
            "_name_or_path": f"dflash-local drafter for {t.kv.get('general.name', t.arch)}",
            "hidden_size": sh.n_embd,
            "num_hidden_layers": sh.n_layer,
            "num_attention_heads": sh.n_head,
            "num_key_value_heads": sh.n_head_kv,
            "head_dim": sh.head_dim,
            "intermediate_size": n_ff,
            "hidden_act": "silu",
            "rms_norm_eps": sh.rms_eps,
            "rope_theta": sh.rope_theta,
            "max_position_embeddings": t.get("context_length") or 4096,
            "vocab_size": t.n_vocab,
            "draft_vocab_size": len(tensors["d2t"]) if "d2t" in tensors else t.n_vocab,
            "block_size": sh.block_size,
            "num_target_layers": t.n_layer,
            "dflash_config": dflash_config,
            "torch_dtype": "float32",
        }
        if sh.sliding_window:  # every layer's
            config |= {"use_sliding_window": True, "sliding_window": sh.sliding_window}
        folder = folder or gguf_path.with_suffix("")
        write_checkpoint(folder, config, tensors)
        convert_drafter(folder, cfg.target, gguf_path, outtype)
        return gguf_path

    def validate(self, model: DFlashDrafter, scale: torch.Tensor, prompts: list[str]) -> dict:
        """Mean acceptance length of the exported drafter in the real engine, greedy, full blocks."""
        from ..engine.engine import Engine

        cfg = self.cfg
        path = self.export(model, scale, self.out / "eval" / "drafter.gguf", "f32")
        engine = Engine(cfg.target, path, n_ctx=2048, placement=Placement(**cfg.placement),
                        draft_policy="fixed")
        drafted = accepted = steps = 0
        for p in prompts:
            chat = {"messages": [{"role": "user", "content": p}]} if cfg.chat else {"prompt": p}
            s = engine.complete(**chat, max_tokens=cfg.eval_tokens).summary
            steps, drafted, accepted = steps + s.steps, drafted + s.n_drafted, accepted + s.n_accepted
        del engine
        return {"mean_acceptance_length": (accepted + steps) / max(steps, 1), "drafted": drafted,
                "accepted": accepted}

    # -- the loop ---------------------------------------------------------------------------------------------------

    def best_so_far(self, best: Path, held_out: list) -> float:
        """The held-out acceptance of the best step so far (best.pt), if validated on the same prompts as now; else
        best.pt is set aside as best.previous.pt and the best step is chosen anew (-1)."""
        if not best.exists():
            return -1.0
        b = torch.load(best, weights_only=False)
        if (b.get("held_out"), b.get("eval_tokens")) == (held_out, self.cfg.eval_tokens):
            return b["tau"]
        best.replace(self.out / "best.previous.pt")
        self.log("best.pt was validated on other held-out prompts: kept as best.previous.pt, and the best step is "
                 "chosen anew")
        return -1.0

    def run(self) -> Path:
        from tqdm import tqdm

        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        torch.set_num_threads(Placement(**cfg.placement).threads)
        self.device = torch.device(pick_device(cfg.device))
        prompts, held_out = self.prompts()
        samples = self.make_data(prompts, held_out)
        rng = np.random.default_rng(cfg.seed)
        model, emb, row_of, scale = self.build(samples, rng)
        model.to(self.device).train()
        emb, row_of, scale = (x.to(self.device) for x in (emb, row_of, scale))
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
        step = 0
        ckpt, best = self.out / "checkpoint.pt", self.out / "best.pt"
        best_tau = self.best_so_far(best, held_out)
        if ckpt.exists():
            state = torch.load(ckpt, map_location=self.device, weights_only=False)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            scale = state["scale"].to(self.device)
            rng.bit_generator.state = state["rng"]
            step = state["step"]
            self.log(f"resuming at step {step}")
        label_of = label_index(model, self.target_info.n_vocab).to(self.device)

        def save():
            with atomic_output(ckpt) as tmp:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scale": scale.cpu(),
                            "rng": rng.bit_generator.state, "step": step}, tmp)

        weights = position_weights(cfg.block_size)
        history = self.out / "train.log.jsonl"
        bar = tqdm(total=cfg.steps, initial=step, desc="train", file=sys.stderr, dynamic_ncols=True)
        recent_loss, recent_acc, recent_s = [], [], []
        t_train, step0 = time.perf_counter(), step
        try:
            while step < cfg.steps:
                t_step = time.perf_counter()
                for g in opt.param_groups:
                    g["lr"] = learning_rate(cfg, step)
                opt.zero_grad()
                total, wsum, acc = 0.0, 0.0, []
                for j in rng.choice(len(samples), size=cfg.batch, replace=len(samples) < cfg.batch):
                    b = sequence_loss(model, self.head(model), emb, row_of, label_of, samples[j], scale, cfg.anchors,
                                      rng, weights, cfg.soft)
                    if b is None:
                        continue
                    (b.loss / (cfg.batch * cfg.anchors)).backward()
                    total, wsum, acc = total + b.loss.item(), wsum + b.weight, acc + b.accepted
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                step += 1
                if cfg.seconds and step == step0 + 20:  # the steps the time allows, at the first 20 steps' rate
                    rate = 20 / (time.perf_counter() - t_train)
                    cfg.steps = min(cfg.steps, max(step + 1, step0 + int(rate * cfg.seconds)))
                    bar.total = cfg.steps
                    self.log(f"{rate:.2f} steps/s: training to step {cfg.steps} in about {cfg.seconds:.0f} s")
                recent_s = (recent_s + [time.perf_counter() - t_step])[-50:]
                recent_loss = (recent_loss + [total / max(wsum, 1e-9)])[-50:]
                recent_acc = (recent_acc + [1 + float(np.mean(acc)) if acc else 1.0])[-50:]
                bar.update(1)
                bar.set_postfix(loss=f"{np.mean(recent_loss):.3f}", tau_train=f"{np.mean(recent_acc):.2f}")
                if step % cfg.save_every == 0 or step == cfg.steps:
                    save()
                    with open(history, "a") as f:
                        f.write(json.dumps({"step": step, "loss": float(np.mean(recent_loss)),
                                            "tau_train": float(np.mean(recent_acc)), "lr": learning_rate(cfg, step - 1),
                                            "steps_per_s": len(recent_s) / sum(recent_s)}) + "\n")
                if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                    model.eval()
                    v = self.validate(model, scale, held_out)
                    model.train()
                    tau = v["mean_acceptance_length"]
                    bar.write(f"step {step}: held-out mean acceptance length {tau:.2f} "
                              f"(engine, {len(held_out)} prompts, {cfg.eval_tokens} tokens each)")
                    with open(history, "a") as f:
                        f.write(json.dumps({"step": step, "eval": v}) + "\n")
                    if tau > best_tau:  # the drafter that is exported in the end
                        best_tau = tau
                        with atomic_output(best) as tmp:
                            torch.save({"model": model.state_dict(), "step": step, "tau": tau,
                                        "held_out": held_out, "eval_tokens": cfg.eval_tokens}, tmp)
        except KeyboardInterrupt:
            save()
            bar.close()
            self.log(f"interrupted: saved step {step} to {ckpt}; run the same command to resume")
            raise
        bar.close()
        if best.exists():
            state = torch.load(best, map_location=self.device, weights_only=False)
            model.load_state_dict(state["model"])
            self.log(f"exporting step {state['step']}, the best held-out mean acceptance length ({state['tau']:.2f})")
        model.eval()
        out = self.export(model, scale, self.out / f"drafter-{cfg.outtype}.gguf", cfg.outtype, self.out / "zlab")
        self.log(f"wrote {self.out / 'zlab'} (z-lab checkpoint) and {out}")
        return out


def run_train(args) -> int:
    from ..models import pair

    placement = from_args(args)
    placement.check(drafting=True)
    cfg = TrainConfig(
        target=str(pair(args.target)[0]), out=args.out, variant=args.variant, init=args.init,
        n_layer=args.layers,
        n_ff=args.ffn_size,
        target_layers=args.target_layers, block_size=args.block_size, draft_vocab=args.draft_vocab, corpus=args.corpus,
        chat=args.chat, temperature=args.data_temp, samples=args.samples, max_new=args.max_new,
        text_samples=args.text_samples, parallel=args.parallel,
        steps=args.steps, seconds=args.train_seconds, batch=args.batch,
        anchors=args.anchors, window=args.window,
        lr=args.lr, soft=args.soft_labels, device=args.device, seed=args.seed, placement=asdict(placement),
        save_every=args.save_every,
        eval_every=args.eval_every, eval_prompts=args.eval_prompts, eval_tokens=args.eval_tokens,
        outtype=args.outtype,
    )
    try:
        Trainer(cfg, log=lambda m: print(f"dflash-local train: {m}", file=sys.stderr)).run()
    except KeyboardInterrupt:
        return 130
    return 0
