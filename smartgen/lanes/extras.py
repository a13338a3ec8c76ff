"""Optional lane backends: import their packages lazily, and say which extra installs a missing one."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingExtra", "require"]


class MissingExtra(ImportError):
    """A lane's package is not installed; the message names the extra that installs it."""


def require(module: str, extra: str, hint: str = "") -> ModuleType:
    """Imports `module`, or raises MissingExtra with a one-line install instruction."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra_hint = f" ({hint})" if hint else ""
        raise MissingExtra(
            f"the {extra} lane needs {module!r}: pip install 'smartgen[{extra}]'{extra_hint} [{exc}]"
        ) from exc
