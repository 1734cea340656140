"""MindSpore's on-disk formats, read and written byte-compatibly (see docs/FORMATS.md).

Public surface: ``open_checkpoint``, ``write_checkpoint``, ``verify_file``, ``TensorEntry``,
``TypedArray``, ``EncMode``, ``load_strategy``, and the limits on what a file may make ckptd build
(``FormatLimits``, ``StrategyLimits``, ``LimitExceededError``). Everything else in this package is an
implementation detail. Names resolve lazily so importing one submodule stays cheap.
"""

from __future__ import annotations

from ckptd._lazy import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "CheckpointFile": "ckptd.format.checkpoint",
    "open_checkpoint": "ckptd.format.checkpoint",
    "write_checkpoint": "ckptd.format.checkpoint",
    "TypedArray": "ckptd.format.ckpt_write",
    "EncMode": "ckptd.format.crypto",
    "TensorEntry": "ckptd.format.entry",
    "FileReport": "ckptd.format.verify",
    "verify_file": "ckptd.format.verify",
    "load_strategy": "ckptd.format.strategy",
    "FormatLimits": "ckptd.format.limits",
    "StrategyLimits": "ckptd.format.limits",
    "LimitExceededError": "ckptd.format.limits",
})
