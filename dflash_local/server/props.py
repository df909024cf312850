"""What the server says about itself, in llama-server's shapes: the model card of /v1/models (with `meta`) and /props.

Clients see file names, never the server's absolute paths.
"""

from __future__ import annotations

import math
from importlib.metadata import version
from pathlib import Path

from .schema import GenerationRequest
from ..engine.engine import Engine


def n_params(engine: Engine) -> int:
    # what llama_model_n_params counts: the elements of every tensor in the file
    return sum(math.prod(t.shape) for t in engine.target_info.tensors.values())


def model_meta(engine: Engine) -> dict:
    """llama-server's `meta` fields, then what engine.model_info() tells about the pair (paths cut to file names)."""
    info = engine.model_info()
    for part in (info["target"], info["drafter"]):
        if part:
            part["file"] = Path(part.pop("path")).name
    t = engine.target
    return {"n_vocab": t.n_vocab, "n_ctx": engine.n_ctx, "n_ctx_train": t.n_ctx_train, "n_embd": t.n_embd,
            "n_params": n_params(engine), "size": t.size, "ftype": info["target"]["quant"], **info}


def model_card(alias: str, created: int, engine: Engine | None) -> dict:
    """One entry of /v1/models; `meta` is null while the model loads, as in llama-server."""
    return {"id": alias, "object": "model", "created": created, "owned_by": "dflash-local",
            "meta": model_meta(engine) if engine is not None else None}


def _token_text(engine: Engine, token: int) -> str:
    return engine.target.piece(token, True).decode(errors="replace") if token >= 0 else ""


def props(engine: Engine, alias: str, n_predict: int) -> dict:
    """GET /props: the generation defaults of a request that sets nothing, the model, its template, the drafting."""
    defaults = {name: GenerationRequest.model_fields[name].default
                for name in ("temperature", "top_k", "top_p", "min_p", "seed")}
    params = {"n_predict": n_predict, "max_tokens": n_predict, **defaults, "stop": [], "stream": False,
              "speculative.types": ",".join(engine.spec_types) or "none",
              "speculative.n_max": engine.n_max}
    info = model_meta(engine)
    return {
        "default_generation_settings": {"n_ctx": engine.n_ctx, "params": params},
        "total_slots": len(engine.slots),  # generations at a time (-np); the others queue
        "model_alias": alias,
        "model_path": info["target"]["file"],
        "model_ftype": info["ftype"],
        "modalities": {"vision": False, "audio": False, "video": False},
        "endpoint_slots": True,
        "endpoint_props": False,
        "endpoint_metrics": True,
        "chat_template": engine.chat_template or "",
        "chat_template_kwargs": engine.chat_template_kwargs,
        "bos_token": _token_text(engine, engine.target.bos),
        "eos_token": _token_text(engine, engine.target.eos),
        "build_info": f"dflash-local {version('dflash-local')} (llama-cpp-python {version('llama-cpp-python')})",
        "is_sleeping": False,
        "speculative": {
            "drafter": info["drafter"]["file"] if info["drafter"] else None,
            "draft_backend": info.get("draft_backend"),
            "block_size": engine.block_size,
            "draft_policy": engine.draft_policy,
            "ngram": {"size_n": engine.ngram.size_n, "size_m": engine.ngram.size_m} if engine.ngram else None,
            "bit_exact_verify": engine.bit_exact,
        },
    }


def slots(engine: Engine, tasks) -> list[dict]:
    """GET /slots in llama-server's shape, a row per slot: its context, whether it drafts, and its running task's
    progress (or its last task's, once done)."""
    rows = []
    for i, task in enumerate(tasks):
        out = {"id": i, "n_ctx": engine.n_ctx, "speculative": bool(engine.spec_types),
               "is_processing": task is not None and task.processing}
        if task is not None:
            out |= {"id_task": task.id_task, "n_prompt_tokens": task.n_prompt, "n_prompt_tokens_cache": task.n_cached,
                    "n_prompt_tokens_processed": task.n_prompt_done,
                    "next_token": [{"has_next_token": task.processing, "n_remain": task.max_tokens - task.n_decoded,
                                    "n_decoded": task.n_decoded}]}
        rows.append(out)
    return rows
