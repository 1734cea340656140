"""A MindSpore ``Callback`` that makes any ``Model.train`` job resumable by ``ckptd launch``.

Add it next to (after) your ``ModelCheckpoint``::

    from ckptd.integrations.mindspore_callback import CkptdCallback

    ckptd_cb = CkptdCallback()
    initial_epoch = ckptd_cb.restore(dataset, net, optimizer)   # after init(); a no-op on a fresh start
    model.train(epochs, dataset, callbacks=[ckpt_cb, ckptd_cb], initial_epoch=initial_epoch)

What it does, per rank:

* heartbeats (pid, step, phase) and a clean exit marker into ``$CKPTD_HEARTBEAT_DIR`` -- the files
  the launcher watches for dead and hung ranks (:mod:`ckptd.launcher.heartbeat`); without that
  variable (not under the launcher) it writes none;
* per-step health to ckptd (``$CKPTD_URL``, rank 0 only: loss, overflow, the gradient norm when the
  train cell returns MindFormers' 5-tuple) from a background thread with a bounded queue that drops
  reports when ckptd is slow or down -- training never waits for it;
* each ``ModelCheckpoint`` save's ``.done`` commit hint (size + xxh3_128) once the save has really
  finished: ``save_checkpoint(async_save=True)`` returns at once and a thread named
  ``asyn_save_ckpt`` writes ``<name>.tmp``, renames it to ``<name>.ckpt`` and makes it read-only; the
  sidecar is written by a small committer thread after that thread has ended and the file exists;
* on resume (``$CKPTD_RESUME_FILE``, ckptd's answer, set by the launcher) :meth:`CkptdCallback.restore`
  loads this rank's shard into the cells (weights, optimizer moments and its ``global_step``, so the
  learning-rate schedule continues), positions the dataset at the step inside its epoch
  (``set_init_step``) and returns the ``initial_epoch`` for ``Model.train``; at train begin it sets
  ``cb_params.cur_step_num`` to the restored step -- ``Model.train`` itself would restart it at 0 --
  and tells every ``ModelCheckpoint`` that this step is already saved, so saves land on the same
  steps, with the same names and ``step_num``, as in an uninterrupted run.

Sink mode (``dataset_sink_mode=True``, Ascend's default) is refused at train begin with a clear
error; on CPU MindSpore trains non-sink whatever was asked, so the refusal never fires there.

The data position is exact for a dataset that yields the same batches in the same order every
epoch (no shuffle, or a shuffle whose order does not depend on the epoch count): MindSpore's
pipeline restarts its epoch count at ``initial_epoch``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading

import mindspore as ms
from mindspore.train.callback import Callback, ModelCheckpoint

from ckptd import runlayout
from ckptd.launcher.heartbeat import HealthReporter, Heartbeat, write_sidecar

#: the thread MindSpore's save_checkpoint(async_save=True) writes the file from
ASYNC_SAVE_THREAD = "asyn_save_ckpt"


def _rank() -> int:
    try:
        from mindspore.communication import get_rank

        return int(get_rank())
    except Exception:  # noqa: BLE001 -- not initialised (one process): msrun's RANK_ID, else 0
        return int(os.environ.get("RANK_ID", "0"))


def _save_writer() -> threading.Thread | multiprocessing.Process | None:
    """The running async write: MindSpore's thread (``async_save=True`` / ``"thread"``), or its forked
    process of the same name (``async_save="process"``)."""
    thread = next((t for t in threading.enumerate() if t.name == ASYNC_SAVE_THREAD), None)
    if thread is not None:
        return thread
    return next((p for p in multiprocessing.active_children() if p.name == ASYNC_SAVE_THREAD), None)


def _commit(path: str, writer: threading.Thread | multiprocessing.Process | None) -> None:
    if writer is not None:
        writer.join()
    # a failed write leaves only the .tmp; a file removed since (keep_checkpoint_max) needs no hint
    if os.path.exists(path):
        try:
            write_sidecar(path)
        except FileNotFoundError:
            pass  # rotated away between the check and the read


def _scalar(x: object) -> float | None:
    try:
        return float(x.asnumpy()) if hasattr(x, "asnumpy") else float(x)  # type: ignore[arg-type,union-attr]
    except (TypeError, ValueError):
        return None


class CkptdCallback(Callback):
    """See the module docstring. Arguments default to the launcher's environment variables."""

    def __init__(self, heartbeat_dir: str | None = None, ckptd_url: str | None = None, run_name: str | None = None,
                 report_health: bool | None = None) -> None:
        super().__init__()
        self.attempt = int(os.environ.get("CKPTD_ATTEMPT", "0"))
        hb_dir = heartbeat_dir or os.environ.get("CKPTD_HEARTBEAT_DIR")
        self.rank = _rank()
        self.hb = Heartbeat(hb_dir, self.rank, self.attempt) if hb_dir else None
        self._beat(0, "starting")  # from here the launcher allows --startup-timeout (imports, compile)
        url = ckptd_url or os.environ.get("CKPTD_URL")
        run = run_name or os.environ.get("CKPTD_RUN_NAME")
        # the loss is one rank's view under data parallelism; one reporter per job, as the trainer
        report = (self.rank == 0) if report_health is None else report_health
        self.health = HealthReporter(url if (report and run) else None, run or "", os.environ.get("CKPTD_TOKEN"))
        self.resume_step = 0
        self.resumed_from: str | None = None
        self._first_step = True
        self._step = 0
        #: shard path -> the thread writing its sidecar (kept while the shard exists)
        self._committers: dict[str, threading.Thread] = {}

    def _check_rank(self) -> None:
        rank = _rank()
        if rank != self.rank:  # constructed before init(), and msrun's RANK_ID is not the rank
            self.rank = rank
            self.hb = Heartbeat(self.hb.hb_dir, rank, self.attempt) if self.hb is not None else None

    def _beat(self, step: int, phase: str) -> None:
        if self.hb is not None:
            self.hb.beat(step, phase)

    # --- resume ---------------------------------------------------------------------------------

    def restore(self, dataset: object | None, *cells: object, resume_file: str | None = None) -> int:
        """Load this rank's shard of the launcher's answer into ``cells`` (e.g. the network and the
        optimizer) and position ``dataset``; returns ``initial_epoch`` for ``Model.train`` (0 on a
        fresh start: no ``$CKPTD_RESUME_FILE``). Call it after ``init()`` and before ``Model.train``."""
        resume_file = resume_file or os.environ.get("CKPTD_RESUME_FILE")
        if not resume_file:
            return 0
        with open(resume_file) as fh:
            answer = json.load(fh)
        self._check_rank()
        mine = [s["path"] for s in answer.get("shards", []) if int(s["rank"]) == self.rank]
        if len(mine) != 1:
            raise RuntimeError(f"{resume_file}: the resume answer has {len(mine)} shards for rank {self.rank}")
        loaded = ms.load_checkpoint(mine[0])
        for cell in cells:
            names = [p.name for p in cell.get_parameters()]  # type: ignore[attr-defined]
            missing = [n for n in names if n not in loaded]
            if missing:  # a checkpoint of another model must not leave this one half-overwritten
                raise RuntimeError(f"{mine[0]} does not match {type(cell).__name__}: no {missing[:3]}")
        for cell in cells:
            ms.load_param_into_net(cell, loaded)
        step = self._saved_step(loaded, answer, mine[0])
        initial_epoch = 0
        if dataset is not None:
            per_epoch = int(dataset.get_dataset_size())  # type: ignore[attr-defined]
            initial_epoch, in_epoch = divmod(step, per_epoch)
            if in_epoch:
                dataset.set_init_step(in_epoch)  # type: ignore[attr-defined]  # skip what the epoch consumed
        self.resume_step, self.resumed_from = step, mine[0]
        self._step = step
        self._beat(step, "starting")
        return initial_epoch

    @staticmethod
    def _saved_step(loaded: dict, answer: dict, path: str) -> int:
        """The step the file holds: ModelCheckpoint's ``step_num`` (with ``append_info=["step_num"]``),
        else the optimizer's ``global_step``; it must be the step ckptd answered."""
        for key in ("step_num", "global_step"):
            if key in loaded:
                step = int(loaded[key].asnumpy().reshape(-1)[0])
                break
        else:
            raise RuntimeError(f"{path} holds neither step_num nor global_step: cannot tell the step to resume at")
        want = answer.get("global_step", answer.get("step"))
        if want is not None and int(want) != step:
            raise RuntimeError(f"{path} holds step {step}, ckptd's answer says {want}")
        return step

    # --- callbacks ------------------------------------------------------------------------------

    def on_train_begin(self, run_context) -> None:
        cb = run_context.original_args()
        if getattr(cb, "dataset_sink_mode", False):
            # In sink mode step callbacks run once per sink (an epoch by default): heartbeats, save
            # commits and the restored step position are not per step, and none of it is tested
            # (Ascend only; MindSpore on CPU trains non-sink whatever was asked). Refused, not guessed.
            raise RuntimeError("CkptdCallback: dataset_sink_mode=True is not supported: ckptd's heartbeats, save "
                               "commits and exact resume need per-step callbacks; pass dataset_sink_mode=False "
                               "to Model.train")
        self._check_rank()
        if self.resume_step:
            cb.cur_step_num = self.resume_step
            for other in cb.list_callback:
                if isinstance(other, ModelCheckpoint):
                    other._last_triggered_step = self.resume_step  # noqa: SLF001 -- as MindSpore's own resume does

    def on_train_step_begin(self, run_context) -> None:
        cb = run_context.original_args()
        self._step = int(cb.cur_step_num)
        # the first step of an attempt compiles the graph: still "starting" for the launcher
        self._beat(self._step, "starting" if self._first_step else "compute")

    def on_train_step_end(self, run_context) -> None:
        cb = run_context.original_args()
        self._first_step = False
        self._step = int(cb.cur_step_num)
        self._beat(self._step, "sync")
        self._commit_new_saves(cb)
        if self.health.url:
            self._report(cb)

    def on_train_end(self, run_context) -> None:
        cb = run_context.original_args()
        self._beat(self._step, "finishing")
        self._commit_new_saves(cb)
        for t in self._committers.values():
            t.join()
        self.health.flush()
        if self.hb is not None:
            self.hb.exited(0, self._step)

    # --- helpers --------------------------------------------------------------------------------

    def _commit_new_saves(self, cb) -> None:
        # keep_checkpoint_max removed a shard: its hint goes too (a hint without its shard is noise)
        for path, t in list(self._committers.items()):
            if not t.is_alive() and not os.path.exists(path):
                try:
                    os.unlink(runlayout.sidecar_for(path))
                except FileNotFoundError:
                    pass
                del self._committers[path]
        for other in cb.list_callback:
            latest = getattr(other, "_latest_ckpt_file_name", None) if isinstance(other, ModelCheckpoint) else None
            if not latest or latest in self._committers:
                continue
            # ModelCheckpoint waits for the previous async write before it starts the next, so a
            # running writer is this file's
            t = threading.Thread(target=_commit, args=(latest, _save_writer()), name="ckptd-sidecar", daemon=True)
            t.start()
            self._committers[latest] = t

    def _report(self, cb) -> None:
        out = cb.net_outputs
        items = list(out) if isinstance(out, (tuple, list)) else [out]
        loss = _scalar(items[0]) if items else None
        if loss is None:
            return
        overflow = bool(_scalar(items[1])) if len(items) > 1 else False
        grad_norm = _scalar(items[4]) if len(items) > 4 else None  # MindFormers: loss, overflow, scale, lr, norm
        self.health.report(self._step, loss, grad_norm, overflow)

