"""Re-sharding of MindSpore checkpoints between parallel layouts (``ckptd convert``).

Public surface: :func:`plan_conversion` / :func:`plan_from_dir` (pure planning, no data read),
:func:`convert` (streaming, verified, atomic execution) returning a :class:`ConvertReport`,
:func:`derive_strategy` (``--to-layout``), :func:`resolve_strategy` (a strategy file or a directory
of per-rank files), and :class:`ConvertError`. Names resolve lazily so that
importing the package stays cheap.

Modules: ``plan`` (which source bytes land where) over ``plan_types`` (the plan's dataclasses,
rendering, memory estimate) and ``consistency`` (do the files match the source strategy?);
``execute`` (per-rank pipeline, atomic output) over ``sources`` (finding and reading inputs),
``assemble`` (bands), ``writers`` (record bytes) and ``verify``.
"""

from __future__ import annotations

from ckptd._lazy import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "ConvertError": "ckptd.convert.plan",
    "ConversionPlan": "ckptd.convert.plan",
    "SourceShard": "ckptd.convert.plan",
    "ShardEntry": "ckptd.convert.plan",
    "plan_conversion": "ckptd.convert.plan",
    "ConvertReport": "ckptd.convert.execute",
    "convert": "ckptd.convert.execute",
    "plan_from_dir": "ckptd.convert.execute",
    "find_source_files": "ckptd.convert.execute",
    "resolve_strategy": "ckptd.convert.sources",
    "derive_strategy": "ckptd.convert.layouts",
})
