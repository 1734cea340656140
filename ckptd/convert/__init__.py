"""Re-sharding of MindSpore checkpoints between parallel layouts (``ckptd convert``).

Public surface: :func:`plan_conversion` / :func:`plan_from_dir` (pure planning, no data read),
:func:`convert` (streaming, verified, atomic execution) returning a :class:`ConvertReport`,
:func:`derive_strategy` (``--to-layout``), and :class:`ConvertError`. Names resolve lazily so that
importing the package stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ConvertError": "ckptd.convert.plan",
    "ConversionPlan": "ckptd.convert.plan",
    "SourceShard": "ckptd.convert.plan",
    "ShardEntry": "ckptd.convert.plan",
    "plan_conversion": "ckptd.convert.plan",
    "ConvertReport": "ckptd.convert.execute",
    "convert": "ckptd.convert.execute",
    "plan_from_dir": "ckptd.convert.execute",
    "find_source_files": "ckptd.convert.execute",
    "derive_strategy": "ckptd.convert.layouts",
    "parse_layout_spec": "ckptd.convert.layouts",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ckptd.convert' has no attribute {name!r}")
