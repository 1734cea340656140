"""MindSpore parallel strategy files (``strategy_ckpt_config`` save_file): read, write, query.

Two encodings carry the same content (reference doc, section F):

* protobuf ``mindspore.straspb.ParallelStrategyMap`` (any file name not ending ``.json``), parsed
  here with :mod:`ckptd.format.protowire` so that damage is reported with a byte offset and ckptd
  needs neither MindSpore nor its generated ``node_strategy_pb2``;
* JSON (``.json``) with the same items keyed by name.

We sniff the encoding from the content (a JSON file starts with ``{``, which is never a valid first
byte of a ``ParallelStrategyMap``), but *write* by MindSpore's rule (extension), since MindSpore
picks its parser by extension only.

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

from ckptd.errors import CkptdError, LayoutError, StrategyError
from ckptd.format import protowire as pw
from ckptd.format.atomic import atomic_write
from ckptd.format.layout import Slice, TensorLayout, replica_groups, slice_for_rank

StrategyFormat = Literal["proto", "json"]
MAX_STRATEGY_BYTES = 1 << 30  # far above any real strategy file; refuse to slurp anything bigger
_STAGE_PREFIX = re.compile(r"(0|[1-9][0-9]*)-([^-]+)")
_UINT32 = (1 << 32) - 1


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


# --- parsing ---------------------------------------------------------------------------------


def load_strategy(path: str | os.PathLike[str]) -> Strategy:
    """Read a strategy file, protobuf or JSON (decided by content, not by name)."""
    try:
        size = os.path.getsize(path)
        if size > MAX_STRATEGY_BYTES:
            raise StrategyError(f"{size} bytes is too large for a strategy file", path=path)
        with open(path, "rb") as fh:
            data = fh.read(MAX_STRATEGY_BYTES + 1)
    except OSError as err:
        raise StrategyError(f"cannot read strategy file: {err.strerror or err}", path=path) from None
    return parse_strategy_bytes(data, path=path)


def parse_strategy_bytes(data: bytes, path: str | os.PathLike[str] | None = None) -> Strategy:
    where = os.fspath(path) if path is not None else "<bytes>"
    if not data:
        raise StrategyError("the strategy file is empty", path=where)
    text_start = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
    if text_start.lstrip()[:1] in (b"{", b"["):  # wire types 3 (group): never a valid first protobuf key
        from ckptd.format.strategy_json import parse_json

        return parse_json(text_start, where)
    return _parse_proto(data, where)


def _split_name(raw: str, merged: bool, where: str, stage: int) -> tuple[int, str]:
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


def _assemble(raw_params, ops, current_stage, fmt, where) -> Strategy:
    """raw_params: [(raw_name, layout, tensor_shape, offset)] -> Strategy (stages resolved)."""
    merged = any("-" in name for name, *_ in raw_params)
    stage = ops[0].stage if ops else 0
    entries = []
    for name, layout, shape, _ in raw_params:
        st, base = _split_name(name, merged, where, stage)
        entries.append(ParamStrategy(base, layout, st, shape))
    return Strategy.build(entries, op_items=ops, current_stage=current_stage, format=fmt, source_path=where, merged=merged)


def _layout(where: str, name: str, offset: int | None, **kw) -> TensorLayout:
    try:
        return TensorLayout(**kw)
    except LayoutError as err:
        raise StrategyError(f"parameter {name!r}: {err.message}", path=where, offset=offset, hint=err.hint) from None


# protobuf -------------------------------------------------------------------------------------


class _Proto:
    """Walks one ParallelStrategyMap buffer; every access is bounds-checked by protowire."""

    def __init__(self, data: bytes, where: str) -> None:
        self.buf = memoryview(data)
        self.where = where

    def fail(self, message: str, offset: int) -> StrategyError:
        return StrategyError(message, path=self.where, offset=offset, hint="the protobuf does not match "
                             "mindspore.straspb.ParallelStrategyMap: not a strategy file, or damaged")

    def fields(self, fld: pw.Field | None = None):
        start, end = (0, len(self.buf)) if fld is None else (fld.value, fld.value + fld.length)
        return pw.iter_fields(self.buf, start, end)

    def want(self, fld: pw.Field, wire: int, what: str) -> pw.Field:
        if fld.wire_type != wire:
            raise self.fail(f"{what} (field {fld.number}) has wire type {fld.wire_type}, expected {wire}", fld.offset)
        return fld

    def string(self, fld: pw.Field, what: str) -> str:
        self.want(fld, pw.LEN, what)
        try:
            return bytes(self.buf[fld.value : fld.value + fld.length]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8", fld.offset) from None

    def ints(self, fld: pw.Field, kind: str, what: str) -> tuple[int, ...]:
        """A ``{repeated <kind> dim = 1}`` message (DevMatrix, TensorMap, ...)."""
        self.want(fld, pw.LEN, what)
        out: list[int] = []
        for sub in self.fields(fld):
            if sub.number != 1:
                continue
            if sub.wire_type not in (pw.VARINT, pw.LEN):
                raise self.fail(f"{what}.dim has wire type {sub.wire_type}", sub.offset)
            for v in pw.iter_repeated_varint(self.buf, sub):
                out.append(self.scalar(v, kind, f"{what}.dim", sub.offset))
        return tuple(out)

    def scalar(self, v: int, kind: str, what: str, offset: int) -> int:
        if kind == "uint32":
            if v > _UINT32:
                raise self.fail(f"{what} = {v} does not fit uint32", offset)
            return v
        v = pw.to_signed64(v)
        if kind == "int32" and not -(1 << 31) <= v < 1 << 31:
            raise self.fail(f"{what} = {v} does not fit int32", offset)
        return v

    def varint(self, fld: pw.Field, kind: str, what: str) -> int:
        return self.scalar(self.want(fld, pw.VARINT, what).value, kind, what, fld.offset)

    def op_item(self, item: pw.Field) -> OpItem:
        self.want(item, pw.LEN, "parallel_strategy_item")
        name, body = None, None
        for f in self.fields(item):
            if f.number == 1:
                name = self.string(f, "node_name")
            elif f.number == 2:
                body = self.want(f, pw.LEN, "parallel_strategys")
        if name is None or body is None:
            raise self.fail("parallel_strategy_item lacks node_name or parallel_strategys", item.offset)
        stage, strategies = 0, []
        for f in self.fields(body):
            if f.number == 1:
                stage = self.varint(f, "uint32", "stage")
            elif f.number == 2:
                strategies.append(self.ints(f, "uint32", "parallel_strategy"))
        return OpItem(name, stage, tuple(strategies))

    def layout_item(self, item: pw.Field):
        self.want(item, pw.LEN, "parallel_layout_item")
        name, body = None, None
        for f in self.fields(item):
            if f.number == 1:
                name = self.string(f, "param_name")
            elif f.number == 2:
                if body is not None:
                    raise self.fail("parallel_layouts appears twice in one item", f.offset)
                body = self.want(f, pw.LEN, "parallel_layouts")
        if name is None or body is None:
            raise self.fail("parallel_layout_item lacks param_name or parallel_layouts", item.offset)
        dev, maps, pss, ios = [], [], [], []
        scal = {"field": 0, "opt_shard_step": 0, "opt_shard_size": 0}
        for f in self.fields(body):
            if f.number == 1:
                dev.append(self.ints(f, "uint32", "dev_matrix"))
            elif f.number == 2:
                maps.append(self.ints(f, "int32", "tensor_map"))
            elif f.number == 3:
                pss.append(self.ints(f, "int64", "param_split_shape"))
            elif f.number == 4:
                ios.append(self.ints(f, "int64", "indices_offset"))
            elif 5 <= f.number <= 7:
                key = ("field", "opt_shard_step", "opt_shard_size")[f.number - 5]
                scal[key] = self.varint(f, "int32", key)
        if not dev or not maps:
            raise self.fail(f"parameter {name!r} has no dev_matrix or no tensor_map", item.offset)
        # MindSpore (_convert_to_list): several TensorMap entries = one per tensor dim ("layout"
        # API, nested); empty ones are padding. A single entry is the flat map.
        tensor_map = [m for m in maps if m] if len(maps) > 1 else list(maps[0])
        layout = _layout(self.where, name, item.offset, dev_matrix=dev[0], tensor_map=tensor_map,
                         param_split_shape=pss[0] if pss else (), indices_offset=ios[0] if ios else (), **scal)
        return name, layout, None, item.offset


def _parse_proto(data: bytes, where: str) -> Strategy:
    p = _Proto(data, where)
    current_stage, ops, raw = None, [], []
    try:
        for f in p.fields():
            if f.number == 1:
                current_stage = p.varint(f, "uint32", "current_stage")
            elif f.number == 2:
                ops.append(p.op_item(f))
            elif f.number == 3:
                raw.append(p.layout_item(f))
    except StrategyError:
        raise
    except CkptdError as err:  # protowire's Truncated/CorruptError: keep its offset
        raise StrategyError(f"not a valid strategy protobuf: {err.message}", path=where, offset=err.offset,
                            hint="the file is damaged or truncated, or it is not a MindSpore strategy file") from None
    if current_stage is None and not ops and not raw:
        raise StrategyError("no ParallelStrategyMap fields found", path=where,
                            hint="this is not a MindSpore strategy file (protobuf or JSON)")
    return _assemble(raw, ops, current_stage or 0, "proto", where)


# --- writing ---------------------------------------------------------------------------------


def _disk_name(strategy: Strategy, e: ParamStrategy) -> str:
    return f"{e.stage}-{e.name}" if strategy.merged else e.name


def _ints_msg(number: int, values) -> bytes:
    return pw.len_field(number, pw.packed_or_repeated_varints(1, list(values)))


def _to_proto(s: Strategy) -> bytes:
    out = [pw.varint_field(1, s.current_stage)]
    for op in s.op_items:
        body = pw.varint_field(1, op.stage) + b"".join(_ints_msg(2, dims) for dims in op.strategies)
        out.append(pw.len_field(2, pw.len_field(1, op.node_name.encode()) + pw.len_field(2, body)))
    for e in s.entries:
        lay = e.layout
        if lay.nested:  # one TensorMap per dim; a lone dim gets an empty pad so len(tensor_map) > 1
            maps = [_ints_msg(2, m if isinstance(m, tuple) else (m,)) for m in lay.tensor_map]
            maps += [pw.len_field(2, b"")] if len(maps) == 1 else []
        else:
            maps = [_ints_msg(2, lay.tensor_map)]
        body = b"".join([
            _ints_msg(1, lay.dev_matrix), *maps, _ints_msg(3, lay.param_split_shape), _ints_msg(4, lay.indices_offset),
            pw.varint_field(5, lay.field), pw.varint_field(6, lay.opt_shard_step), pw.varint_field(7, lay.opt_shard_size),
        ])
        out.append(pw.len_field(3, pw.len_field(1, _disk_name(s, e).encode()) + pw.len_field(2, body)))
    return b"".join(out)


def save_strategy(
    strategy: Strategy,
    path: str | os.PathLike[str],
    format: StrategyFormat | None = None,
    *,
    full_shapes: Mapping[str, tuple[int, ...]] | None = None,
    overwrite: bool = False,
) -> None:
    """Write ``strategy`` atomically in the form MindSpore's own writer produces.

    ``format`` defaults to the extension's (``.json`` -> JSON, else protobuf); a format that
    contradicts the extension is refused because MindSpore chooses its parser by extension.
    Protobuf output always sets ``field``/``opt_weight_shard_*`` and one ``param_split_shape``
    and ``indices_offset`` entry, like MindSpore's C++ writer, so its files round-trip byte-exact.
    JSON ``tensor_shape`` comes from ``full_shapes`` or the parsed file; it is omitted when unknown
    (MindSpore's Python tools ignore it). Operator items with a repeated node name collapse in JSON.
    """
    is_json = os.fspath(path).endswith(".json")
    fmt = format or ("json" if is_json else "proto")
    if fmt not in ("proto", "json"):
        raise StrategyError(f"unknown strategy format {fmt!r}", path=path, hint="use 'proto' or 'json'")
    if (fmt == "json") != is_json:
        raise StrategyError(
            f"format {fmt!r} does not match the file name",
            path=path, hint="MindSpore parses '*.json' as JSON and every other name as protobuf; rename the file",
        )
    if fmt == "json":
        from ckptd.format.strategy_json import to_json

        data = to_json(strategy, full_shapes)
    else:
        data = _to_proto(strategy)
    with atomic_write(path, overwrite=overwrite) as fh:
        fh.write(data)
