"""A MindFormers Checkpoint 2.0 iteration as the source of a conversion to per-rank legacy files.

The source layout is ``metadata.json``'s (``ckptd.format.mf2``): each tensor's ``layout`` is a
MindSpore ``Layout.to_dict()`` -- ``device_matrix``, ``tensor_map`` (device axes counted from the
right, as in strategy files) and ``rank_list`` (the stage's ranks) -- turned here into the
:class:`~ckptd.format.strategy.Strategy` the planner reads. Tensors without a layout
(``global_step``, ``learning_rate``) are copied whole from any file holding them.

A source rank is the files ``metadata.json`` says it stored (``storage_rank``): in a plain save
its model file and its optimizer file; in a balanced (redundancy-removed) save only the slices the
plan gave it, so other slices are read from the rank that stored them (the planner's usual "read a
replica" path). A single-rank iteration (no ``metadata.json``) is one unsharded source: its model and
optimizer files.
"""

from __future__ import annotations

import json
import math
import os

from ckptd import runlayout
from ckptd.convert.plan import ConvertError
from ckptd.errors import CkptdError, LayoutError, StrategyError
from ckptd.format import mf2
from ckptd.format.layout import TensorLayout
from ckptd.format.strategy import Strategy
from ckptd.format.strategy_types import ParamStrategy
from ckptd.storage import PosixStorage


def is_iteration_dir(path: str) -> bool:
    return runlayout.parse_iteration_dir(os.path.basename(os.path.normpath(path))) is not None


def iteration_source(it_dir: str, store: PosixStorage | None = None,
                     ) -> tuple[dict[int, tuple[str, ...]], Strategy | None]:
    """``(source rank -> its files, source strategy)`` of an iteration directory, read through
    ``store`` (the daemon's checkpoint root; by default the directory holding ``it_dir``, the
    operator's own path: nothing below it is followed through a symlink either way)."""
    it_dir = os.path.abspath(it_dir)
    store = store or PosixStorage(os.path.dirname(it_dir))
    meta_path = os.path.join(it_dir, runlayout.MF2_METADATA)
    if not store.exists(meta_path):
        names = sorted(n for n in store.list(it_dir) if runlayout.parse_iteration_file("", 0, n) is not None
                       and n.endswith(".safetensors"))
        if not names:
            raise ConvertError("no Checkpoint 2.0 model or optimizer file in the iteration directory", path=it_dir)
        return {0: tuple(os.path.join(it_dir, n) for n in names)}, None
    meta = mf2.parse_metadata(store.read(meta_path, mf2.MAX_METADATA_BYTES), meta_path)
    files: dict[int, set[str]] = {}
    for p in meta.placements:
        files.setdefault(p.storage_rank, set()).add(p.file_name)
    missing = sorted({n for names in files.values() for n in names if not store.exists(os.path.join(it_dir, n))})
    if missing:
        raise ConvertError(f"metadata.json names files that are not there: {missing[:5]}", path=it_dir,
                           hint="convert a verified iteration (ckptd convert --run R --step S checks this first)")
    return ({r: tuple(os.path.join(it_dir, n) for n in sorted(names)) for r, names in sorted(files.items())},
            _strategy(meta.layouts, meta_path))


def _strategy(layouts: dict[str, str], path: str) -> Strategy | None:
    entries = []
    for name, text in layouts.items():
        lay = json.loads(text)  # mf2 wrote this text from the parsed file: one tensor's layout at a time
        try:
            dev = tuple(lay["device_matrix"])
            layout = TensorLayout(dev, lay["tensor_map"])
            ranks = list(lay["rank_list"])
        except (KeyError, TypeError, LayoutError) as err:
            raise ConvertError(f"metadata.json: tensor {name!r} has a layout ckptd cannot read ({err})", path=path) from None
        if lay.get("interleaved_parallel"):
            raise ConvertError(f"metadata.json: tensor {name!r} uses interleaved parallelism, which ckptd does not "
                               "re-shard", path=path, hint="load it with MindFormers' own loader")
        devices = math.prod(dev)
        stage = ranks[0] // devices if ranks else 0
        if ranks != list(range(stage * devices, (stage + 1) * devices)):
            raise ConvertError(f"metadata.json: tensor {name!r} has rank_list {ranks[:8]}…, not one contiguous stage "
                               f"of {devices} ranks", path=path)
        entries.append(ParamStrategy(name, layout, stage))
    if not entries:
        return None
    try:
        return Strategy.build(entries, merged=len({e.stage for e in entries}) > 1, source_path=path)
    except (StrategyError, CkptdError) as err:
        raise ConvertError(f"metadata.json does not describe one parallel layout: {err}", path=path) from None
