"""Where a drafter checkpoint lives: a local directory, or a Hugging Face Hub repository id fetched into the cache.

huggingface_hub honours HF_HUB_OFFLINE, HF_HUB_CACHE and HF_TOKEN, so an offline machine with a filled cache works
(and that is how the tests check it).
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import ConvertError

# only what the converter reads: no README weights, no pytorch_model.bin
ALLOW_PATTERNS = ["config.json", "*.safetensors", "*.safetensors.index.json"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_source(source: str, revision: str | None = None, allow_patterns=ALLOW_PATTERNS) -> Path:
    """A local checkpoint directory as it is; anything shaped like 'org/name' that is not a directory from the Hub
    (only the files matching allow_patterns)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ConvertError(f"{source}: expected a drafter directory (config.json + safetensors), got a file")
    if not _REPO_ID.match(source):
        raise ConvertError(f"{source}: no such directory, and not a Hugging Face repository id (org/name)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise ConvertError(
            f"{source}: no such directory; to download it from the Hugging Face Hub install huggingface_hub "
            f"(pip install huggingface_hub)"
        ) from None
    try:
        return Path(snapshot_download(source, revision=revision, allow_patterns=allow_patterns))
    except RepositoryNotFoundError:
        raise ConvertError(
            f"{source}: no such repository on the Hugging Face Hub (or it is private: set HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError:
        raise ConvertError(
            f"{source}: not in the local Hugging Face cache and downloads are off (HF_HUB_OFFLINE) or the Hub is "
            f"unreachable"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise ConvertError(f"{source}: download from the Hugging Face Hub failed: {e}") from None
