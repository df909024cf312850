"""Optional dependencies (the extras in pyproject.toml): imported only by the commands that use them, and when one is
missing the command stops with one line naming the extra that installs it, not a traceback."""

from __future__ import annotations

import contextlib


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message says how to install it."""


def install_hint(extra: str) -> str:
    return f'pip install "dflash-local[{extra}]"'


@contextlib.contextmanager
def needs_extra(extra: str, what: str):
    """Wrap the imports of an optional dependency: a missing module becomes a MissingExtraError naming `extra`."""
    try:
        yield
    except ModuleNotFoundError as e:
        raise MissingExtraError(f"{what} needs {e.name}, which is not installed: {install_hint(extra)}") from None
