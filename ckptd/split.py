"""A job's parallel split, ``tp=..,dp=..[,pp=..]``: the one grammar, parsed once at each edge.

"Layout" means a run's directory shape (:mod:`ckptd.runlayout`); how a job divides its ranks is its
*split*. The operator types it as ``ckptd convert --to-layout``, ``ckptd launch --layout`` or the
API's ``to_layout`` / ``layout``; each edge parses the text here into a :class:`ParallelSplit` and
passes the typed value on. The conversion rule that derives a strategy from a split is
:func:`ckptd.convert.layouts.derive_strategy`; this module only knows the grammar and its bounds,
so the launcher and the CLI parse a split without importing the converter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckptd.errors import CkptdError

#: The largest world (tp x dp x pp) a split may have: the ranks one strategy stage may have
#: (``ckptd.format.layout.MAX_DEVICES``; ``ckptd.runnames.MAX_RANK`` is the same). Beyond it a
#: split is a typo, not a cluster.
MAX_WORLD_SIZE = 1 << 20
_ITEM = re.compile(r"\s*(tp|dp|pp)\s*=\s*([1-9][0-9]*)\s*")


class SplitError(CkptdError):
    code = "invalid_request"
    default_hint = "use e.g. tp=4,dp=2[,pp=2] (positive integers)"


@dataclass(frozen=True, slots=True)
class ParallelSplit:
    """tp x dp [x pp] ranks; ``pp`` None: not stated (the source's stage count is kept)."""

    tp: int
    dp: int
    pp: int | None = None

    @property
    def world(self) -> int:
        return self.tp * self.dp * (self.pp or 1)

    def __str__(self) -> str:
        return f"tp={self.tp},dp={self.dp}" + (f",pp={self.pp}" if self.pp is not None else "")


def parse_split(text: str, what: str = "--to-layout") -> ParallelSplit:
    """``"tp=4,dp=2[,pp=2]"`` -> ``ParallelSplit(4, 2, 2)``; tp and dp required, the world at most
    :data:`MAX_WORLD_SIZE`. ``what`` names the option or field in messages (``--layout``,
    ``to_layout``)."""
    hint = f"use e.g. {what} tp=4,dp=2[,pp=2] (positive integers)"
    out: dict[str, int] = {}
    for part in str(text).split(","):
        m = _ITEM.fullmatch(part)
        if m is None:
            raise SplitError(f"bad {what} item {part.strip()[:40]!r}", hint=hint)
        if m.group(1) in out:
            raise SplitError(f"{what} sets {m.group(1)} twice", hint=hint)
        if len(m.group(2)) > 7:  # int() of a thousand digits is slow and certainly beyond the bound
            raise SplitError(f"{what} {m.group(1)}={m.group(2)[:12]}...: more than {MAX_WORLD_SIZE} ranks", hint=hint)
        out[m.group(1)] = int(m.group(2))
    for key in ("tp", "dp"):
        if key not in out:
            raise SplitError(f"{what} needs {key}=N", hint=hint)
    split = ParallelSplit(out["tp"], out["dp"], out.get("pp"))
    if split.world > MAX_WORLD_SIZE:
        raise SplitError(f"{what} {str(text).strip()[:60]} is {split.world} ranks: more than {MAX_WORLD_SIZE} ranks",
                         hint="check the split for a typo; no strategy has more ranks")
    return split
