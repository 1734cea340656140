"""Per-rank async checkpoints, the strategy file(s), and exact restore -- in one of two on-disk layouts.

Paths come from :mod:`ckptd.runlayout` (the one module of path rules); this module only decides
what goes into the files and when.

``native`` (what ckptd's trainer always wrote):
``<run_dir>/rank_<r>/<prefix>-<epoch>_<step>.ckpt`` (epoch = the sampler's data epoch, step = the
global step) written by ``mindspore.save_checkpoint(..., async_save=True, integrated_save=False,
crc_check=<not encrypted>)`` with this rank's slices of the weights and the AdamW moments, and
``append_dict`` = step_num, epoch_num, rank_id, tp, dp, data position and RNG state;
``<run_dir>/strategy.ckpt`` in MindSpore's protobuf strategy format describing exactly those
slices (moments share their weight's layout).

``mindformers`` (MindFormers 2.1.0's legacy ``CheckpointMonitor``; ``run_dir`` = its output_dir):
``<run_dir>/checkpoint/rank_<r>/<P>_rank_<r>[_<k>]-<E>_<S>.ckpt`` with ``E``/``S`` the epoch and the
step *within* it (``--steps-per-epoch``), ``k`` the restart suffix MindSpore's
``_chg_ckpt_file_name_if_same_exist`` picks from what is already in the rank directory when the
writer starts; append entries additionally ``global_step`` (Int32 ``[1]``, the optimizer's counter
in MindFormers), ``loss_scale`` and ``global_batch_size``, ``epoch_num`` = ``E``, ``step_num`` =
the global step; ``meta.json`` per rank ``{"last_epoch", "last_step", "last_ckpt_file"}`` written
like MindFormers (temp file + ``os.replace``): right after a sync save, and for an async save at a
later step end once MindSpore's write thread has finished -- so it lags, and the last async save
of a run is never recorded; one strategy file per rank, ``<run_dir>/strategy/ckpt_strategy_rank_<r>.ckpt``
(identical content on every rank: no pipeline stages here).

Both layouts: ``<shard>.done`` (JSON size + xxh3_128) once the async write finished (ckptd's
commit hint).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from dataclasses import dataclass

from ckptd import runlayout
from ckptd.format.strategy import ParamStrategy, Strategy, save_strategy
from ckptd.launcher.heartbeat import write_sidecar
from ckptd.runlayout import MINDFORMERS, NATIVE, Layout
from trainer.config import ParamSpec
from trainer.data import STATE_KEYS
from trainer.topology import Topology, layout_for

STRATEGY_NAME = "strategy.ckpt"
LAYOUTS = (NATIVE, MINDFORMERS)
#: append entries a shard may carry besides tensors in the strategy (both layouts, converted copies)
META_KEYS = frozenset({"step_num", "epoch_num", "rank_id", "tp", "dp", "global_step", "loss_scale",
                       "global_batch_size", *STATE_KEYS})


def epoch_and_step(step: int, steps_per_epoch: int | None) -> tuple[int, int]:
    """MindSpore's ``(cur_epoch_num, step_in_epoch)`` of a global step (``steps_per_epoch`` None: one
    endless epoch); step 0 (the initial weights, which MindFormers never saves) is ``(0, 0)``."""
    if step <= 0:
        return 0, 0
    if steps_per_epoch is None:
        return 1, step
    return (step - 1) // steps_per_epoch + 1, (step - 1) % steps_per_epoch + 1


def restart_incarnation(rank_dir: str, base_prefix: str) -> int:
    """The ``k`` MindSpore appends to ``base_prefix`` (``{P}_rank_{r}``) because files of that prefix
    are already in ``rank_dir``: its own ``_chg_ckpt_file_name_if_same_exist``, which ``ModelCheckpoint``
    (and so MindFormers' ``CheckpointMonitor``) runs once at construction (0 = no suffix)."""
    from mindspore.train.callback._checkpoint import _chg_ckpt_file_name_if_same_exist

    chosen = _chg_ckpt_file_name_if_same_exist(rank_dir, base_prefix)
    if chosen == base_prefix:
        return 0
    if not chosen.startswith(base_prefix + "_") or not chosen[len(base_prefix) + 1:].isdigit():
        raise RuntimeError(f"MindSpore chose the prefix {chosen!r} for {base_prefix!r} in {rank_dir}")
    return int(chosen[len(base_prefix) + 1:])


def build_strategy(specs: list[ParamSpec], topo: Topology) -> Strategy:
    """Layouts of every saved tensor: weights and their ``adam_m.`` / ``adam_v.`` moments."""
    entries = []
    for prefix in ("", "adam_m.", "adam_v."):
        for s in specs:
            entries.append(ParamStrategy(prefix + s.name, layout_for(s.split, len(s.shape), topo)))
    return Strategy.build(entries)


def strategy_path(run_dir: str, rank: int, layout: Layout = NATIVE) -> str:
    """Where ``rank`` writes the strategy: ``strategy.ckpt`` of the run (written by rank 0), or
    MindFormers' per-rank ``strategy/ckpt_strategy_rank_<r>.ckpt``."""
    if layout == MINDFORMERS:
        return runlayout.rank_strategy_path(run_dir, rank)
    return os.path.join(run_dir, STRATEGY_NAME)


def write_strategy(run_dir: str, specs: list[ParamSpec], topo: Topology, layout: Layout = NATIVE) -> str:
    """Write (or rewrite, identical content) this rank's strategy file (native: call on rank 0 only)."""
    path = strategy_path(run_dir, topo.rank, layout)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_strategy(build_strategy(specs, topo), path, overwrite=True)
    return path


def write_meta(run_dir: str, rank: int, epoch: int, step_in_epoch: int, ckpt_file: str) -> None:
    """MindFormers' ``record_last_ckpt_to_json``: temp file in the rank dir, ``os.replace``, 0o640, no fsync."""
    final = runlayout.meta_path(run_dir, rank)
    doc = {"last_epoch": epoch, "last_step": step_in_epoch, "last_ckpt_file": ckpt_file}
    with tempfile.NamedTemporaryFile("w", delete=False, dir=os.path.dirname(final)) as tmp:
        json.dump(doc, tmp)
        tmp_path = tmp.name
    os.replace(tmp_path, final)
    os.chmod(final, 0o640)


def _find_save_thread() -> threading.Thread | None:
    for t in threading.enumerate():
        if t.name == "asyn_save_ckpt":  # the name MindSpore gives its async-save thread
            return t
    return None


class CheckpointWriter:
    """Issues async saves; a small committer thread writes each sidecar the moment MindSpore's write
    thread finishes (not at the next step: a rank killed right after a finished save still leaves a
    committed shard). In the ``mindformers`` layout it also keeps ``meta.json`` as MindFormers does
    (:meth:`step_end` is its per-step ``_save_ckpt`` bookkeeping)."""

    def __init__(self, run_dir: str, topo: Topology, prefix: str, enc_key: bytes | None, layout: Layout = NATIVE,
                 steps_per_epoch: int | None = None, global_batch_size: int | None = None) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}: one of {', '.join(LAYOUTS)}")
        if steps_per_epoch is not None and steps_per_epoch < 1:
            raise ValueError("steps_per_epoch must be >= 1")
        self.run_dir, self.topo, self.prefix, self.enc_key = run_dir, topo, prefix, enc_key
        self.layout, self.steps_per_epoch, self.global_batch_size = layout, steps_per_epoch, global_batch_size
        self.committer: threading.Thread | None = None
        self.rank_dir = runlayout.shard_dir(run_dir, topo.rank, layout)
        self.incarnation = 0
        self.pending_meta: tuple[int, int, str] | None = None  # the last async save, not yet in meta.json
        os.makedirs(self.rank_dir, exist_ok=True)
        if layout == MINDFORMERS:
            self.incarnation = restart_incarnation(
                self.rank_dir, runlayout.file_prefix(prefix, topo.rank, MINDFORMERS))
            if not os.listdir(self.rank_dir):
                # CheckpointMonitor removes the directory ModelCheckpoint created when it is still
                # empty; it is made again right before the first save
                os.rmdir(self.rank_dir)

    def path_for(self, step: int, data_epoch: int) -> tuple[str, int, int]:
        """(shard path, epoch in the name, step in the name) of a save at global ``step``."""
        if self.layout == MINDFORMERS:
            epoch, in_epoch = epoch_and_step(step, self.steps_per_epoch)
        else:
            epoch, in_epoch = data_epoch, step
        path = runlayout.shard_path(self.run_dir, self.topo.rank, self.prefix, epoch, in_epoch, self.layout,
                                    incarnation=self.incarnation)
        return path, epoch, in_epoch

    def step_end(self) -> None:
        """Every step end, before a save: record the previous async save in ``meta.json`` once
        MindSpore's write thread is gone (MindFormers' ``_save_ckpt``, ``callback.py:1820-1824``)."""
        if self.pending_meta is not None and _find_save_thread() is None:
            epoch, in_epoch, name = self.pending_meta
            if epoch and in_epoch and name:  # MindFormers' truthiness test (never step 0)
                write_meta(self.run_dir, self.topo.rank, epoch, in_epoch, name)
            self.pending_meta = None

    def append_for(self, step: int, data_epoch: int, extra: dict[str, object]) -> tuple[str, int, int, dict[str, object]]:
        """(shard path, epoch and step in its name, the append entries in file order) of a save at ``step``:
        what a file save writes after the tensors, and what a memory snapshot records of it."""
        import mindspore as ms

        path, epoch, in_epoch = self.path_for(step, data_epoch)
        append: dict[str, object]
        if self.layout == MINDFORMERS:
            # MindFormers' append_dict, in its order, then this trainer's own entries
            append = {"epoch_num": int(epoch), "step_num": int(step),
                      "global_step": ms.Tensor([int(step)], ms.int32), "loss_scale": 1}
            if self.global_batch_size is not None:
                append["global_batch_size"] = int(self.global_batch_size)
            append.update({"rank_id": int(self.topo.rank), "tp": int(self.topo.tp), "dp": int(self.topo.dp), **extra})
        else:
            append = {"step_num": int(step), "epoch_num": int(data_epoch), "rank_id": int(self.topo.rank),
                      "tp": int(self.topo.tp), "dp": int(self.topo.dp), **extra}
        return path, epoch, in_epoch, append

    def save(self, items: list[tuple[str, object]], step: int, data_epoch: int, extra: dict[str, object],
             async_save: bool = True) -> str:
        import mindspore as ms

        self.wait()  # MindSpore itself would wait for the previous async write before starting this one
        path, epoch, in_epoch, append = self.append_for(step, data_epoch, extra)
        if self.layout == MINDFORMERS and not os.path.isdir(self.rank_dir):
            os.makedirs(self.rank_dir, exist_ok=True)
            os.chmod(self.rank_dir, 0o750)  # MindFormers' set_safe_mode_for_file_or_dir
        kwargs = {"enc_key": self.enc_key} if self.enc_key else {"crc_check": True}
        ms.save_checkpoint([{"name": n, "data": d} for n, d in items], path, integrated_save=False,
                           async_save=async_save, append_dict=append, **kwargs)
        writer = _find_save_thread() if async_save else None
        self.committer = threading.Thread(target=_commit, args=(path, writer), name="ckpt-sidecar", daemon=True)
        self.committer.start()
        if self.layout == MINDFORMERS:
            if async_save:
                self.pending_meta = (epoch, in_epoch, os.path.basename(path))
            else:
                write_meta(self.run_dir, self.topo.rank, epoch, in_epoch, os.path.basename(path))
        return path

    def wait(self) -> None:
        """Block until the last save and its sidecar are on disk."""
        if self.committer is not None:
            self.committer.join()
            self.committer = None


def _commit(path: str, writer: threading.Thread | None) -> None:
    if writer is not None:
        writer.join()
    if os.path.exists(path):  # a failed write leaves only the .tmp: no sidecar then
        write_sidecar(path)


@dataclass(frozen=True)
class Restored:
    step: int
    epoch: int
    data_state: dict[str, int]  # Sampler.restore() input


def load_shard(path: str, topo: Topology, targets: dict[str, object], dec_key: bytes | None) -> Restored:
    """Load this rank's shard into ``targets`` (name -> Parameter), bit-exactly; check it is ours.

    Either layout: the file's own entries say whose it is, not its path. A shard saved under another
    tp/dp is accepted only as a re-sharded copy made for this job (ckptd's converter): its
    ``rank_id`` is this rank and every tensor has exactly this job's shape. The converter copies the
    other metadata (tp, dp, step, data position) from a source rank, so tp/dp then name the layout
    the step was trained with, not this one.
    """
    import mindspore as ms

    kwargs = {"dec_key": dec_key} if dec_key else {}
    loaded = ms.load_checkpoint(path, **kwargs)
    rank_id = int(loaded["rank_id"].asnumpy())
    saved_tp, saved_dp = int(loaded["tp"].asnumpy()), int(loaded["dp"].asnumpy())
    if rank_id != topo.rank:
        raise RuntimeError(f"{path} belongs to rank {rank_id} (tp={saved_tp}, dp={saved_dp}), "
                           f"not to rank {topo.rank} of tp={topo.tp} dp={topo.dp}")
    missing = [n for n in targets if n not in loaded]
    extra = [n for n in loaded if n not in targets and n not in META_KEYS]
    if missing or extra:
        raise RuntimeError(f"{path} does not match this model: missing {missing[:3]}, unexpected {extra[:3]}")
    # every shape first: a wrong shard must not leave the model half-overwritten
    for name, param in targets.items():
        shape = tuple(loaded[name].shape)
        if shape != tuple(param.shape):
            why = (f" (a shard saved at tp={saved_tp},dp={saved_dp} that was not re-sharded for tp={topo.tp},"
                   f"dp={topo.dp})" if (saved_tp, saved_dp) != (topo.tp, topo.dp) else "")
            raise RuntimeError(f"{path}: {name} has shape {shape}, expected {tuple(param.shape)}{why}")
    if (saved_tp, saved_dp) != (topo.tp, topo.dp):
        print(f"[trainer rank {topo.rank}] resuming a re-sharded checkpoint saved at tp={saved_tp},dp={saved_dp} "
              f"(this job: tp={topo.tp},dp={topo.dp}): {path}", flush=True)
    for name, param in targets.items():
        param.set_data(ms.Tensor(loaded[name].asnumpy().copy()))
    return Restored(
        step=int(loaded["step_num"].asnumpy()),
        epoch=int(loaded["epoch_num"].asnumpy()),
        data_state={k: int(loaded[k].asnumpy()) for k in STATE_KEYS},
    )
