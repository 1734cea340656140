"""MindSpore parallel strategy files (``strategy_ckpt_config`` save_file): read, write, query.

Two encodings carry the same content (reference doc, section F):

* protobuf ``mindspore.straspb.ParallelStrategyMap`` (any file name not ending ``.json``), parsed
  here with :mod:`ckptd.format.protowire` so that damage is reported with a byte offset and ckptd
  needs neither MindSpore nor its generated ``node_strategy_pb2``;
* JSON (``.json``) with the same items keyed by name.

We sniff the encoding from the content (a JSON file starts with ``{``, which is never a valid first
byte of a ``ParallelStrategyMap``), but *write* by MindSpore's rule (extension), since MindSpore
picks its parser by extension only.

The parsed form (:class:`Strategy` and friends, pipeline stages, devices per stage) lives in
:mod:`ckptd.format.strategy_types`; it is re-exported here, the public front door, so callers
import everything strategy-related from this module. Module order (no cycles):
``strategy_types`` <- ``strategy_json`` <- ``strategy`` <- ``strategy_merge`` (per-rank files).
"""

from __future__ import annotations

import os
import stat
from typing import Mapping

from ckptd.errors import CkptdError, StrategyError
from ckptd.format import protowire as pw
from ckptd.atomic import atomic_write
from ckptd.format.limits import DEFAULT_STRATEGY_LIMITS, StrategyLimitError, StrategyLimits
from ckptd.format.strategy_json import parse_json, to_json
from ckptd.format.strategy_types import (
    MAX_STRATEGY_BYTES,
    OpItem,
    ParamStrategy,
    Strategy,
    StrategyFormat,
    assemble_strategy,
    checked_layout,
)

__all__ = [
    "MAX_STRATEGY_BYTES", "OpItem", "ParamStrategy", "Strategy", "StrategyFormat", "StrategyLimits",
    "encode_strategy", "load_strategy", "parse_strategy_bytes", "save_strategy",
]

_UINT32 = (1 << 32) - 1


# --- parsing ---------------------------------------------------------------------------------


def load_strategy(path: str | os.PathLike[str], *, limits: StrategyLimits = DEFAULT_STRATEGY_LIMITS) -> Strategy:
    """Read a strategy file, protobuf or JSON (decided by content, not by name).

    ``limits`` (:mod:`ckptd.format.limits`) bounds the file's size and what parsing may build;
    beyond them a :class:`~ckptd.format.limits.StrategyLimitError` (a StrategyError) says which."""
    try:
        # non-blocking, and refused unless regular: a FIFO named as a strategy file must not hang
        # the reader (a job thread, a CLI) in open() or read()
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with open(fd, "rb") as fh:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StrategyError("not a regular file: a strategy file is one the job saved", path=path)
            if st.st_size > limits.max_bytes:
                raise _too_large(st.st_size, limits.max_bytes, path)
            data = fh.read(limits.max_bytes + 1)
    except OSError as err:
        raise StrategyError(f"cannot read strategy file: {err.strerror or err}", path=path) from None
    return parse_strategy_bytes(data, path=path, limits=limits)


def _too_large(size: int, limit: int, path: str | os.PathLike[str] | None) -> StrategyLimitError:
    return StrategyLimitError(f"{size} bytes is too large for a strategy file (ckptd's limit is {limit} bytes)",
                              path=path)


def parse_strategy_bytes(
    data: bytes, path: str | os.PathLike[str] | None = None, *, limits: StrategyLimits = DEFAULT_STRATEGY_LIMITS
) -> Strategy:
    """Parse the bytes of a strategy file (``path`` only names it in errors); see :func:`load_strategy`."""
    where = os.fspath(path) if path is not None else "<bytes>"
    if not data:
        raise StrategyError("the strategy file is empty", path=where)
    if len(data) > limits.max_bytes:
        raise _too_large(len(data), limits.max_bytes, where)
    text_start = data[3:] if data.startswith(b"\xef\xbb\xbf") else data
    if text_start.lstrip()[:1] in (b"{", b"["):  # wire types 3 (group): never a valid first protobuf key
        return parse_json(text_start, where, limits)
    return _parse_proto(data, where, limits)


# protobuf -------------------------------------------------------------------------------------


class _Proto:
    """Walks one ParallelStrategyMap buffer; every access is bounds-checked by protowire."""

    def __init__(self, data: bytes, where: str, limits: StrategyLimits) -> None:
        self.buf = memoryview(data)
        self.where = where
        self.limits = limits
        self.items = self.values = self.unknown = 0

    # --- what the file may make us build (ckptd.format.limits) ---------------------------------

    def item(self, fld: pw.Field) -> None:
        self.items += 1
        if self.items > self.limits.max_items:
            raise StrategyLimitError(f"more than {self.limits.max_items} operator and parameter items "
                                     "(ckptd's limit per strategy file)", path=self.where, offset=fld.offset)

    def value(self, offset: int) -> None:
        self.values += 1
        if self.values > self.limits.max_values:
            raise StrategyLimitError(f"more than {self.limits.max_values} integers and integer lists "
                                     "(ckptd's limit per strategy file)", path=self.where, offset=offset)

    def skip(self, fld: pw.Field, what: str) -> None:
        """An unknown field (not in mindspore.straspb): tolerated as protobuf does, up to a budget."""
        if fld.wire_type == pw.LEN:
            span = fld.value + fld.length - fld.offset
        else:
            span = len(pw.key(fld.number, fld.wire_type)) + {pw.I64: 8, pw.I32: 4}.get(
                fld.wire_type, len(pw.encode_varint(fld.value)))
        self.unknown += span
        if self.unknown > self.limits.max_unknown_bytes:
            raise StrategyLimitError(
                f"more than {self.limits.max_unknown_bytes} bytes of protobuf fields mindspore.straspb does not "
                f"define (here: field {fld.number} of {what})", path=self.where, offset=fld.offset,
                hint="MindSpore writes no such fields: the file was padded or damaged; re-save it with MindSpore")

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
        self.value(fld.offset)
        out: list[int] = []
        for sub in self.fields(fld):
            if sub.number != 1:
                self.skip(sub, what)
                continue
            if sub.wire_type not in (pw.VARINT, pw.LEN):
                raise self.fail(f"{what}.dim has wire type {sub.wire_type}", sub.offset)
            for v in pw.iter_repeated_varint(self.buf, sub):
                self.value(sub.offset)
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
        self.item(item)
        name, body = None, None
        for f in self.fields(item):
            if f.number == 1:
                name = self.string(f, "node_name")
            elif f.number == 2:
                body = self.want(f, pw.LEN, "parallel_strategys")
            else:
                self.skip(f, "parallel_strategy_item")
        if name is None or body is None:
            raise self.fail("parallel_strategy_item lacks node_name or parallel_strategys", item.offset)
        stage, strategies = 0, []
        for f in self.fields(body):
            if f.number == 1:
                stage = self.varint(f, "uint32", "stage")
            elif f.number == 2:
                strategies.append(self.ints(f, "uint32", "parallel_strategy"))
            else:
                self.skip(f, "parallel_strategys")
        return OpItem(name, stage, tuple(strategies))

    def layout_item(self, item: pw.Field):
        self.want(item, pw.LEN, "parallel_layout_item")
        self.item(item)
        name, body = None, None
        for f in self.fields(item):
            if f.number == 1:
                name = self.string(f, "param_name")
            elif f.number == 2:
                if body is not None:
                    raise self.fail("parallel_layouts appears twice in one item", f.offset)
                body = self.want(f, pw.LEN, "parallel_layouts")
            else:
                self.skip(f, "parallel_layout_item")
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
            else:
                self.skip(f, "parallel_layouts")
        if not dev or not maps:
            raise self.fail(f"parameter {name!r} has no dev_matrix or no tensor_map", item.offset)
        # MindSpore (_convert_to_list): several TensorMap entries = one per tensor dim ("layout"
        # API, nested); empty ones are padding. A single entry is the flat map.
        tensor_map = [m for m in maps if m] if len(maps) > 1 else list(maps[0])
        layout = checked_layout(self.where, name, item.offset, dev_matrix=dev[0], tensor_map=tensor_map,
                         param_split_shape=pss[0] if pss else (), indices_offset=ios[0] if ios else (), **scal)
        return name, layout, None, item.offset


def _parse_proto(data: bytes, where: str, limits: StrategyLimits) -> Strategy:
    p = _Proto(data, where, limits)
    current_stage, ops, raw = None, [], []
    try:
        for f in p.fields():
            if f.number == 1:
                current_stage = p.varint(f, "uint32", "current_stage")
            elif f.number == 2:
                ops.append(p.op_item(f))
            elif f.number == 3:
                raw.append(p.layout_item(f))
            else:
                p.skip(f, "ParallelStrategyMap")
    except StrategyError:
        raise
    except CkptdError as err:  # protowire's Truncated/CorruptError: keep its offset
        raise StrategyError(f"not a valid strategy protobuf: {err.message}", path=where, offset=err.offset,
                            hint="the file is damaged or truncated, or it is not a MindSpore strategy file") from None
    if current_stage is None and not ops and not raw:
        raise StrategyError("no ParallelStrategyMap fields found", path=where,
                            hint="this is not a MindSpore strategy file (protobuf or JSON)")
    return assemble_strategy(raw, ops, current_stage or 0, "proto", where)


# --- writing ---------------------------------------------------------------------------------


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
        out.append(pw.len_field(3, pw.len_field(1, s.disk_name(e).encode()) + pw.len_field(2, body)))
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
    data = encode_strategy(strategy, fmt, full_shapes=full_shapes)
    with atomic_write(path, overwrite=overwrite) as fh:
        fh.write(data)


def encode_strategy(
    strategy: Strategy,
    format: StrategyFormat = "proto",
    *,
    full_shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> bytes:
    """The bytes :func:`save_strategy` writes, for callers that keep a strategy without a file
    (e.g. the catalog storing the merge of per-rank files); :func:`parse_strategy_bytes` reads them back."""
    if format == "json":
        return to_json(strategy, full_shapes)
    if format == "proto":
        return _to_proto(strategy)
    raise StrategyError(f"unknown strategy format {format!r}", path=strategy.source_path, hint="use 'proto' or 'json'")
