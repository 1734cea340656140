"""The trainer's memory tier (flash checkpoints, :mod:`ckptd.integrations.flash`): a snapshot of
exactly what a file save at that step would hold -- the same tensors, the same append entries in
the same order, named as that file would be -- so the daemon can persist it as that very file.

On the CPU a parameter's ``asnumpy()`` is a view of its memory: a snapshot copies from it and a
restore copies into it, one memcpy each way.
"""

from __future__ import annotations

import os

from ckptd.integrations.flash import FlashWriter, load_into
from trainer.checkpoint import CheckpointWriter, Restored
from trainer.data import STATE_KEYS
from trainer.topology import Topology


def snapshot(flash: FlashWriter, writer: CheckpointWriter, items: list[tuple[str, object]], step: int,
             data_epoch: int, extra: dict[str, object], pad: list | None = None) -> float:
    """Copy this rank's state at ``step`` into its free slot; returns the seconds training waited.
    ``pad``: extra (name, array) entries (the trainer's fault injection only)."""
    path, epoch, _, append = writer.append_for(step, data_epoch, extra)
    tensors = [(name, p.asnumpy()) for name, p in items] + list(pad or [])  # type: ignore[attr-defined]
    values = []
    for key, value in append.items():
        if hasattr(value, "asnumpy"):
            tensors.append((key, value.asnumpy()))  # MindFormers' global_step is a tensor
        else:
            values.append((key, value))
    order = [name for name, _ in items] + [name for name, _ in pad or []] + list(append)
    return flash.snapshot(step, epoch, os.path.relpath(path, writer.run_dir), tensors, values, order)


def load_snapshot(path: str, topo: Topology, targets: dict[str, object], verified: str | None = None) -> Restored:
    """Restore this rank's state from its slot (checked of this model before a byte is copied;
    ``verified``: the digest the daemon checked, see :func:`~ckptd.integrations.flash.load_into`)."""
    table = load_into(path, {name: p.asnumpy() for name, p in targets.items()},  # type: ignore[attr-defined]
                      verified=verified)
    if table.rank != topo.rank or table.world_size != topo.tp * topo.dp:
        raise RuntimeError(f"{path} holds rank {table.rank} of a world of {table.world_size}, not rank {topo.rank} "
                           f"of tp={topo.tp} dp={topo.dp}")
    values = {e.name: e.value for e in table.entries if not e.is_tensor}
    return Restored(step=int(values["step_num"]), epoch=int(values["epoch_num"]),
                    data_state={k: int(values[k]) for k in STATE_KEYS})
