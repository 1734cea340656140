"""Fixture generator: MindFormers Checkpoint 2.0 iterations of a multi-rank job.

``metadata.json`` and ``common.json`` are written by MindFormers 2.1.0's own functions
(``save_metadata`` / ``save_balanced_metadata`` over real ``mindspore.parallel.Layout`` objects for a
simulated dp x tp world, ``CommonInfo.save_common``; see tests/mf_stub.py ``ckpt2_metadata``), and
the safetensors files they promise by the real ``mindspore.save_checkpoint(format="safetensors")``,
each holding exactly the slices ``metadata.json`` places in it (plain mode: every rank writes its
local slices; balanced mode: each slice once). Single-rank iterations come from MindFormers'
``checkpoint.save_checkpoint`` itself (``ckpt2_save``) or the committed samples in
tests/fixtures/mindformers/.
"""

from __future__ import annotations

import ast
import json
import os
import zlib
from pathlib import Path

import numpy as np

import mf_stub

PREFIX = "toy"
#: (name, split, global shape): split as in tests/mf_stub.py ``ckpt2_metadata`` (tp over rows/cols, replicated)
PARAMS = [["fc1.weight", "tp_rows", [8, 4]], ["fc1.bias", "tp", [8]], ["fc2.weight", "tp_cols", [2, 8]],
          ["fc2.bias", "rep", [2]], ["adam_m.fc1.weight", "tp_rows", [8, 4]], ["adam_v.fc1.weight", "tp_rows", [8, 4]]]


def global_tensor(name: str, shape: list[int], iteration: int) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(name.encode()) + iteration)
    return rng.standard_normal(shape).astype(np.float32)


def local_slice(full: np.ndarray, index: int, fragments: list[int]) -> np.ndarray:
    """Slice ``index`` of ``full``: the row-major position in the ``axis_fragmentations`` grid."""
    coords = np.unravel_index(index, fragments)
    sel = tuple(slice(c * (n // f), (c + 1) * (n // f)) for c, n, f in zip(coords, full.shape, fragments))
    return np.ascontiguousarray(full[sel])


def make_records(checkpoint_dir: Path, *, plain: list[int] = (), balanced: list[int] = (), dp: int = 2, tp: int = 2,
                 common: dict[int, dict] | None = None) -> None:
    """metadata.json (and common.json) of iterations, by MindFormers' code in one child process."""
    commons = []
    for it in [*plain, *balanced]:
        fields = {"epoch_num": 1, "step_num": it, "global_step": it, "loss_scale": 1.0, "global_batch_size": 8}
        fields.update((common or {}).get(it, {}))
        commons.append([str(checkpoint_dir / f"iteration_{it:08d}" / "common.json"), fields])
    mf_stub.run({"op": "ckpt2_metadata", "dp": dp, "tp": tp, "prefix": PREFIX, "params": PARAMS,
                 "plain": [str(checkpoint_dir / f"iteration_{it:08d}") for it in plain],
                 "balanced": [[str(checkpoint_dir), it] for it in balanced], "common": commons})


def write_files(ms, it_dir: Path, iteration: int, *, skip: dict[str, set[str]] | None = None) -> dict[str, Path]:
    """Every safetensors file ``metadata.json`` names, holding what it places there (``skip``:
    file name -> tensors to leave out, for lying-metadata cases). Returns file name -> path."""
    doc = json.loads((it_dir / "metadata.json").read_text())
    meta = doc["state_dict_metadata"]
    files: dict[str, dict[str, np.ndarray]] = {}
    for key, records in doc["storage_data"].items():
        name, (index,) = ast.literal_eval(key)  # MindFormers' own key format: str((name, (slice,)))
        full = global_tensor(name, meta[name]["global_shape"], iteration)
        part = local_slice(full, index, meta[name]["axis_fragmentations"])
        for rec in records:
            if name not in (skip or {}).get(rec["file_name"], set()):
                files.setdefault(rec["file_name"], {})[name] = part
    out = {}
    for file_name, tensors in sorted(files.items()):
        path = it_dir / file_name
        ms.save_checkpoint([{"name": n, "data": ms.Tensor(a)} for n, a in sorted(tensors.items())], str(path),
                           format="safetensors")
        out[file_name] = path
    return out


def write_tracker(checkpoint_dir: Path, text: str) -> Path:
    """``iter_finalize_func``'s write: ``open(..., "w")`` + ``write(str(iteration))``, no newline, no fsync."""
    path = checkpoint_dir / "latest_checkpointed_iteration.txt"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(path, 0o640)
    return path


def mindformers_checkpoint_path(paths: list[Path]) -> list[dict]:
    """What MindFormers' own ``get_checkpoint_path`` resolves each directory to (or its error)."""
    return mf_stub.run({"op": "checkpoint_path", "paths": [str(p) for p in paths]})["results"]


def mindformers_save(checkpoint_dir: Path, iterations: list[int], **kw) -> None:
    """Single-rank iterations by MindFormers' ``checkpoint.save_checkpoint`` (``keep_max``, ``async``, ``finalize``)."""
    mf_stub.run({"op": "ckpt2_save", "root": str(checkpoint_dir), "iterations": iterations, "prefix": PREFIX, **kw})
