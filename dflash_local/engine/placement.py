"""Where the models and caches go, in llama.cpp's spelling: the model and context parameters a user sets, their
command-line flags (one group shared by generate, serve, tui, bench and train), and the checks that refuse a bad
combination before llama.cpp sees it."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")  # llama.cpp's -ctk list
SPLIT_MODES = ("none", "layer", "row", "tensor")  # llama_split_mode's order
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type
# llama.cpp's --n-cpu-moe: the expert weights of layer N (common.h: llm_ffn_block_regex with LLM_FFN_EXPS_REGEX)
CPU_MOE_PATTERN = r"blk\.{}\.ffn_(up|down|gate|gate_up)_(ch|)exps"
# llama_load_mode by (mmap, mlock)
LOAD_MODES = {(True, False): -1, (False, False): 0, (False, True): 2, (True, True): 3}
REPACK = {"target": (True, False), "draft": (False, True), "all": (True, True)}  # --repack WHICH: (target, drafter)
# ggml's AMX matmul (Intel Sapphire Rapids and later) crashes in its tile path, any batch of 2+ rows: see README, "CPUs"
AMX_CRASH = "ggml-org/llama.cpp#20824"


class PlacementError(ValueError):
    """A placement or memory setting llama.cpp would refuse, misread or abort on."""


@dataclass
class Placement:
    n_gpu_layers: int = 0  # target layers on the GPU (negative: all)
    n_gpu_layers_draft: int | None = None  # None: all when the target uses the GPU, else none
    split_mode: str = "layer"
    main_gpu: int = 0
    tensor_split: list[float] = field(default_factory=list)
    overrides: list[tuple[str, str]] = field(default_factory=list)  # -ot: (tensor name regex, buffer type)
    n_cpu_moe: int = 0
    mmap: bool = True
    mlock: bool = False
    repack: bool = False  # the target's weights in ggml's extra buffer types (CPU_REPACK, AMX): --repack target
    repack_draft: bool = False  # the drafter's: --repack draft
    n_threads: int | None = None  # None: all cores
    n_threads_batch: int | None = None  # None: n_threads
    n_batch: int = 512
    n_ubatch: int = 512
    flash_attn: str | None = None  # None: see fa and draft_fa
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    cache_type_k_draft: str | None = None  # None: f16 with the drafter on a GPU, else f32 (bit-exact drafting)
    cache_type_v_draft: str | None = None

    # -- what the defaults come to --------------------------------------------------------------------------------

    @property
    def threads(self) -> int:
        return self.n_threads or os.cpu_count() or 1

    @property
    def fa(self) -> str:
        """The target's flash attention: on the CPU, on where setup.sh's kernel keeps it exact (it skips the cells a
        row does not see, so prompts are cheaper), else off; auto with -ngl."""
        if self.flash_attn:
            return self.flash_attn
        if self.n_gpu_layers != 0:
            return "auto"
        from .. import _native

        return "on" if _native.cpu_flash_attn_batch_invariant() else "off"

    @property
    def draft_fa(self) -> str:
        """The drafter's: off on the CPU (float32 drafts equal to the torch drafter's), auto with -ngl."""
        return self.flash_attn or ("off" if self.n_gpu_layers == 0 else "auto")

    @property
    def draft_gpu_layers(self) -> int:
        if self.n_gpu_layers_draft is not None:
            return self.n_gpu_layers_draft
        return -1 if self.n_gpu_layers != 0 else 0

    def draft_on_gpu(self) -> bool:
        from .. import _native

        return self.draft_gpu_layers != 0 and bool(_native.gpu_devices())

    def draft_cache_types(self) -> tuple[str, str]:
        default = "f16" if self.draft_on_gpu() else "f32"
        return self.cache_type_k_draft or default, self.cache_type_v_draft or default

    def all_overrides(self) -> list[tuple[str, str]]:
        """-ot's overrides, then --n-cpu-moe's: llama.cpp takes a tensor's first matching pattern."""
        return list(self.overrides) + [(CPU_MOE_PATTERN.format(i), "CPU") for i in range(self.n_cpu_moe)]

    # -- checks ---------------------------------------------------------------------------------------------------

    def check(self, drafting: bool) -> None:
        """Refuse what llama.cpp would refuse late, abort on, or quietly ignore."""
        from .. import _native

        for flag, name in (("-ctk", self.cache_type_k), ("-ctv", self.cache_type_v),
                           ("-ctkd", self.cache_type_k_draft), ("-ctvd", self.cache_type_v_draft)):
            if name is not None and name not in CACHE_TYPES:
                raise PlacementError(f"{flag} {name}: unknown KV cache type (one of {', '.join(CACHE_TYPES)})")
        if self.fa not in FLASH_ATTN:
            raise PlacementError(f"-fa {self.flash_attn}: give on, off or auto")
        quantized_v = [f for f, t, fa in (("-ctv", self.cache_type_v, self.fa),
                                          ("-ctvd", self.draft_cache_types()[1] if drafting else "f16", self.draft_fa))
                       if t not in ("f32", "f16", "bf16") and fa == "off"]
        if quantized_v:
            raise PlacementError(f"a quantized V cache ({quantized_v[0]}) needs flash attention: add -fa on (or auto)")
        if self.split_mode not in SPLIT_MODES:
            raise PlacementError(f"-sm {self.split_mode}: give one of {', '.join(SPLIT_MODES)}")
        if self.split_mode == "tensor" and self.fa == "off":
            raise PlacementError("-sm tensor needs flash attention: add -fa on (or auto)")
        gpus = _native.gpu_devices()
        if len(self.tensor_split) > max(len(gpus), 1):
            raise PlacementError(f"-ts gives {len(self.tensor_split)} proportions but llama.cpp sees "
                                 f"{len(gpus)} GPU(s){': ' + ', '.join(gpus) if gpus else ''}")
        if any(not (x >= 0) for x in self.tensor_split) or (self.tensor_split and not any(self.tensor_split)):
            raise PlacementError("-ts proportions must be numbers >= 0, not all 0")
        if self.main_gpu < 0 or (gpus and self.main_gpu >= len(gpus)):
            raise PlacementError(f"-mg {self.main_gpu}: llama.cpp sees {len(gpus)} GPU(s), numbered from 0")
        bufts = _native.buffer_types()
        for pattern, buft in self.overrides:
            if buft not in bufts:
                raise PlacementError(f"-ot {pattern}={buft}: unknown buffer type (this build has {', '.join(bufts)})")
        if self.n_cpu_moe < 0:
            raise PlacementError(f"--n-cpu-moe {self.n_cpu_moe}: give a number of layers >= 0")
        if (self.repack or self.repack_draft) and "AMX" in _native.extra_buffer_types():
            raise PlacementError(f"--repack: this CPU has AMX, and with this llama.cpp repacked weights go to ggml's "
                                 f"AMX buffer, whose matmul crashes the process on any batch of 2 or more rows "
                                 f"({AMX_CRASH}); run without --repack")
        if any(n is not None and n < 1 for n in (self.n_threads, self.n_threads_batch)):
            raise PlacementError("-t and -tb need at least 1 thread")
        if self.n_batch < 1 or not 1 <= self.n_ubatch <= self.n_batch:
            raise PlacementError(f"need 1 <= -ub <= -b, got -b {self.n_batch} -ub {self.n_ubatch}")
        if drafting and self.n_batch < 2:
            raise PlacementError("with a drafter, -b must be at least 2: a verify block is the last token and the "
                                 "drafted tokens, in one batch")

    def check_head_sizes(self, target_info, draft_info=None) -> None:
        """A quantized cache type stores rows in blocks of 32 values: each head must hold whole blocks (llama.cpp
        refuses the context, or asserts in a matmul without flash attention)."""
        k_draft, v_draft = self.draft_cache_types()
        for info, types, flags in ((target_info, (self.cache_type_k, self.cache_type_v), ("-ctk", "-ctv")),
                                   (draft_info, (k_draft, v_draft), ("-ctkd", "-ctvd"))):
            if info is None:
                continue
            head = info.get("embedding_length", 0) // max(info.get("attention.head_count", 1) or 1, 1)
            sizes = (info.get("attention.key_length", head), info.get("attention.value_length", head))
            # gemma4's sliding-window layers have heads of another size
            swa = (info.get("attention.key_length_swa"), info.get("attention.value_length_swa"))
            for flag, name, full, window in zip(flags, types, sizes, swa):
                for size in (full, window or full):
                    if name not in ("f32", "f16", "bf16") and size % 32:
                        raise PlacementError(f"{flag} {name}: the {info.arch} model's attention heads hold {size} "
                                             f"values, not a multiple of {name}'s block of 32")

    def check_weights(self, memory: dict) -> None:
        """Read back where llama.cpp put each model's weights (its memory report, per context): in ggml's extra
        buffer types only where --repack asked for it. Their kernels change rounding with the batch size, and on AMX
        CPUs crash; nothing but the flag may put weights there."""
        from .. import _native

        extra = set(_native.extra_buffer_types())
        for which, asked in (("target", self.repack), ("drafter", self.repack_draft)):
            landed = sorted({row["buffer_type"] for row in memory.get(which, []) if row["model"]} & extra)
            if landed and not asked:
                raise PlacementError(f"the {which}'s weights went to {', '.join(landed)} though --repack did not "
                                     f"ask for it")

    # -- what goes to the native module ---------------------------------------------------------------------------

    def model_kwargs(self, draft: bool = False) -> dict:
        """Keyword arguments of _native.Model for the target (or the drafter: its own GPU layers, no overrides)."""
        return dict(
            n_gpu_layers=self.draft_gpu_layers if draft else self.n_gpu_layers,
            # off unless asked, for the drafter too: its drafts need no bit-exactness, but AMX CPUs crash there
            repack=self.repack_draft if draft else self.repack,
            split_mode=SPLIT_MODES.index(self.split_mode),
            main_gpu=self.main_gpu,
            tensor_split=list(self.tensor_split),
            load_mode=LOAD_MODES[(self.mmap, self.mlock)],
            overrides=[] if draft else self.all_overrides(),
        )

    def session_kwargs(self) -> dict:
        """Keyword arguments of _native.Session past its positional ones."""
        k_draft, v_draft = self.draft_cache_types()
        return dict(
            n_threads_batch=self.n_threads_batch or self.threads,
            n_batch=self.n_batch,
            n_ubatch=self.n_ubatch,
            type_k=self.cache_type_k,
            type_v=self.cache_type_v,
            type_k_draft=k_draft,
            type_v_draft=v_draft,
            flash_attn_draft=FLASH_ATTN[self.draft_fa],
        )

    def describe(self) -> dict:
        """The settings as llama.cpp got them, for model_info()."""
        k_draft, v_draft = self.draft_cache_types()
        return {
            "n_gpu_layers": self.n_gpu_layers,
            "n_gpu_layers_draft": self.draft_gpu_layers,
            "split_mode": self.split_mode,
            "main_gpu": self.main_gpu,
            "tensor_split": list(self.tensor_split),
            "overrides": [f"{p}={b}" for p, b in self.all_overrides()],
            "n_cpu_moe": self.n_cpu_moe,
            "repack": [name for name, on in (("target", self.repack), ("draft", self.repack_draft)) if on],
            "flash_attn": self.fa,
            "flash_attn_draft": self.draft_fa,
            "cache_type_k": self.cache_type_k,
            "cache_type_v": self.cache_type_v,
            "cache_type_k_draft": k_draft,
            "cache_type_v_draft": v_draft,
            "n_batch": self.n_batch,
            "n_ubatch": self.n_ubatch,
            "n_threads_batch": self.n_threads_batch or self.threads,
            "mmap": self.mmap,
            "mlock": self.mlock,
        }


# -- command line -------------------------------------------------------------------------------------------------


def _overrides(text: str) -> list[tuple[str, str]]:
    out = []
    for item in text.split(","):
        pattern, eq, buft = item.partition("=")
        if not eq or not pattern or not buft:
            raise argparse.ArgumentTypeError(f"{item!r}: give PATTERN=BUFFER_TYPE, e.g. "
                                             "'blk\\.[0-9]+\\.ffn_.*_exps=CPU'")
        out.append((pattern, buft))
    return out


def _split(text: str) -> list[float]:
    try:
        return [float(x) for x in text.replace("/", ",").split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give proportions separated by commas, e.g. 3,1") from None


class _Extend(argparse.Action):
    """-ot may be given several times, each with a comma-separated list."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, (getattr(namespace, self.dest) or []) + values)


def _threads(text: str) -> int:
    """A thread count: at least 1; past this machine's cores a warning, since llama.cpp's threads then wait on each
    other at every operation (-t 1000 on 2 cores ran at a hundredth of the speed)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of threads, 1 or more")
    cores = os.cpu_count() or 1
    if n > cores:
        print(f"dflash-local: warning: {n} threads on a machine with {cores} cores: llama.cpp's threads will wait on "
              f"each other and run far slower than with {cores} or fewer", file=sys.stderr)
    return n


def add_placement_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("placement and memory (llama.cpp's flags)")
    g.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", type=int, default=0, metavar="N",
                   help="target layers on the GPU (-1: all; default 0)")
    g.add_argument("-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft", type=int, metavar="N",
                   help="drafter layers on the GPU (default: all when the target uses the GPU, else none)")
    g.add_argument("-sm", "--split-mode", choices=SPLIT_MODES, default="layer",
                   help="how to split the target across GPUs (default layer)")
    g.add_argument("-ts", "--tensor-split", type=_split, metavar="N0,N1,...",
                   help="proportion of the target for each GPU, e.g. 3,1")
    g.add_argument("-mg", "--main-gpu", type=int, default=0, metavar="I",
                   help="the GPU for the model with -sm none (default 0)")
    g.add_argument("-ot", "--override-tensor", type=_overrides, action=_Extend, metavar="PATTERN=TYPE,...",
                   help="put the tensors whose names match a regex in a buffer type (e.g. CPU), as llama.cpp")
    g.add_argument("--n-cpu-moe", "-ncmoe", type=int, default=0, metavar="N",
                   help="keep the expert weights of the first N layers on the CPU")
    g.add_argument("--no-mmap", action="store_true", help="read the weights into memory instead of mapping the file")
    g.add_argument("--mlock", action="store_true", help="keep the weights in RAM (no swapping)")
    g.add_argument("-t", "--threads", type=_threads, metavar="N", help="CPU threads for generation (default: all "
                   "cores)")
    g.add_argument("-tb", "--threads-batch", type=_threads, metavar="N",
                   help="CPU threads for prompts and verify batches (default: -t)")
    g.add_argument("-b", "--batch-size", type=int, default=512, metavar="N",
                   help="most tokens in one target decode (default 512): prompt chunks, and verify blocks (the last "
                        "token plus the drafts), so a smaller -b than the drafter's block shortens drafts; the "
                        "drafter takes as many, in one ubatch (its attention is non-causal)")
    g.add_argument("-ub", "--ubatch-size", type=int, default=512, metavar="N",
                   help="physical batch of the target (default 512, at most -b)")
    g.add_argument("-fa", "--flash-attn", nargs="?", const="on", choices=list(FLASH_ATTN), metavar="on|off|auto",
                   help="flash attention (default: on with the target on the CPU where setup.sh's kernel keeps it "
                        "exact, as it does, and off for the drafter there; auto with -ngl). Needed for a quantized V "
                        "cache")
    types = ", ".join(CACHE_TYPES)
    g.add_argument("-ctk", "--cache-type-k", choices=CACHE_TYPES, default="f16", metavar="TYPE",
                   help=f"target K cache type: {types} (default f16)")
    g.add_argument("-ctv", "--cache-type-v", choices=CACHE_TYPES, default="f16", metavar="TYPE",
                   help="target V cache type (default f16; quantized types need -fa on or auto)")
    g.add_argument("-ctkd", "--cache-type-k-draft", choices=CACHE_TYPES, metavar="TYPE",
                   help="drafter K cache type (default: f16 with the drafter on a GPU; f32 on the CPU, where the "
                        "drafter's logits then agree with the float32 reference implementation to 3e-7)")
    g.add_argument("-ctvd", "--cache-type-v-draft", choices=CACHE_TYPES, metavar="TYPE",
                   help="drafter V cache type (default as -ctkd)")
    g.add_argument("--repack", nargs="?", const="target", choices=list(REPACK), metavar="target|draft|all",
                   help="put the weights of the target (the default), the drafter or both in ggml's repacked CPU "
                        "buffers: faster on some CPUs; the target's then rounds a verify batch differently from "
                        "plain decoding. Refused on CPUs with AMX, where ggml's AMX matmul crashes")


def from_args(args) -> Placement:
    repack, repack_draft = REPACK.get(args.repack, (False, False))
    return Placement(
        n_gpu_layers=args.n_gpu_layers,
        n_gpu_layers_draft=args.n_gpu_layers_draft,
        split_mode=args.split_mode,
        main_gpu=args.main_gpu,
        tensor_split=args.tensor_split or [],
        overrides=args.override_tensor or [],
        n_cpu_moe=args.n_cpu_moe,
        mmap=not args.no_mmap,
        mlock=args.mlock,
        repack=repack,
        repack_draft=repack_draft,
        n_threads=args.threads,
        n_threads_batch=args.threads_batch,
        n_batch=args.batch_size,
        n_ubatch=args.ubatch_size,
        flash_attn=args.flash_attn,
        cache_type_k=args.cache_type_k,
        cache_type_v=args.cache_type_v,
        cache_type_k_draft=args.cache_type_k_draft,
        cache_type_v_draft=args.cache_type_v_draft,
    )
