"""The parsed form of a strategy file and the builders both encodings share.

:mod:`ckptd.format.strategy` (protobuf, load/save) and :mod:`ckptd.format.strategy_json` both turn
raw items into a :class:`Strategy` through :func:`assemble_strategy`, :func:`checked_layout` and
:meth:`Strategy.disk_name`. They live here, below both readers, so that neither imports the other's
internals (the JSON reader used to import private helpers of ``strategy.py`` while ``strategy.py``
imported it back lazily -- a cycle).

Pipeline stages. A stage saves its own file whose operator items carry the stage; MindSpore's
``merge_pipeline_strategys`` joins them and prefixes every parameter with ``"<stage>-"``. So the
stage of a parameter is the prefix in merged files and, in a single-stage file, the stage of the
first operator item (0 when there is none) -- exactly what ``merge_pipeline_strategys`` and
``_extract_src_dst_layout_map_by_src`` use. A parameter shared between stages (e.g. a tied
embedding) appears once per stage: :attr:`Strategy.entries` keeps them all, :attr:`Strategy.params`
maps a name to its lowest-stage entry (as ``_convert_to_list`` does).

Devices. ``stage_device_num`` is ``prod(dev_matrix)``, which MindSpore makes equal for every
parameter (repeated calculation becomes a device-matrix axis); all layouts must agree, otherwise
global ranks (``stage * stage_device_num + local_rank``) would be ambiguous -> StrategyError.
``current_stage`` is the raw protobuf field, a save counter (merged files: 1), not a pipeline stage.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
import re
import types
from dataclasses import dataclass, field
from typing import Literal, Mapping

from ckptd.errors import LayoutError, StrategyError
from ckptd.format.layout import Slice, TensorLayout, replica_groups, slice_for_rank
from ckptd.format.limits import MAX_STRATEGY_BYTES

StrategyFormat = Literal["proto", "json"]
__all__ = ["MAX_STRATEGY_BYTES", "OpItem", "ParamStrategy", "Strategy", "StrategyFormat", "assemble_strategy",
           "checked_layout", "split_stage_name"]
_STAGE_PREFIX = re.compile(r"(0|[1-9][0-9]*)-([^-]+)")


@dataclass(frozen=True)
class ParamStrategy:
    """Layout of one parameter in one pipeline stage. ``tensor_shape`` only comes from JSON files."""

    name: str
    layout: TensorLayout
    stage: int = 0
    tensor_shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class OpItem:
    """An operator's sharding strategy (``ParallelStrategyItem``): kept only to round-trip files."""

    node_name: str
    stage: int
    strategies: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Strategy:
    """A parsed strategy file. Construct with :meth:`build` (it derives ``stage_device_num``)."""

    entries: tuple[ParamStrategy, ...]
    stage_device_num: int
    current_stage: int = 1
    format: StrategyFormat = "proto"
    source_path: str | None = None
    op_items: tuple[OpItem, ...] = ()
    merged: bool = False  # parameter names carry "<stage>-" prefixes on disk
    params: Mapping[str, ParamStrategy] = field(init=False, repr=False, compare=False)
    stages: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        seen: set[tuple[int, str]] = set()
        params: dict[str, ParamStrategy] = {}
        for e in self.entries:
            if (e.stage, e.name) in seen:
                raise self._error(f"parameter {e.name!r} appears twice in stage {e.stage}")
            seen.add((e.stage, e.name))
            if e.layout.device_num != self.stage_device_num:
                raise self._error(
                    f"parameter {e.name!r} has dev_matrix {list(e.layout.dev_matrix)} "
                    f"({e.layout.device_num} devices) but other layouts cover {self.stage_device_num}",
                    hint="every layout of a strategy file must span the same number of devices per stage",
                )
            if e.name not in params or e.stage < params[e.name].stage:
                params[e.name] = e
        stage_set = {e.stage for e in self.entries}
        if self.merged:
            missing = sorted(set(range(max(stage_set, default=0) + 1)) - stage_set)
            if missing:
                raise self._error(
                    f"merged strategy lacks pipeline stage(s) {missing}",
                    hint="merge_pipeline_strategys needs the files of all stages in its source directory",
                )
        else:
            stage = self.op_items[0].stage if self.op_items else 0
            if stage_set - {stage}:
                raise self._error(
                    f"an unmerged strategy holds one stage (its first operator item says {stage}), "
                    f"got stages {sorted(stage_set)}",
                    hint="set merged=True to store several stages with '<stage>-' name prefixes",
                )
        object.__setattr__(self, "params", types.MappingProxyType(params))
        object.__setattr__(self, "stages", max(stage_set, default=0) + 1)

    @classmethod
    def build(
        cls,
        entries: list[ParamStrategy] | tuple[ParamStrategy, ...],
        *,
        op_items: tuple[OpItem, ...] | list[OpItem] = (),
        current_stage: int = 1,
        format: StrategyFormat = "proto",
        source_path: str | os.PathLike[str] | None = None,
        merged: bool = False,
    ) -> "Strategy":
        path = os.fspath(source_path) if source_path is not None else None
        counts = {e.layout.device_num for e in entries}
        if len(counts) > 1:
            raise StrategyError(
                f"layouts disagree on the devices per stage: {sorted(counts)}",
                path=path,
                hint="every dev_matrix of a strategy file must have the same product (devices per stage)",
            )
        return cls(tuple(entries), counts.pop() if counts else 1, current_stage, format, path, tuple(op_items), merged)

    def disk_name(self, e: ParamStrategy) -> str:
        """The name ``e`` has on disk: merged files prefix it with its stage (``"<stage>-<name>"``)."""
        return f"{e.stage}-{e.name}" if self.merged else e.name

    def _error(self, message: str, hint: str | None = None) -> StrategyError:
        return StrategyError(message, path=self.source_path, hint=hint)

    # --- ranks -----------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Ranks of the whole job (for an unmerged stage-s file: a lower bound, ``(s+1)*devices``)."""
        return self.stages * self.stage_device_num

    def global_rank(self, stage: int, local_rank: int) -> int:
        if not 0 <= stage < self.stages or not 0 <= local_rank < self.stage_device_num:
            raise self._error(f"(stage {stage}, local rank {local_rank}) outside {self.stages} x {self.stage_device_num}")
        return stage * self.stage_device_num + local_rank

    def stage_and_local(self, global_rank: int) -> tuple[int, int]:
        if not isinstance(global_rank, numbers.Integral) or not 0 <= global_rank < self.world_size:
            raise self._error(f"global rank {global_rank!r} outside 0..{self.world_size - 1}")
        return divmod(int(global_rank), self.stage_device_num)

    def param(self, name: str, stage: int | None = None) -> ParamStrategy:
        for e in self.entries if stage is not None else ():
            if e.name == name and e.stage == stage:
                return e
        if stage is None and name in self.params:
            return self.params[name]
        where = f" in stage {stage}" if stage is not None else ""
        raise self._error(f"no parameter {name!r}{where} in the strategy", hint="check the parameter name")

    # --- slices ----------------------------------------------------------------------------

    def _slice(self, e: ParamStrategy, shape: tuple[int, ...], local: int) -> Slice:
        try:
            return slice_for_rank(e.layout, shape, local)
        except LayoutError as err:
            raise LayoutError(f"parameter {e.name!r}: {err.message}", path=self.source_path, hint=err.hint) from None

    def slices_for_rank(
        self,
        global_rank: int,
        full_shapes: Mapping[str, tuple[int, ...]],
        *,
        missing: Literal["error", "skip"] = "error",
    ) -> dict[str, Slice]:
        """Every parameter ``global_rank`` stores (those of its pipeline stage), in file order."""
        stage, local = self.stage_and_local(global_rank)
        out: dict[str, Slice] = {}
        for e in self.entries:
            if e.stage != stage:
                continue
            if e.name not in full_shapes:
                if missing == "skip":
                    continue
                raise LayoutError(f"no full shape given for parameter {e.name!r}", path=self.source_path)
            out[e.name] = self._slice(e, tuple(full_shapes[e.name]), local)
        return out

    def replicas(self, name: str, full_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Global ranks grouped by identical slice of ``name`` (across all stages holding it).

        Memoized per instance (the strategy is immutable): the daemon asks this for every
        sampled parameter of every step, and the slice math over hundreds of ranks is not free."""
        key = (name, tuple(full_shape))
        memo = self.__dict__.setdefault("_replicas_memo", {})  # frozen: no attribute assignment
        if key not in memo:
            memo[key] = tuple(self._replicas(name, key[1]))
        return list(memo[key])

    def _replicas(self, name: str, full_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        groups: dict[Slice, list[int]] = {}
        holders = [e for e in self.entries if e.name == name]
        if not holders:
            raise self._error(f"no parameter {name!r} in the strategy", hint="check the parameter name")
        for e in holders:
            try:
                local_groups = replica_groups(e.layout, tuple(full_shape))
            except LayoutError as err:
                raise LayoutError(f"parameter {name!r}: {err.message}", path=self.source_path, hint=err.hint) from None
            for group in local_groups:
                key = self._slice(e, tuple(full_shape), group[0])
                groups.setdefault(key, []).extend(self.global_rank(e.stage, r) for r in group)
        return sorted((tuple(sorted(g)) for g in groups.values()), key=lambda g: g[0])

    def content_hash(self) -> str:
        """sha256 of what decides data placement: devices per stage and each (stage, name, layout).

        Independent of encoding, file order, operator items, the save counter and JSON's
        informational ``tensor_shape``, so the proto and JSON forms of one strategy hash equal.
        """
        body = {
            "stage_device_num": self.stage_device_num,
            "params": [[e.stage, e.name, e.layout.canonical()] for e in sorted(self.entries, key=lambda e: (e.stage, e.name))],
        }
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


# --- builders shared by the protobuf and JSON readers ----------------------------------------


def split_stage_name(raw: str, merged: bool, where: str, stage: int) -> tuple[int, str]:
    """``(stage, name)`` of an on-disk parameter name; unmerged files give every name ``stage``."""
    if not raw:
        raise StrategyError("empty parameter name", path=where)
    if not merged:
        return stage, raw
    m = _STAGE_PREFIX.fullmatch(raw)
    if m is None:
        raise StrategyError(
            f"parameter name {raw!r} is not of the form '<stage>-<name>'",
            path=where,
            hint="MindSpore reserves '-' for the pipeline-stage prefix of merged strategy files; "
            "parameter names must not contain '-' otherwise",
        )
    return int(m.group(1)), m.group(2)


def assemble_strategy(raw_params, ops, current_stage: int, fmt: StrategyFormat, where: str) -> Strategy:
    """raw_params: [(raw_name, layout, tensor_shape, offset)] -> Strategy (stages resolved).

    A file is merged iff any name holds a '-' (MindSpore's own test, ``"-" in param_name``); then
    every name must carry a stage prefix, which :func:`split_stage_name` enforces."""
    merged = any("-" in name for name, *_ in raw_params)
    stage = ops[0].stage if ops else 0
    entries = []
    for name, layout, shape, _ in raw_params:
        st, base = split_stage_name(name, merged, where, stage)
        entries.append(ParamStrategy(base, layout, st, shape))
    return Strategy.build(entries, op_items=ops, current_stage=current_stage, format=fmt, source_path=where,
                          merged=merged)


def checked_layout(where: str, name: str, offset: int | None, **kw) -> TensorLayout:
    """A :class:`TensorLayout` whose LayoutError is re-raised as the file's StrategyError."""
    try:
        return TensorLayout(**kw)
    except LayoutError as err:
        raise StrategyError(f"parameter {name!r}: {err.message}", path=where, offset=offset, hint=err.hint) from None
