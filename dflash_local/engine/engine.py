"""The engine: load and validate a target/drafter pair, then generate text as a stream of events.

Every frontend (CLI, server, TUI, bench) uses Engine.generate and shows only what its events carry.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .. import _native
from ..chat import templates as chat
from .drafter import Drafter, NativeDrafter, as_drafter
from .grammar import grammar_of
from .grammar_guard import GrammarGuard
from ..gguf_file import GGUFInfo, read_gguf
from .ngram import NgramDrafter, NgramSpec
from .placement import FLASH_ATTN, Placement
from .policy import BatchCosts, DraftPolicy
from .proposer import Proposer
from .prompt_cache import PromptCache
from .sampling import ParamError, SamplingParams
from .stats import StatsTracker, StepStats, Summary
from ..chat.textstream import Output
from ..validate import DraftSpec, check_pair, check_target


def utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the prompt is not valid Unicode (it holds a lone surrogate)") from None


class ContextOverflowError(ValueError):
    """The prompt does not fit in the context window."""


Interrupted = _native.Interrupted  # step_many gave up its decode, as interrupt() asked: run the same steps again


class EngineBusyError(RuntimeError):
    """Another generation is running in this slot of the engine."""


@dataclass
class TextDelta:
    text: str
    # with generate(logprobs=N): the log-probabilities of the tokens this step added to the output (their text may
    # come in a later delta, held back by a possible stop string or an incomplete UTF-8 character)
    logprobs: list[_native.TokenLogprob] | None = None


@dataclass
class Finished:
    text: str
    token_ids: list[int]
    summary: Summary
    logprobs: list[_native.TokenLogprob] | None = None  # one per token of token_ids, with generate(logprobs=N)


@dataclass
class Prefilled:
    """Progress of a prompt longer than one batch: its tokens decoded so far, after each chunk but the last (the
    first TextDelta follows that one). Between chunks, generations in other slots take their turn."""

    n_done: int
    n_total: int


Event = TextDelta | StepStats | Finished | Prefilled


@dataclass
class StepRequest:
    """What a generation asks the target to verify at a step (Engine.generation yields it, and takes the native
    StepResult back): the driver runs it alone (Engine.run) or with other slots' in one decode (the server's runner,
    through Engine.step_many)."""

    slot: int
    last: int  # the newest token, not yet in the caches
    draft: list[int]
    sampler: _native.Sampler
    index: int  # the generated token number of the target's token after `last`
    rejection: bool
    head_rows: int  # the verify rows the proposer expects to read


@dataclass
class DraftRequest:
    """What a generation asks the engine's llama.cpp drafter for at a step, before its StepRequest (greedy drafts
    only): the driver drafts it alone (Engine.run) or with other slots' in one drafter decode (the server's runner,
    through Engine.draft_many), and sends back (tokens, ratings or None, milliseconds)."""

    slot: int
    last: int
    n_draft: int


@dataclass
class Generation:
    """One generation's request, parsed and checked once (Engine.prepare), then run by the loop (Engine.run). The
    server, the CLI and the TUI hand this object on; its sampler holds the generation's sampling state, so it runs
    once."""

    ids: list[int]  # the prompt's tokens
    prompt_text: str | None  # for chat messages, what the chat template made of them (an output parser reads it)
    max_tokens: int
    stop: list[str]
    sampler: _native.Sampler
    logprobs: bool  # report each token's logprobs (the sampler records them)
    drafter: Drafter | None  # what drafts, beside the n-gram lookup; None: plain decoding
    max_draft: int  # the drafter's longest draft
    ngram: bool  # draft from repeats in the context too
    shown: frozenset[int]  # control tokens the output shows as text
    rejection: bool  # verify sampled drafts by speculative (rejection) sampling
    cache_prompt: bool = True  # reuse the prefix of the prompt the slot's caches hold


@dataclass
class Slot:
    """One of the engine's slots: a sequence of its own in the session's caches, where one generation runs at a time.
    Its prompt cache and draft policies carry over from one generation to the next."""

    id: int
    cache: PromptCache
    policies: dict[str, DraftPolicy]  # per drafter ("drafter", "ngram"): acceptance and costs
    busy: threading.Lock
    beside: tuple[int, float] = (0, 0.0)  # the other slots' rows and tokens in the decode of its last step


def _check_spec_sampling(mode: str) -> None:
    if mode not in ("match", "rejection"):
        raise ValueError(f"spec sampling must be match or rejection, not {mode!r}")


def _file_type(info) -> str:
    from gguf import LlamaFileType

    ft = info.kv.get("general.file_type")
    try:
        return LlamaFileType(ft).name.removeprefix("MOSTLY_") if ft is not None else "unknown"
    except ValueError:
        return str(ft)


def _check_options(capture, draft_policy, spec_sampling, draft_backend, n_ctx, n_rs_seq, n_slots) -> None:
    """Engine's plain options, checked before any file is read."""
    if capture not in ("auto", "layer_api", "callback"):
        raise ValueError(f"capture must be auto, layer_api or callback, not {capture!r}")
    if draft_policy not in ("auto", "fixed"):
        raise ValueError(f"draft policy must be auto or fixed, not {draft_policy!r}")
    _check_spec_sampling(spec_sampling)
    if draft_backend not in ("ggml", "torch"):
        raise ValueError(f"draft backend must be ggml or torch, not {draft_backend!r}")
    if n_ctx != 0 and n_ctx < 8:
        raise ValueError(f"n_ctx must be 0 (the model's trained context) or at least 8, got {n_ctx}")
    if n_rs_seq is not None and not 0 <= n_rs_seq <= 512:
        raise ValueError(f"n_rs_seq must be in 0..512, got {n_rs_seq}")
    if isinstance(n_slots, bool) or not isinstance(n_slots, int) or not 1 <= n_slots <= 256:
        raise ValueError(f"n_slots must be an integer in 1..256, got {n_slots!r}")
    if n_slots > 1 and draft_backend == "torch":
        raise ValueError("the torch drafter keeps one context: it drafts for one slot (n_slots 1)")


def _read_pair(model, draft, draft_backend) -> tuple[GGUFInfo, GGUFInfo | None, DraftSpec | None]:
    """The target's and the drafter's GGUF headers, checked as a pair, and the drafter's shape; a checkpoint folder
    (the torch drafter's) has neither header nor shape until it is loaded."""
    target_info = read_gguf(model)
    check_target(target_info)
    if draft and Path(draft).is_dir():
        if draft_backend != "torch":
            raise ValueError(f"{draft} is a checkpoint folder: run it with draft_backend='torch', or convert it "
                             f"to GGUF for the llama.cpp drafter (dflash-local convert)")
        return target_info, None, None
    if draft:
        draft_info = read_gguf(draft)
        return target_info, draft_info, check_pair(target_info, draft_info)
    return target_info, None, None


class Engine:
    def __init__(
        self,
        model: str | os.PathLike,
        draft: str | os.PathLike | None = None,
        *,
        n_ctx: int = 4096,
        n_gpu_layers: int = 0,
        n_threads: int | None = None,
        block_size: int | None = None,
        capture: str = "auto",
        draft_backend: str = "ggml",
        draft_device: str = "cpu",
        draft_policy: str = "auto",
        spec_sampling: str = "match",
        flash_attn: bool | None = None,
        repack: bool = False,
        placement: Placement | None = None,
        verbose: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        n_rs_seq: int | None = None,
        ngram: NgramSpec | None = None,
        n_slots: int = 1,
    ):
        """capture: how target features are read: 'auto' (from the architecture), 'layer_api' or 'callback'.

        draft_backend: 'ggml' runs the drafter in llama.cpp; 'torch' runs it in PyTorch on draft_device (cuda, mps
        or cpu) beside the llama.cpp target.

        draft_policy: 'auto' drafts, at each step, the number of tokens a cost model expects to be fastest
        (policy.py); 'fixed' always drafts a full block.

        placement: where weights and caches go, KV types, batch sizes, threads (placement.py); without it,
        n_gpu_layers, n_threads, flash_attn and repack make one. n_ctx 0 is the model's trained context.

        flash_attn: None is the placement's default (on with the target on the CPU where setup.sh's kernel gives a
        row the same bits whatever the batch, else off). repack selects ggml's repacked CPU kernels, which round a
        verify batch differently from a single token, so greedy output may then differ from plain decoding where two
        tokens nearly tie; it is off by default: verification is then bit-exact.

        chat_template replaces the GGUF's chat template; chat_template_kwargs are extra variables for it (such as
        enable_thinking), under those of each request.

        n_rs_seq: for targets with recurrent memory (Qwen3.5, Mamba, ...), the per-token state snapshots llama.cpp
        keeps to roll back rejected drafts (default: the longest draft). A rollback they do not cover restores a
        checkpoint and decodes the accepted tokens again; architectures without snapshots always do that.

        ngram: also draft from repeats in the context (ngram.py), before the drafter at each step; with no drafter,
        the n-gram lookup alone drafts.

        n_slots: generations that can run at once (a server's -np), each in a slot with a cache of its own of n_ctx
        tokens; run() takes the slot. Each slot's output is that of the same generation run alone.
        """
        _check_options(capture, draft_policy, spec_sampling, draft_backend, n_ctx, n_rs_seq, n_slots)
        # the drafter GGUF's header and shape (a z-lab checkpoint folder has no header: its shape comes on loading)
        self.target_info, self.draft_info, self.spec = _read_pair(model, draft, draft_backend)
        if placement is None:
            placement = Placement(n_gpu_layers=n_gpu_layers, n_threads=n_threads, repack=repack,
                                  flash_attn=None if flash_attn is None else "on" if flash_attn else "off")
        placement.check(drafting=bool(draft) and draft_backend == "ggml")
        placement.check_head_sizes(self.target_info, self.draft_info if draft_backend == "ggml" else None)
        self.placement = placement
        n_ctx_train = self.target_info.get("context_length") or n_ctx
        self.n_ctx = min(n_ctx, n_ctx_train) if n_ctx else 0  # 0: llama.cpp's, read back below
        self.n_threads = placement.threads
        self.draft_path = draft
        self.chat_template = chat_template or self.target_info.kv.get("tokenizer.chat_template")
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        # the most prompt tokens one prefill decode takes (None: a whole batch, -b): the server's runner lowers it while
        # other slots stream, so that a long prompt goes a slice per round (server/runner.py)
        self.prefill_chunk: int | None = None
        self.target = _native.Model(str(model), verbose=verbose, **placement.model_kwargs())
        self.draft_model = None  # the llama.cpp drafter's weights
        self.drafter: Drafter | None = None  # what drafts when generate() is not given a drafter
        if draft and draft_backend == "ggml":
            self.draft_model = _native.Model(str(draft), verbose=verbose, **placement.model_kwargs(draft=True))
        elif draft:
            from .torch_drafter import TorchDraftBackend, pick_device

            self.drafter = TorchDraftBackend.load(draft, model, pick_device(draft_device))
            sh = self.drafter.model.shape
            self.spec = self.spec or DraftSpec(sh.target_layers, sh.block_size, sh.mask_token, sh.anchor_first)

        self.block_size = self._block_size(block_size)  # every generation's, unless generate() is given another
        self.max_draft = self._longest_draft(self.block_size)

        layers = self.spec.layers if self.spec else []
        arch = self.target_info.arch
        use_layer_api = capture == "layer_api" or (capture == "auto" and _native.arch_records_layer_inputs(arch))
        self.session = _native.Session(
            self.target, self.draft_model, layers, self.n_ctx, self.n_threads, use_layer_api,
            FLASH_ATTN[placement.fa], verbose, **placement.session_kwargs(),
            n_rs_seq=self.max_draft if n_rs_seq is None else n_rs_seq, n_seq=n_slots,
        )
        self.n_ctx = self.n_ctx or self.session.n_ctx
        placement.check_weights({"target": self._memory("target"), "drafter": self._memory("drafter")})
        if self.draft_model is not None:
            self.drafter = NativeDrafter(self.session)

        # Greedy verification reproduces plain decoding bit for bit only when every kernel rounds a verify batch row
        # exactly as it rounds a single token (see docs/lossless.md)
        self.bit_exact = (
            (placement.fa == "off" or _native.cpu_flash_attn_batch_invariant())
            and not placement.repack
            and placement.n_gpu_layers == 0
            and _native.cpu_matmul_batch_invariant()
            # with upstream's sgemm (a row alone goes to vec_dot) only padded decodes are exact, and recurrent
            # targets are not padded
            and (not _native.sgemm_skips_one_row() or self.session.pads_rows)
        )
        self.draft_policy = draft_policy
        self.spec_sampling = spec_sampling
        self.ngram = ngram
        self.slots = [Slot(i, PromptCache(i), {}, threading.Lock()) for i in range(n_slots)]
        self.batch_costs = BatchCosts()  # what a decode of several slots' steps costs, for their policies
        # the native session serves one call at a time: slots running in several threads take turns, a step each
        self._native = threading.Lock()
        self.grammar_guard = GrammarGuard(model)
        # no token spells more bytes than this: a text of more than n_ctx times it cannot fit the context
        self.longest_token = max(len(self.target.piece(t, True)) for t in range(self.target.n_vocab))

    @property
    def cache(self) -> PromptCache:
        """Slot 0's prompt cache (the slot of generate())."""
        return self.slots[0].cache

    @property
    def _policies(self) -> dict[str, DraftPolicy]:
        return self.slots[0].policies

    def set_verbose(self, on: bool) -> None:
        """Show llama.cpp's log during this engine's calls (other engines keep their own setting)."""
        for native in (self.target, self.draft_model, self.session):
            if native is not None:
                native.verbose = on

    # -- information ----------------------------------------------------------------------------------------------

    @property
    def has_drafter(self) -> bool:
        return self.drafter is not None

    def _block_size(self, block_size: int | None) -> int:
        """A block size as drafting uses it: at least 1 (else ValueError), at most the drafter's trained size (1
        without a drafter), which None stands for."""
        trained = self.spec.block_size if self.spec else 1
        if block_size is None:
            return trained
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block size must be an integer of at least 1, got {block_size!r}")
        return min(block_size, trained)

    def _longest_draft(self, block_size: int) -> int:
        """The longest draft the drafter makes in a block of block_size (its spec's rule); 0 without a drafter."""
        return self.spec.longest_draft(block_size) if self.spec else 0

    @property
    def spec_types(self) -> list[str]:
        """What drafts, by llama.cpp's names for speculative types, in the order each step tries them."""
        return (["ngram-simple"] if self.ngram else []) + (["dflash"] if self.has_drafter else [])

    @property
    def n_max(self) -> int:
        """The longest draft a step may verify."""
        return max(self.max_draft if self.has_drafter else 0, self.ngram.size_m if self.ngram else 0)

    def model_info(self) -> dict:
        """What a frontend shows about the loaded pair."""
        t = self.target_info
        info = {
            "target": {
                "path": str(t.path),
                "arch": t.arch,
                "quant": _file_type(t),
                "desc": self.target.desc,
                "size_bytes": self.target.size,
                "n_layer": self.target.n_layer,
                "n_embd": self.target.n_embd,
                "n_vocab": self.target.n_vocab,
            },
            "n_ctx": self.n_ctx,
            "n_threads": self.n_threads,
            "block_size": self.block_size,
            "feature_capture": "layer_api" if self.session.uses_layer_api else "callback",
            "bit_exact_verify": self.bit_exact,
            "padded_decode": self.session.pads_rows,  # a llamafile build's second row (docs/lossless.md)
            # the int8 copy of the LM head for greedy rows, once the first decode found the head (greedy_head.h)
            "greedy_head_bytes": self.session.greedy_head_bytes,
            "gpu_offload": _native.supports_gpu_offload(),
            "placement": self.placement_info(),
            "memory": {"target": self._memory("target"), "drafter": self._memory("drafter")},
            "drafter": None,
        }
        if self.draft_model is not None:
            info["draft_backend"] = "ggml"
        elif self.drafter is not None:
            info["draft_backend"] = f"torch ({self.drafter.device})"
        if self.spec:
            d = self.draft_info
            info["drafter"] = {
                "path": str(self.draft_path),
                "arch": d.arch if d else "DFlashDraftModel (checkpoint)",
                "quant": _file_type(d) if d else "safetensors",
                "size_bytes": d.path.stat().st_size if d else 0,
                "n_layer": d.get("block_count") if d else self.drafter.model.shape.n_layer,
                "target_layers": self.spec.layers,
                "trained_block_size": self.spec.block_size,
            }
        return info

    def placement_info(self) -> dict:
        """What is where: the settings llama.cpp got and the GPU layers they come to."""
        info = self.placement.describe()
        gpus = _native.gpu_devices()
        # llama.cpp's -ngl slots: every block (MTP layers included, which the graph does not run) and the output
        n_slots = self.target_info.get("block_count") + 1
        ngl = self.target.n_gpu_layers
        info["gpu_devices"] = gpus
        info["target_layers_on_gpu"] = (min(n_slots, ngl) if ngl >= 0 else n_slots) if gpus else 0
        info["target_layer_slots"] = n_slots
        info["n_expert"] = self.target.n_expert
        info["load_mode"] = self.target.load_mode
        return info

    def _memory(self, which: str) -> list[dict]:
        """llama.cpp's memory breakdown: bytes per buffer type (CPU, CPU_Mapped, CUDA0, ...) of weights, KV cache and
        compute buffers."""
        return [{"buffer_type": name, "model": m, "context": c, "compute": k}
                for name, m, c, k in self.session.memory(which)]

    # -- prompts --------------------------------------------------------------------------------------------------

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        """Tokenize text; `special` parses control tokens and adds BOS only where the text lacks it."""
        if not special:
            return self.target.tokenize(text, True, False)
        return self.mixed_ids([text], special=True, bos=True)

    def detokenize(self, ids: list[int]) -> str:
        return b"".join(self.target.piece(t) for t in ids).decode("utf-8", errors="replace")

    def chat_prompt(self, messages: list[dict], chat_template_kwargs: dict | None = None) -> str:
        """The prompt text for chat messages; chat_template_kwargs (tools, enable_thinking, ...) go to the template."""
        bos = self.target.piece(self.target.bos, True).decode(errors="replace") if self.target.bos >= 0 else ""
        eos = self.target.piece(self.target.eos, True).decode(errors="replace") if self.target.eos >= 0 else ""
        if not isinstance(chat_template_kwargs or {}, dict):
            raise ValueError("chat_template_kwargs must be a dict of template variables")
        if len(messages) > self.n_ctx:  # each message is a token at least: refused before the template runs
            raise ContextOverflowError(f"{len(messages)} messages cannot fit the context of {self.n_ctx} tokens")
        variables = {**self.chat_template_kwargs, **(chat_template_kwargs or {})}
        return chat.render(messages, self.chat_template, self.target_info.arch, bos, eos, variables)

    def prompt_tokens(self, prompt: str | None = None, messages: list[dict] | None = None,
                      chat_template_kwargs: dict | None = None) -> list[int]:
        """The tokens a prompt, or chat messages through the chat template, decode as."""
        if (prompt is None) == (messages is None):
            raise ValueError("give either a prompt or chat messages")
        return self._prompt_ids(prompt, self.chat_prompt(messages, chat_template_kwargs) if messages is not None
                                else None)

    def _prompt_ids(self, prompt: str | list[int] | None, chat_text: str | None) -> list[int]:
        """The tokens of a raw prompt (text, or token ids), or of a chat template's output (its control tokens
        parsed), checked against the context."""
        if (prompt is None) == (chat_text is None):
            raise ValueError("give either a prompt or chat messages")
        if isinstance(prompt, list):  # token ids and text mixed, as llama-server's prompts may be
            self._check_bytes(sum(len(utf8(p)) for p in prompt if isinstance(p, str)))
            return self._check_length(self.mixed_ids(prompt, special=True, bos=True))
        text = chat_text if chat_text is not None else prompt
        if not isinstance(text, str):
            raise ValueError("prompt must be a string or a list of token ids")
        self._check_bytes(len(utf8(text)))
        return self._check_length(self.tokenize(text, special=chat_text is not None))

    def _check_bytes(self, n_bytes: int) -> None:
        # before tokenizing, whose time grows faster than the text
        if n_bytes > self.n_ctx * self.longest_token:
            raise ContextOverflowError(
                f"the prompt has {n_bytes} bytes, so at least {-(-n_bytes // self.longest_token)} tokens (no token "
                f"spells more than {self.longest_token} bytes), but the context holds {self.n_ctx}")

    @property
    def adds_bos(self) -> bool:
        """Whether the model's prompts start with its BOS token."""
        return self.target.meta("tokenizer.ggml.add_bos_token") == "true" and self.target.bos >= 0

    def mixed_ids(self, parts: list, special: bool, bos: bool) -> list[int]:
        """Token ids and texts mixed, as llama-server takes them: texts tokenized (control tokens parsed if
        `special`), the BOS first where the model wants one and the first part is text (`bos`)."""
        ids = []
        for part in parts:
            if isinstance(part, str):
                utf8(part)
                ids += self.target.tokenize(part, False, special)
            elif isinstance(part, bool) or not isinstance(part, int) or not 0 <= part < self.target.n_vocab:
                raise ValueError(f"prompt: {part!r} is not a token id of this vocabulary "
                                 f"(0..{self.target.n_vocab - 1})")
            else:
                ids.append(part)
        if bos and self.adds_bos and parts and isinstance(parts[0], str) and (not ids or ids[0] != self.target.bos):
            ids.insert(0, self.target.bos)
        return ids

    def _check_length(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx} (prompt plus at least one "
                f"generated token); shorten it or raise n_ctx"
            )
        return ids

    # -- generation -----------------------------------------------------------------------------------------------

    def generate(self, prompt: str | None = None, messages: list[dict] | None = None, **kwargs) -> Iterator[Event]:
        """Yield TextDelta, StepStats and, last, Finished for a prompt or chat messages; the keywords are prepare()'s.
        draft=False is the plain-decoding baseline."""
        yield from self.run(self.prepare(prompt, messages, **kwargs))

    def prepare(
        self,
        prompt: str | list[int] | None = None,
        messages: list[dict] | None = None,
        *,
        chat_template_kwargs: dict | None = None,
        max_tokens: int | None = 256,
        stop: list[str] | tuple[str, ...] = (),
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        logit_bias: dict[int, float] | list | None = None,
        repeat_penalty: float = 1.0,
        repeat_last_n: int = 64,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        grammar: str | None = None,
        json_schema: dict | str | None = None,
        logprobs: int | None = None,
        draft: bool = True,
        ngram: bool = True,
        external_drafter: Drafter | Callable[[list[int], int], list[int]] | None = None,
        preserved_tokens: list[str] | tuple[str, ...] = (),
        spec_sampling: str | None = None,
        block_size: int | None = None,
        cache_prompt: bool = True,
    ) -> Generation:
        """Parse and check one generation's arguments: the prompt rendered and tokenized, the sampler built, the
        drafts chosen. A bad value raises ValueError (ParamError naming a sampling parameter or the grammar,
        ContextOverflowError for a prompt the context cannot hold) before anything runs.

        max_tokens None: to the end of the context. draft=False is the plain-decoding baseline; ngram=False leaves
        out the engine's n-gram drafts (the drafter alone drafts).

        The sampling controls are llama.cpp's (sampling.py); grammar is GBNF, json_schema a JSON schema the output
        must follow. logprobs=N reports each generated token's log-probability under the target (the softmax of its
        logits, before temperature and controls) with the N most likely tokens.

        preserved_tokens: control tokens (such as gpt-oss's "<|channel|>") that the output shows as text, for a chat
        format's parser; strings that are not one token of this vocabulary are ignored.

        external_drafter drafts in place of the engine's own drafter: a Drafter (drafter.py), or a function of the
        tokens so far (prompt and generated, the newest last) and a draft length that returns the proposed tokens.

        spec_sampling (default: the engine's) verifies sampled drafts by 'match' (the target's own seeded draw must
        equal the draft token: output identical to plain decoding with the same seed) or 'rejection' (speculative
        sampling against the llama.cpp drafter's distribution: the target's distribution, not its seeded tokens,
        and more accepted drafts at temperatures > 0). Greedy decoding is the same under both.

        block_size (default: the engine's) bounds this generation's drafter drafts as the engine's block size does:
        at least 1, and above the drafter's trained size it is the trained size. The n-gram drafts keep their own
        bound.

        cache_prompt=False decodes the whole prompt, reusing nothing the slot's caches hold.
        """
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        max_draft = self.max_draft if block_size is None else self._longest_draft(self._block_size(block_size))
        if isinstance(stop, str):
            stop = [stop]
        if not all(isinstance(s, str) for s in stop):
            raise ValueError("stop must be a string or a list of strings")
        try:
            grammar = grammar_of(grammar, json_schema)
            if grammar:
                self.grammar_guard.check(grammar)
        except ValueError as e:
            raise ParamError("grammar", str(e)) from None
        params = SamplingParams(temperature, top_k, top_p, min_p, seed, logit_bias, repeat_penalty, repeat_last_n,
                                presence_penalty, frequency_penalty, grammar)
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise ValueError(f"logprobs must be a non-negative integer, got {logprobs!r}")
        prompt_text = self.chat_prompt(messages, chat_template_kwargs) if messages is not None else None
        ids = self._prompt_ids(prompt, prompt_text)
        try:
            sampler = params.sampler(self.target, ids, self.n_ctx, logprobs)
        except ParamError:
            raise
        except ValueError as e:  # the grammar did not parse
            if not grammar:
                raise
            raise ParamError("grammar", str(e)) from None
        drafter = None
        if draft:
            drafter = as_drafter(external_drafter) if external_drafter is not None else self.drafter
        spec_sampling = spec_sampling or self.spec_sampling
        _check_spec_sampling(spec_sampling)
        rejection = spec_sampling == "rejection" and drafter is not None and not params.greedy
        if rejection:
            self._check_rejection(drafter, params)
        return Generation(
            ids, prompt_text, max_tokens or self.n_ctx - len(ids), list(stop), sampler, logprobs is not None,
            drafter, max_draft,
            # rejection sampling verifies the drafter's own distribution, which an n-gram draft does not have
            bool(self.ngram and draft and ngram and not rejection),
            self.token_set(preserved_tokens), rejection, cache_prompt,
        )

    def rejection_unsupported(self, drafter: Drafter | None = None) -> str | None:
        """Why `drafter` (default: the engine's) cannot verify by rejection sampling, or None: it needs the drafter's
        own distribution, which only llama.cpp's plain DFlash drafter has."""
        drafter = drafter or self.drafter
        if drafter is None or not drafter.samples:
            return ("rejection sampling needs the llama.cpp drafter's distributions: use the default "
                    "spec sampling (match) with this drafter")
        if self.draft_info is not None and self.draft_info.get("selector_top_k"):
            return ("rejection sampling needs the drafter's distributions: a DFlash2 drafter drafts from its "
                    "selector lattice; use the default spec sampling (match)")
        if self.draft_info is not None and "markov_w1.weight" in self.draft_info.tensors:
            return ("rejection sampling needs the drafter's distributions: a DSpark drafter chains its "
                    "Markov head on greedy drafts, not sampled ones; use the default spec sampling (match)")
        return None

    def _check_rejection(self, drafter: Drafter, params: SamplingParams) -> None:
        """Rejection sampling: a drafter with a distribution of its own, and no grammar (it would change the target's)."""
        why = self.rejection_unsupported(drafter)
        if why:
            raise ValueError(why)
        if params.grammar:
            raise ValueError("rejection sampling does not combine with a grammar: use the default spec sampling "
                             "(match)")

    def token_set(self, texts) -> frozenset[int]:
        """The ids of the strings that are one token of this vocabulary (the others are left out)."""
        ids = (self.target.tokenize(text, False, True) for text in texts)
        return frozenset(one[0] for one in ids if len(one) == 1)

    def run(self, r: Generation, slot: int = 0) -> Iterator[Event]:
        """Run a prepared generation in one of the engine's slots: yield TextDelta, StepStats and, last, Finished.
        Generations in other slots may run meanwhile (in other threads, or interleaved by one consumer)."""
        gen = self.generation(r, slot)
        try:
            result = None
            while True:
                try:
                    ev = gen.send(result)
                except StopIteration:
                    return
                result = None
                if isinstance(ev, (StepRequest, DraftRequest)):
                    try:
                        result = (self.step_many if isinstance(ev, StepRequest) else self.draft_many)([ev])[0]
                    except Exception as e:
                        gen.throw(e)  # the generation records its cache, and the error goes on to the caller
                    continue
                yield ev
        finally:
            gen.close()

    def step_many(self, requests: list[StepRequest]) -> list:
        """Run the steps of several slots' generations: in one target decode where the target allows it (not a
        recurrent one, not a padded session), else one after another. Each slot's result is the one its step alone
        gives. Returns the native StepResults, in the order of the requests."""
        s = self.session
        shared = len(requests) > 1 and not s.recurrent and not s.pads_rows
        with self._native:
            if shared:
                results = s.step_batch([(q.slot, q.last, q.draft, q.sampler, q.index, q.rejection, q.head_rows)
                                        for q in requests])
            else:
                results = [s.step(q.last, q.draft, q.sampler, q.index, q.rejection, q.head_rows, q.slot)
                           for q in requests]
        # the policies price a slot's rows at what they add to a shared decode (policy.py): record the decode whole
        # (each slot's verify_ms is its share, with its own LM head rows) and, per slot, what the others put in it
        rows = [len(r.draft) + 1 for r in results]
        made = [r.n_accepted + 1 for r in results]
        if shared:
            self.batch_costs.record(sum(rows), sum(r.verify_ms - r.head_ms for r in results))
        for q, k, m in zip(requests, rows, made):
            self.slots[q.slot].beside = (sum(rows) - k, float(sum(made) - m)) if shared else (0, 0.0)
        return results

    def draft_many(self, requests: list[DraftRequest]) -> list[tuple[list[int], list[float] | None, float]]:
        """Draft for several slots with the engine's llama.cpp drafter, the drafts of one length in one drafter decode
        (Session.draft_batch); each slot gets the draft it would get alone. Returns (tokens, ratings or None, its
        share of the milliseconds) for each request, in order."""
        with self._native:
            t0 = time.perf_counter()
            drafts = self.session.draft_batch([(q.slot, q.last, q.n_draft) for q in requests])
            ms = (time.perf_counter() - t0) * 1000
        n = sum(q.n_draft for q in requests) or 1
        return [(d.tokens, d.confidence or None, ms * q.n_draft / n) for q, d in zip(requests, drafts)]

    def trim(self) -> None:
        """Give back the memory a burst of large batches left in the per-decode buffers (ours and llama.cpp's, for
        contexts on the CPU: Session.trim), so that an idle engine is back to its size after loading. The slots'
        caches stay; the next generation runs as it would have."""
        with self._native:
            self.session.trim()

    def interrupt(self, on: bool = True) -> None:
        """From another thread: ask the step_many in flight to give up its target decode if it has only begun (in
        its first half), so that a new request's prompt goes before it rather than after; step_many then raises
        Interrupted, with every slot as it was, and the same StepRequests can run again (their outputs unchanged).
        The request holds until a decode honours it or interrupt(False) withdraws it."""
        self.session.interrupt(on)

    def generation(self, r: Generation, slot: int = 0):
        """The generator behind run(): it yields run()'s events and, at each step, a StepRequest (first a
        DraftRequest where the engine's llama.cpp drafter drafts), and takes back that step's native StepResult (the
        draft's result of draft_many) by generator.send. For a driver that runs several slots' steps together."""
        if not 0 <= slot < len(self.slots):
            raise ValueError(f"no slot {slot}: the engine has {len(self.slots)}")
        sl = self.slots[slot]
        if not sl.busy.acquire(blocking=False):
            raise EngineBusyError(f"another generation is running in slot {slot} of this engine")
        try:
            ngram = NgramDrafter(self.ngram) if r.ngram else None
            drafter = r.drafter.for_slot(slot) if r.drafter is not None else None
            if not r.cache_prompt:  # nothing in the caches matches: the prompt is decoded whole
                sl.cache.clear()
            yield from self._generate(sl, r.ids, r.max_tokens, r.stop, r.sampler, r.logprobs, drafter, r.max_draft,
                                      ngram, r.shown, r.rejection)
        finally:
            sl.busy.release()

    def _generate(self, sl: Slot, ids, max_tokens, stop, sampler, logprobs: bool, drafter: Drafter | None,
                  max_draft: int, ngram: NgramDrafter | None, shown: frozenset[int],
                  rejection: bool) -> Iterator[Event]:
        """Prefill what the slot's cache lacks of the prompt, then step (draft at most max_draft tokens from the
        drafter, verify, emit) until the output ends. The native work between two events holds the session."""
        s = self.session
        # the proposers, tried in this order at each step (proposer.py): a repeat in the context, then the drafter
        chain = ([Proposer("ngram", ngram, self._policy_for(sl, "ngram", ngram.m))] if ngram else []) + (
            [Proposer("drafter", drafter, self._policy_for(sl, "drafter", max_draft))] if drafter else [])
        # acceptance by block position: the drafter's block, or without one the n-gram lookup's first 7 drafts
        tracker = StatsTracker(max(max_draft + 1, 2) if drafter else min(ngram.m, 7) + 1 if ngram else 1)
        out = Output(self.target, stop, max_tokens, shown)
        tokens = list(ids)  # the prompt and every token the target produced, also past a stop (they are cached)
        with self._native:
            n_cached = self._reuse_cache(sl, ids, drafter)
        emitted_logprobs = [] if logprobs else None

        def delta(text: str, n_before: int) -> TextDelta | None:
            """The event for one step's text and, when asked, the logprobs of the tokens it kept."""
            lp = None
            if logprobs:
                lp = sampler.take_logprobs()[: len(out.ids) - n_before]
                emitted_logprobs.extend(lp)
            return TextDelta(text, lp) if text or lp else None

        try:
            first, prompt_ms = yield from self._prefill(sl.id, ids, n_cached, sampler, drafter)
            tokens.append(first)
            if ev := delta(out.add(tokens[-1:]), 0):
                yield ev

            while out.finish is None:
                if s.past(sl.id) >= self.n_ctx:
                    out.finish = "context_full"
                    break
                room = max_tokens - len(out.ids) - 1  # drafts past max_tokens would be wasted
                index = len(tokens) - len(ids)  # the number of the target's next generated token
                t0 = time.perf_counter()
                proposer, proposal, ratings, draft_ms, waited_ms = yield from self._propose(
                    sl.id, chain, tokens, room, index, sampler, rejection)
                propose_ms = (time.perf_counter() - t0) * 1000 - waited_ms
                pos0 = s.past(sl.id)
                r = yield StepRequest(sl.id, tokens[-1], proposal, sampler, index, rejection,
                                      proposer.policy.likely_rows(len(proposal)) if proposer else 1)
                # the llama.cpp drafter took the accepted positions' features inside the step; another drafter
                # takes them now, whoever proposed
                draft_ms += r.draft_ms
                extend_ms = 0.0
                if drafter:
                    with self._native:
                        t0 = time.perf_counter()
                        drafter.extend(s, pos0, r.n_accepted + 1)
                        extend_ms = (time.perf_counter() - t0) * 1000
                draft_ms += extend_ms
                elapsed_ms = propose_ms + r.step_ms + extend_ms
                ratings = ratings[: len(r.draft)] if ratings else None
                tokens.extend(r.tokens)
                n_out = len(out.ids)
                text = out.add(r.tokens)
                stats = StepStats(
                    step=len(tracker.steps),
                    n_drafted=len(r.draft),
                    n_accepted=r.n_accepted,
                    n_tokens=len(out.ids) - n_out,
                    draft_ms=draft_ms,
                    verify_ms=r.verify_ms,
                    rollback_ms=r.rollback_ms,
                    other_ms=max(elapsed_ms - draft_ms - r.verify_ms - r.rollback_ms, 0.0),
                    rollback=r.rollback,
                    ngram=proposer is not None and proposer.name == "ngram",
                )
                tracker.add(stats)
                # a rejected draft's rollback is part of what verifying it cost
                verify_ms = stats.verify_ms + stats.rollback_ms
                for p in chain:
                    p.learn(p is proposer, stats.n_drafted, stats.n_accepted, verify_ms, stats.draft_ms, r.sample_ms,
                            ratings, r.head_ms, r.head_rows, sl.beside)
                if ev := delta(text, n_out):
                    yield ev
                yield stats

            tail = out.stream.flush()
            if tail:
                yield TextDelta(tail)
            summary = tracker.summary(
                finish_reason=out.finish,
                drafting=drafter is not None or ngram is not None,
                n_prompt=len(ids),
                n_cached=n_cached,
                n_generated=len(out.ids),
                prompt_ms=prompt_ms,
            )
            summary.stop_word = out.stream.stopped_by or ""
            yield Finished(out.stream.text, list(out.ids), summary, emitted_logprobs)
        finally:
            # whatever happened (a stop, an error, the consumer walking away), the cache record stays true
            sl.cache.record(s, tokens, captured=drafter is not None)

    def _reuse_cache(self, sl: Slot, ids: list[int], drafter: Drafter | None) -> int:
        """Cut the slot's caches back to the prefix of the prompt they can keep; return its length."""
        self.session.set_capture(drafter is not None, sl.id)  # a drafter needs the target's features
        n = sl.cache.reusable(ids, drafter, self.session)
        sl.cache.truncate(self.session, n)
        own = self.drafter.for_slot(sl.id) if self.drafter is not None else None
        for d in (own, drafter):  # the engine's own drafter too: what it held past n is stale now
            if d is not None:
                d.crop(n)
        return n

    def _prefill(self, slot: int, ids: list[int], n_cached: int, sampler, drafter: Drafter | None):
        """Decode the prompt after the cached prefix, a batch at a time (yielding Prefilled between batches); return
        the first generated token and the milliseconds the batches took."""
        s = self.session
        ms = 0.0
        # a recurrent state cannot be cut back later, nor a window cache past its window: checkpoint it before the
        # prompt's last token, where the next prompt that repeats or extends this one can start again, whatever
        # answer followed (a chat template that drops an answer's reasoning from the history; PromptCache.reusable)
        ends = [len(ids) - 1, len(ids)] if s.checkpoints and len(ids) - 1 > n_cached else [len(ids)]
        off = n_cached
        for end in ends:
            while off < end:
                # one native decode at most (features() holds the last decode's rows only), as the runner allows now
                chunk_size = min(s.n_batch, self.prefill_chunk or s.n_batch)
                with self._native:
                    t0 = time.perf_counter()
                    chunk = ids[off : min(off + chunk_size, end)]
                    first = s.prefill(chunk, sampler if off + len(chunk) == len(ids) else None, 0, slot)
                    if drafter:
                        drafter.extend(s, off, len(chunk))
                    if off + len(chunk) == end < len(ids):
                        s.checkpoint(slot)
                    ms += (time.perf_counter() - t0) * 1000
                off += len(chunk)
                if off < len(ids):
                    yield Prefilled(off, len(ids))
        return first, ms

    def _propose(self, slot: int, chain: list[Proposer], tokens: list[int], room: int, index: int, sampler,
                 rejection: bool):
        """The first proposal of the chain: each proposer drafts as many tokens as its policy chooses (at most room),
        cut where its drafter rates them. Greedy drafts of the engine's llama.cpp drafter are asked of the driver (a
        DraftRequest), which may draft several slots' in one decode. Returns the proposer that proposed (None: none
        did, a plain step), its tokens, its drafter's ratings of them (None if it gives none), its milliseconds and
        those spent waiting for the driver beyond them. Rejection sampling draws the drafter's tokens from its
        distribution, which the step then uses."""
        spent = waited = 0.0  # a draft that its ratings cut to nothing still took its time
        for p in chain:
            k = p.length(room)
            if k < 1:
                continue
            t0 = time.perf_counter()
            if p.drafter.drafted_with(self.session) and not rejection:
                proposal, ratings, draft_ms = yield DraftRequest(slot, tokens[-1], k)
                waited += (time.perf_counter() - t0) * 1000 - draft_ms  # other slots' turns, not this draft
            else:
                with self._native:
                    if rejection:
                        proposal, ratings = p.drafter.draft_sampled(tokens, k, sampler, index), None
                    else:
                        proposal, ratings = p.drafter.draft_rated(tokens, k)
                draft_ms = (time.perf_counter() - t0) * 1000
            proposal = p.cut(proposal, ratings, draft_ms)
            if proposal:
                return p, proposal, ratings, draft_ms, waited
            spent = draft_ms if ratings else 0.0
        return None, [], None, spent, waited

    def _policy_for(self, sl: Slot, name: str, max_draft: int) -> DraftPolicy:
        """The adaptive policy of one drafter ('drafter' or 'ngram') in a slot, kept across generations (its timings
        and acceptance carry over, also while a bench interleaves fixed-block runs); a fixed one learns nothing worth
        keeping."""
        if max_draft == 0 or self.draft_policy != "auto":
            return DraftPolicy(max_draft, adaptive=False)
        p = sl.policies.get(name)
        if p is None or p.max_draft != max_draft:
            p = sl.policies[name] = DraftPolicy(max_draft, batch=self.batch_costs)
        p.new_text()
        return p

    def complete(self, *args, **kwargs) -> Finished:
        """Run generate() to the end and return its Finished event."""
        for ev in self.generate(*args, **kwargs):
            if isinstance(ev, Finished):
                return ev
        raise RuntimeError("generation ended without a result")
