"""Per-rank async checkpoints, the strategy file, and exact restore.

On-disk contract (what the ckptd daemon watches):
``<run_dir>/rank_<r>/<prefix>-<epoch>_<step>.ckpt`` written by ``mindspore.save_checkpoint(...,
async_save=True, integrated_save=False, crc_check=<not encrypted>)`` with this rank's slices of the
weights and the AdamW moments, and ``append_dict`` = step_num, epoch_num, rank_id, tp, dp, data
position and RNG state; ``<shard>.done`` (JSON size + xxh3_128) once the async write finished;
``<run_dir>/strategy.ckpt`` in MindSpore's protobuf strategy format describing exactly those
slices (moments share their weight's layout).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass

import xxhash

from ckptd.format.atomic import atomic_write
from ckptd.format.strategy import ParamStrategy, Strategy, save_strategy
from trainer.config import ParamSpec
from trainer.data import STATE_KEYS
from trainer.topology import Topology, layout_for

STRATEGY_NAME = "strategy.ckpt"


def shard_path(run_dir: str, rank: int, prefix: str, epoch: int, step: int) -> str:
    return os.path.join(run_dir, f"rank_{rank}", f"{prefix}-{epoch}_{step}.ckpt")


def build_strategy(specs: list[ParamSpec], topo: Topology) -> Strategy:
    """Layouts of every saved tensor: weights and their ``adam_m.`` / ``adam_v.`` moments."""
    entries = []
    for prefix in ("", "adam_m.", "adam_v."):
        for s in specs:
            entries.append(ParamStrategy(prefix + s.name, layout_for(s.split, len(s.shape), topo)))
    return Strategy.build(entries)


def write_strategy(run_dir: str, specs: list[ParamSpec], topo: Topology) -> str:
    """Write (or rewrite, identical content) ``<run_dir>/strategy.ckpt``; MindSpore chmods its own 0600."""
    path = os.path.join(run_dir, STRATEGY_NAME)
    save_strategy(build_strategy(specs, topo), path, overwrite=True)
    return path


def write_sidecar(path: str) -> None:
    """Commit hint for the daemon: the finished shard's size and xxh3_128 digest."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    doc = {"size": os.path.getsize(path), "xxh3_128": h.hexdigest()}
    with atomic_write(path + ".done", overwrite=True) as out:
        out.write(json.dumps(doc).encode())


def _find_save_thread() -> threading.Thread | None:
    for t in threading.enumerate():
        if t.name == "asyn_save_ckpt":  # the name MindSpore gives its async-save thread
            return t
    return None


class CheckpointWriter:
    """Issues async saves; a small committer thread writes each sidecar the moment MindSpore's write
    thread finishes (not at the next step: a rank killed right after a finished save still leaves a
    committed shard)."""

    def __init__(self, run_dir: str, topo: Topology, prefix: str, enc_key: bytes | None) -> None:
        self.run_dir, self.topo, self.prefix, self.enc_key = run_dir, topo, prefix, enc_key
        self.committer: threading.Thread | None = None
        os.makedirs(os.path.join(run_dir, f"rank_{topo.rank}"), exist_ok=True)

    def save(self, items: list[tuple[str, object]], step: int, epoch: int, extra: dict[str, object],
             async_save: bool = True) -> str:
        import mindspore as ms

        self.wait()  # MindSpore itself would wait for the previous async write before starting this one
        path = shard_path(self.run_dir, self.topo.rank, self.prefix, epoch, step)
        append = {"step_num": int(step), "epoch_num": int(epoch), "rank_id": int(self.topo.rank),
                  "tp": int(self.topo.tp), "dp": int(self.topo.dp), **extra}
        kwargs = {"enc_key": self.enc_key} if self.enc_key else {"crc_check": True}
        ms.save_checkpoint([{"name": n, "data": d} for n, d in items], path, integrated_save=False,
                           async_save=async_save, append_dict=append, **kwargs)
        writer = _find_save_thread() if async_save else None
        self.committer = threading.Thread(target=_commit, args=(path, writer), name="ckpt-sidecar", daemon=True)
        self.committer.start()
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

    A shard saved under another tp/dp is accepted only as a re-sharded copy made for this job
    (ckptd's converter): its ``rank_id`` is this rank and every tensor has exactly this job's shape.
    The converter copies the other metadata (tp, dp, step, data position) from a source rank, so
    tp/dp then name the layout the step was trained with, not this one.
    """
    import mindspore as ms

    kwargs = {"dec_key": dec_key} if dec_key else {}
    loaded = ms.load_checkpoint(path, **kwargs)
    rank_id = int(loaded["rank_id"].asnumpy())
    saved_tp, saved_dp = int(loaded["tp"].asnumpy()), int(loaded["dp"].asnumpy())
    if rank_id != topo.rank:
        raise RuntimeError(f"{path} belongs to rank {rank_id} (tp={saved_tp}, dp={saved_dp}), "
                           f"not to rank {topo.rank} of tp={topo.tp} dp={topo.dp}")
    meta = {"step_num", "epoch_num", "rank_id", "tp", "dp", *STATE_KEYS}
    missing = [n for n in targets if n not in loaded]
    extra = [n for n in loaded if n not in targets and n not in meta]
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
