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
* with ``snapshot_every=N`` (or ``$CKPTD_SNAPSHOT_EVERY``), the memory tier: every N steps each rank
  copies what its ``ModelCheckpoint`` would save at that step (the same parameters, the same append
  entries, named as that file would be) into its node's shared memory (:mod:`ckptd.integrations.flash`);
  training waits for the copy alone, the node's ``ckptd serve`` catalogues and persists it. When
  shared memory is too small, one warning says the bytes needed and free, and the job goes on with
  its file saves;
* on resume (``$CKPTD_RESUME_FILE``, ckptd's answer, set by the launcher) :meth:`CkptdCallback.restore`
  loads this rank's shard into the cells (weights, optimizer moments and its ``global_step``, so the
  learning-rate schedule continues), positions the dataset at the step inside its epoch
  (``set_init_step``) and returns the ``initial_epoch`` for ``Model.train``; at train begin it sets
  ``cb_params.cur_step_num`` to the restored step -- ``Model.train`` itself would restart it at 0 --
  and tells every ``ModelCheckpoint`` that this step is already saved, so saves land on the same
  steps, with the same names and ``step_num``, as in an uninterrupted run.

At train begin it refuses, with one line saying what to change (a ``RuntimeError`` out of
``Model.train``, before the first step), what would make the run unresumable or its resume wrong:
sink mode (``dataset_sink_mode=True``, Ascend's default; on CPU MindSpore trains non-sink whatever
was asked, so that refusal never fires there), no ``ModelCheckpoint``, ``CkptdCallback`` listed
before it, a ``ModelCheckpoint`` not writing into ``<run-dir>/rank_<r>`` (under the launcher), with
``integrated_save=True``, or whose files would hold no step, and a resume without :meth:`restore`
(or, at the first step, without its ``initial_epoch``). A dataset that reshuffles every epoch
only gets a warning: the run resumes, just not bit-exactly.

The data position is exact for a dataset that yields the same batches in the same order every
epoch (no shuffle, or a shuffle whose order does not depend on the epoch count): MindSpore's
pipeline restarts its epoch count at ``initial_epoch``.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import threading

import mindspore as ms
from mindspore.train.callback import Callback, ModelCheckpoint

from ckptd import runlayout
from ckptd.launcher.heartbeat import HealthReporter, Heartbeat, write_sidecar

#: the thread MindSpore's save_checkpoint(async_save=True) writes the file from
ASYNC_SAVE_THREAD = "asyn_save_ckpt"

log = logging.getLogger(__name__)


def _launcher_run_dir() -> str | None:
    """The run dir ``ckptd launch`` runs this job for: it sets ``CKPTD_HEARTBEAT_DIR=<run-dir>/heartbeat``
    and ``CKPTD_RUN_NAME`` to the run dir's name (None: not under the launcher)."""
    hb, run = os.environ.get("CKPTD_HEARTBEAT_DIR"), os.environ.get("CKPTD_RUN_NAME")
    if not hb or not run:
        return None
    run_dir = os.path.dirname(os.path.normpath(hb))
    return run_dir if os.path.basename(run_dir) == run else None


def _param(cb: object, name: str) -> object:
    """A callback parameter that may be absent: MindSpore's ``InternalCallbackParam`` is a dict whose
    missing attributes raise ``KeyError``, not ``AttributeError``."""
    return cb.get(name) if isinstance(cb, dict) else getattr(cb, name, None)


def _refuse(what: str, fix: str) -> RuntimeError:
    """One line: what is wrong and why it matters, then what to change."""
    return RuntimeError(f"CkptdCallback: {what}; {fix}")


def _epoch_shuffle(dataset: object) -> str | None:
    """The first op of ``dataset``'s pipeline that reshuffles every epoch (None: none found). Best
    effort, by MindSpore's own attributes: a ``.shuffle()`` op, a random sampler, or a source's
    ``shuffle=True`` (its sampler); a shuffle in a user's generator is invisible here."""
    todo, seen = [dataset], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        name = type(node).__name__
        if name == "ShuffleDataset" and getattr(node, "reshuffle_each_epoch", True):
            return "a .shuffle() op"
        sampler = getattr(node, "sampler", None)
        while sampler is not None:
            mode = getattr(getattr(sampler, "shuffle", False), "value", None)  # a mindspore.dataset.Shuffle
            mode = getattr(sampler, "shuffle", False) if mode is None else mode  # or a bool
            shuffles = "Random" in type(sampler).__name__ or mode not in (False, None, "false")
            if shuffles and getattr(sampler, "reshuffle_each_epoch", True):
                return f"{type(sampler).__name__} of {name}"
            sampler = getattr(sampler, "child_sampler", None)
        todo.extend(getattr(node, "children", None) or [])
    return None


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
                 report_health: bool | None = None, run_dir: str | None = None, snapshot_every: int | None = None,
                 memory_root: str | None = None) -> None:
        super().__init__()
        self.snapshot_every = int(os.environ.get("CKPTD_SNAPSHOT_EVERY", "0")) if snapshot_every is None \
            else snapshot_every
        self.memory_root = memory_root
        self._flash = None
        #: where ModelCheckpoint must write (``<run-dir>/rank_<r>``): checked at train begin when known
        self.run_dir = run_dir or _launcher_run_dir()
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
        #: what restore() returned for a dataset it positioned: Model.train's first epoch must follow it
        self._initial_epoch: int | None = None
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
        shard = [s for s in answer.get("shards", []) if int(s["rank"]) == self.rank]
        if len(shard) != 1:
            raise RuntimeError(f"{resume_file}: the resume answer has {len(shard)} shards for rank {self.rank}")
        mine = shard[0]["path"]
        loaded = (_load_slot(mine, shard[0].get("digest")) if answer.get("tier") == "memory"
                  else ms.load_checkpoint(mine))
        for cell in cells:
            names = [p.name for p in cell.get_parameters()]  # type: ignore[attr-defined]
            missing = [n for n in names if n not in loaded]
            if missing:  # a checkpoint of another model must not leave this one half-overwritten
                raise RuntimeError(f"{mine} does not match {type(cell).__name__}: no {missing[:3]}")
        for cell in cells:
            ms.load_param_into_net(cell, loaded)
        step = self._saved_step(loaded, answer, mine)
        initial_epoch = 0
        if dataset is not None:
            per_epoch = int(dataset.get_dataset_size())  # type: ignore[attr-defined]
            initial_epoch, in_epoch = divmod(step, per_epoch)
            if in_epoch:
                dataset.set_init_step(in_epoch)  # type: ignore[attr-defined]  # skip what the epoch consumed
        self.resume_step, self.resumed_from = step, mine
        self._initial_epoch = initial_epoch if dataset is not None else None
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
        if _param(cb, "dataset_sink_mode"):
            # In sink mode step callbacks run once per sink (an epoch by default): heartbeats, save
            # commits and the restored step position are not per step, and none of it is tested
            # (Ascend only; MindSpore on CPU trains non-sink whatever was asked). Refused, not guessed.
            raise RuntimeError("CkptdCallback: dataset_sink_mode=True is not supported: ckptd's heartbeats, save "
                               "commits and exact resume need per-step callbacks; pass dataset_sink_mode=False "
                               "to Model.train")
        self._check_rank()
        # only when nothing else loads the checkpoint: with --resume-args / --resume-env (MindFormers'
        # load_checkpoint + resume_training) the job's own code resumes and restore() is not called
        if os.environ.get("CKPTD_RESUME_FILE") and os.environ.get("CKPTD_RESUME_BY") == "restore" \
                and self.resumed_from is None:
            raise _refuse("the launcher resumes this run ($CKPTD_RESUME_FILE) but restore() was not called: it "
                          "would train from step 0", "call initial_epoch = ckptd_cb.restore(dataset, net, optimizer) "
                          "before Model.train and pass initial_epoch=initial_epoch to it")
        self._check_checkpointing(cb)
        if (shuffle := _epoch_shuffle(_param(cb, "train_dataset"))) is not None:
            # not refused: the run resumes at the right step with the right weights, only the
            # batches of the resumed epochs differ from an uninterrupted run's
            log.warning("CkptdCallback: the training dataset reshuffles every epoch (%s): a resumed run sees "
                        "other batches than an uninterrupted one would (not bit-exact); for an exact resume "
                        "use shuffle=False or a shuffle that does not depend on the epoch", shuffle)
        if self.resume_step:
            cb.cur_step_num = self.resume_step
            for other in cb.list_callback:
                if isinstance(other, ModelCheckpoint):
                    other._last_triggered_step = self.resume_step  # noqa: SLF001 -- as MindSpore's own resume does

    def _check_checkpointing(self, cb) -> None:
        """What would leave the launcher nothing to resume from, or a resume it cannot load."""
        callbacks = list(_param(cb, "list_callback") or [])
        ckpts = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
        fix_dir = "ModelCheckpoint(directory=os.path.join(run_dir, f\"rank_{rank}\"), ...)"
        if not ckpts:
            raise _refuse("no ModelCheckpoint among Model.train's callbacks: nothing would be saved and every "
                          "restart would train from step 0", f"add {fix_dir} before CkptdCallback in callbacks")
        mine = next((i for i, c in enumerate(callbacks) if c is self), None)
        if mine is not None and mine < callbacks.index(ckpts[-1]):
            # callbacks run in list order: the save a step issues would be seen (and committed) a step
            # late, and the final one, issued in ModelCheckpoint's train end, after the exit marker
            raise _refuse("listed before ModelCheckpoint in callbacks: saves would be committed a step late, and "
                          "one issued at train end never", "list it after: callbacks=[ckpt, ckptd_cb, ...]")
        for ckpt in ckpts:
            config = ckpt._config  # noqa: SLF001 -- MindSpore keeps the CheckpointConfig there, no accessor
            # MindFormers' CheckpointMonitor(use_legacy_format=False) saves elsewhere, not through _directory;
            # a directory function is only called at each save
            directory = None if (getattr(ckpt, "_directory_func", None) or getattr(ckpt, "use_legacy_format", True)
                                 is False) else getattr(ckpt, "_directory", None)
            if self.run_dir and directory is not None:
                want = {os.path.realpath(d) for d in runlayout.rank_shard_dirs(self.run_dir, self.rank)}
                if os.path.realpath(directory) not in want:
                    mine_dir = runlayout.shard_dir(self.run_dir, self.rank)
                    raise _refuse(f"ModelCheckpoint writes into {directory}, not {mine_dir}: ckptd would never "
                                  f"find rank {self.rank}'s saves of this run",
                                  "pass directory=os.path.join(run_dir, f\"rank_{rank}\") to ModelCheckpoint, "
                                  "run_dir being ckptd launch's --run-dir")
            if config.integrated_save:
                # under model parallelism every rank's file would hold the gathered whole tensors, not its
                # shard: neither loadable as this rank's shard nor re-shardable. Under data parallelism it
                # changes nothing yet; refused alike, so that a later switch of parallel mode cannot break
                # resume silently (the README's checklist requires False)
                raise _refuse("ModelCheckpoint's CheckpointConfig has integrated_save=True: ranks would save merged "
                              "tensors, not their own shards", "pass integrated_save=False to CheckpointConfig")
            network = config.saved_network if config.saved_network is not None else _param(cb, "train_network")
            if ("step_num" not in (config.append_dict or {}) and network is not None
                    and "global_step" not in {p.name for p in network.get_parameters()}):
                # restore() learns the step a file holds from step_num, else the optimizer's global_step
                raise _refuse("ModelCheckpoint's files would hold no step (no \"step_num\" in append_info, no "
                              "optimizer global_step in the saved network): restore() could not resume them",
                              "pass append_info=[\"epoch_num\", \"step_num\"] to CheckpointConfig")

    def on_train_step_begin(self, run_context) -> None:
        cb = run_context.original_args()
        if self._first_step and self._initial_epoch is not None and int(cb.cur_epoch_num) != self._initial_epoch + 1:
            # Model.train's epoch is only known at its first step: still before anything trained; a
            # wrong epoch would replay (or skip) epochs and misname every save
            raise _refuse(f"Model.train starts at epoch {cb.cur_epoch_num}, but restore() resumed in epoch "
                          f"{self._initial_epoch + 1} (step {self.resume_step})",
                          "pass initial_epoch=initial_epoch (restore()'s return value) to Model.train")
        self._step = int(cb.cur_step_num)
        # the first step of an attempt compiles the graph: still "starting" for the launcher
        self._beat(self._step, "starting" if self._first_step else "compute")

    def on_train_step_end(self, run_context) -> None:
        cb = run_context.original_args()
        self._first_step = False
        self._step = int(cb.cur_step_num)
        self._beat(self._step, "sync")
        self._commit_new_saves(cb)
        if self.snapshot_every and self._step % self.snapshot_every == 0:
            self._snapshot(cb)
        if self.health.url:
            self._report(cb)

    def on_train_end(self, run_context) -> None:
        cb = run_context.original_args()
        self._beat(self._step, "finishing")
        self._commit_new_saves(cb)
        for t in self._committers.values():
            t.join()
        if self._flash is not None:
            self._flash.release()  # a clean end: the files are the run's resume point now
            self._flash = None
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

    def _snapshot(self, cb) -> None:
        """The memory tier: what the first ModelCheckpoint would save now, copied into shared memory."""
        from ckptd.integrations.flash import FlashWriter, MemoryTierUnavailable

        ckpt = next((c for c in cb.list_callback if isinstance(c, ModelCheckpoint)), None)
        if ckpt is None or self.snapshot_every < 0:
            return
        config = ckpt._config  # noqa: SLF001 -- MindSpore keeps the CheckpointConfig there, no accessor
        try:
            if self._flash is None:
                run_dir = self.run_dir or os.path.dirname(os.path.abspath(ckpt._directory))  # noqa: SLF001
                self._flash = FlashWriter(run_dir, self.rank, int(cb.device_number or 1),
                                          encrypted=config.enc_key is not None, root=self.memory_root)
            network = config.saved_network if config.saved_network is not None else cb.train_network
            tensors, values, order = _save_entries(network, ckpt, int(cb.cur_epoch_num), self._step)
            in_epoch = (self._step - 1) % int(cb.batch_num) + 1
            name = f"{ckpt._prefix}-{int(cb.cur_epoch_num)}_{in_epoch}.{config.format}"  # noqa: SLF001 -- as it names
            file = os.path.relpath(os.path.join(ckpt._directory, name), self._flash.run_dir)  # noqa: SLF001
            self._flash.snapshot(self._step, int(cb.cur_epoch_num), file, tensors, values, order)
        except MemoryTierUnavailable as exc:
            log.warning("CkptdCallback: %s", exc)
            self.snapshot_every = -1  # said once; the file saves go on

    def _report(self, cb) -> None:
        out = cb.net_outputs
        items = list(out) if isinstance(out, (tuple, list)) else [out]
        loss = _scalar(items[0]) if items else None
        if loss is None:
            return
        overflow = bool(_scalar(items[1])) if len(items) > 1 else False
        grad_norm = _scalar(items[4]) if len(items) > 4 else None  # MindFormers: loss, overflow, scale, lr, norm
        self.health.report(self._step, loss, grad_norm, overflow)



def _save_entries(network: object, ckpt: ModelCheckpoint, epoch: int, step: int) -> tuple[list, list, list]:
    """(tensors, values, names in file order) that ``ModelCheckpoint`` would save at this step:
    the network's parameters as ``save_checkpoint`` lists them, then its append entries."""
    tensors, seen = [], set()
    for _, param in network.parameters_and_names():  # type: ignore[attr-defined]
        if param.name in seen or param.param_info.is_pipeline_shared_param:
            continue
        seen.add(param.name)
        tensors.append((param.name, param.asnumpy()))
    append = dict(getattr(ckpt, "_append_dict", None) or {})
    if "epoch_num" in append:  # ModelCheckpoint._append_dict_content, at the time of its save
        append["epoch_num"] = getattr(ckpt, "_append_epoch_num", 0) + epoch
    if "step_num" in append:
        append["step_num"] = getattr(ckpt, "_append_step_num", 0) + step
    values = []
    for key, value in append.items():
        if hasattr(value, "asnumpy"):
            tensors.append((key, value.asnumpy()))
        else:
            values.append((key, value))
    return tensors, values, [n for n, _ in tensors[:len(seen)]] + list(append)


def _load_slot(path: str, verified: str | None) -> dict:
    """A memory-tier slot as ``mindspore.load_checkpoint`` would give the file: name -> Parameter
    (the digest and the commit word checked before anything is handed over; the digest is not
    computed again when the slot still carries the one its daemon ``verified``, as for
    :func:`ckptd.integrations.flash.load_into`)."""
    import numpy as np

    from ckptd.storage import memslot

    snap = memslot.open_snapshot(path, uid=os.geteuid())
    if snap is None or not (verified is not None and verified == snap.digest or snap.verify()):
        raise RuntimeError(f"{path}: holds no whole snapshot any more (overwritten?): resume from the files")
    try:
        out: dict = {}
        for e in snap.table.entries:
            if e.is_tensor:  # pread into an array of its own (a truncated slot is an error, not SIGBUS)
                data = np.empty(e.shape, dtype=e.dtype)
                snap.readinto(e, memoryview(data.reshape(-1).view(np.uint8)))
                out[e.name] = ms.Parameter(ms.Tensor.from_numpy(data), name=e.name)
        for e in snap.table.entries:
            if not e.is_tensor:
                out[e.name] = ms.Parameter(ms.Tensor(e.value), name=e.name)
        if not snap.still_committed():
            raise RuntimeError(f"{path}: overwritten while it was loaded: resume from the files")
        return out
    finally:
        snap.close()
