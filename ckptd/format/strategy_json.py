"""MindSpore's JSON strategy files (``*.json``): the same content as the protobuf form, keyed by name.

``{"current_stage": n, "parallel_strategy_item": {node: {"stage", "parallel_strategy"}},
"parallel_layout_item": {param: {"dev_matrix", "tensor_map", "tensor_shape", "field",
"opt_weight_shard_step", "opt_weight_shard_size", ["param_split_shape", "indices_offset"]}}}``
"""

from __future__ import annotations

import json
from typing import Mapping

from ckptd.errors import LayoutError, StrategyError
from ckptd.format.layout import local_shape
from ckptd.format.limits import (
    DEFAULT_STRATEGY_LIMITS,
    MAX_JSON_DEPTH,
    StrategyLimitError,
    StrategyLimits,
    json_too_deep,
)
from ckptd.format.strategy_types import OpItem, Strategy, assemble_strategy, checked_layout


def _json_ints(value: object, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise StrategyError(f"{what} must be a list of integers, got {value!r}", path=where)
    return tuple(value)


def _json_int(obj: dict, key: str, what: str, where: str, default: int | None = None) -> int:
    if key not in obj:
        if default is not None:
            return default
        raise StrategyError(f"{what} lacks {key!r}", path=where,
                            hint="MindSpore's JSON strategy layouts need dev_matrix, tensor_map, field, "
                            "opt_weight_shard_step and opt_weight_shard_size")
    v = obj[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise StrategyError(f"{what}: {key!r} must be an integer, got {v!r}", path=where)
    return v


def _json_values(data: bytes) -> int:
    """An upper bound on the values and keys of a JSON text: each one follows a , : [ or {."""
    return data.count(b",") + data.count(b":") + data.count(b"[") + data.count(b"{")


def parse_json(data: bytes, where: str, limits: StrategyLimits = DEFAULT_STRATEGY_LIMITS) -> Strategy:
    # counted before parsing: Python's JSON objects take up to ~20 times the text they come from
    values = _json_values(data)
    if values > limits.max_values:
        raise StrategyLimitError(f"{values} JSON separators and brackets: more than ckptd's limit of "
                                 f"{limits.max_values} values per strategy file", path=where)
    if json_too_deep(data):  # Python's parser recurses once per level: bounded before it runs
        raise StrategyError(f"invalid JSON: nests deeper than {MAX_JSON_DEPTH} levels", path=where,
                            hint="MindSpore's JSON strategy files nest 4 levels: the file is damaged or was crafted")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise StrategyError(f"invalid JSON: {err}", path=where, hint="the JSON strategy file is damaged or truncated") from None
    if not isinstance(doc, dict):
        raise StrategyError("a JSON strategy must be an object", path=where)
    ops = []
    op_obj = doc.get("parallel_strategy_item", {})
    lay_obj = doc.get("parallel_layout_item", {})
    if not isinstance(op_obj, dict) or not isinstance(lay_obj, dict):
        raise StrategyError("parallel_strategy_item and parallel_layout_item must be objects", path=where)
    if len(op_obj) + len(lay_obj) > limits.max_items:
        raise StrategyLimitError(f"{len(op_obj) + len(lay_obj)} operator and parameter items: more than ckptd's "
                                 f"limit of {limits.max_items} per strategy file", path=where)
    for node, item in op_obj.items():
        if not isinstance(item, dict) or not isinstance(item.get("parallel_strategy", []), list):
            raise StrategyError(f"operator {node!r}: malformed strategy item", path=where)
        strategies = tuple(_json_ints(s, f"operator {node!r} strategy", where) for s in item.get("parallel_strategy", []))
        ops.append(OpItem(node, _json_int(item, "stage", f"operator {node!r}", where), strategies))
    raw = []
    for name, item in lay_obj.items():
        what = f"parameter {name!r}"
        if not isinstance(item, dict):
            raise StrategyError(f"{what}: layout must be an object", path=where)
        for key in ("dev_matrix", "tensor_map"):
            if key not in item:
                raise StrategyError(f"{what} lacks {key!r}", path=where)
        tmap = item["tensor_map"]
        if not isinstance(tmap, list):
            raise StrategyError(f"{what}: tensor_map must be a list", path=where)
        shape = _json_ints(item["tensor_shape"], f"{what} tensor_shape", where) if "tensor_shape" in item else None
        layout = checked_layout(
            where, name, None,
            dev_matrix=_json_ints(item["dev_matrix"], f"{what} dev_matrix", where),
            tensor_map=[tuple(_json_ints(m, f"{what} tensor_map", where)) if isinstance(m, list) else m for m in tmap],
            field=_json_int(item, "field", what, where),
            opt_shard_step=_json_int(item, "opt_weight_shard_step", what, where),
            opt_shard_size=_json_int(item, "opt_weight_shard_size", what, where),
            param_split_shape=_json_ints(item.get("param_split_shape", []), f"{what} param_split_shape", where),
            indices_offset=_json_ints(item.get("indices_offset", []), f"{what} indices_offset", where),
        )
        if shape is not None:
            try:
                local_shape(layout, shape)
            except LayoutError as err:
                raise StrategyError(f"{what}: tensor_shape does not fit its layout: {err.message}", path=where) from None
        raw.append((name, layout, shape, None))
    current = _json_int(doc, "current_stage", "strategy", where, default=0)
    return assemble_strategy(raw, ops, current, "json", where)


def to_json(s: Strategy, full_shapes: Mapping[str, tuple[int, ...]] | None) -> bytes:
    layouts: dict[str, dict[str, object]] = {}
    for e in s.entries:
        lay = e.layout
        if lay.nested:
            raise StrategyError(
                f"parameter {e.name!r} has a nested tensor_map {lay.tensor_map_lists()}",
                path=s.source_path, hint="MindSpore's JSON strategy cannot express nested layouts; save as protobuf",
            )
        item: dict[str, object] = {"dev_matrix": list(lay.dev_matrix), "tensor_map": list(lay.tensor_map)}
        shape = full_shapes.get(e.name) if full_shapes is not None else None
        shape = shape if shape is not None else e.tensor_shape
        if shape is not None:
            item["tensor_shape"] = list(shape)
        item.update(field=lay.field, opt_weight_shard_step=lay.opt_shard_step, opt_weight_shard_size=lay.opt_shard_size)
        if lay.param_split_shape or lay.indices_offset:
            item.update(param_split_shape=list(lay.param_split_shape), indices_offset=list(lay.indices_offset))
        layouts[s.disk_name(e)] = item
    doc = {
        "current_stage": s.current_stage,
        "parallel_strategy_item": {
            op.node_name: {"stage": op.stage, "parallel_strategy": [list(d) for d in op.strategies]} for op in s.op_items
        },
        "parallel_layout_item": layouts,
    }
    return json.dumps(doc).encode()
