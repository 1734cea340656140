"""Lazy package exports: ``name -> module`` resolved on first attribute access (PEP 562).

Packages whose public names live in heavier submodules (numpy, protobuf parsing, crypto) use this
so ``import ckptd.format`` or ``import ckptd.convert`` stays cheap until a name is actually used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[list[str], Callable[[str], Any]]:
    """``(__all__, __getattr__)`` for ``package``, resolving ``exports[name]`` (a module path) lazily.

    Usage in a package ``__init__``: ``__all__, __getattr__ = lazy_exports(__name__, {...})``.
    """
    table = dict(exports)

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return sorted(table), __getattr__
