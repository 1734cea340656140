"""Megatron tensor-parallel communication on MindSpore CPU (PyNative), with hand-written backward.

What MindSpore 2.10 CPU offers (checked under msrun, see tests and the report):

* ``AllReduce`` (sum) works on the world group *and* on sub-groups made by ``create_group``, and
  MindSpore differentiates it (backward = AllReduce of the gradient).
* ``AllGather`` only runs on the world group on CPU ("AllGather only support mccl_world_group on
  CPU"), and its automatic backward needs ``ReduceScatter``, which has no CPU kernel at all. So the
  gather along the tp axis is an AllReduce of a zero-padded tensor (exact: each element is one
  rank's value plus zeros) with a custom backward that just slices this rank's part.

The three Megatron operators are cells with a ``bprop`` so their backward is the conjugate
collective (f: identity / all-reduce, g: all-reduce / identity). With tp == 1 they are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
from mindspore import nn, ops

from trainer.topology import Topology


class CopyToTP(nn.Cell):
    """Megatron ``f``: forward identity, backward all-reduce over the tp group."""

    def __init__(self, allreduce: ops.AllReduce) -> None:
        super().__init__()
        self.allreduce = allreduce

    def construct(self, x):
        return ops.identity(x)

    def bprop(self, x, out, dout):
        return (self.allreduce(dout),)


class ReduceFromTP(nn.Cell):
    """Megatron ``g``: forward all-reduce over the tp group, backward identity."""

    def __init__(self, allreduce: ops.AllReduce) -> None:
        super().__init__()
        self.allreduce = allreduce

    def construct(self, x):
        return self.allreduce(x)

    def bprop(self, x, out, dout):
        return (ops.identity(dout),)


class GatherLastFromTP(nn.Cell):
    """All-gather along the last dim over tp (zero-padded all-reduce); backward = own slice."""

    def __init__(self, allreduce: ops.AllReduce, tp: int, tp_index: int) -> None:
        super().__init__()
        self.allreduce = allreduce
        self.tp = tp
        self.tp_index = tp_index

    def construct(self, x):
        k = x.shape[-1]
        parts = []
        if self.tp_index > 0:
            parts.append(ops.zeros(x.shape[:-1] + (k * self.tp_index,), x.dtype))
        parts.append(x)
        if self.tp_index < self.tp - 1:
            parts.append(ops.zeros(x.shape[:-1] + (k * (self.tp - 1 - self.tp_index),), x.dtype))
        return self.allreduce(ops.cat(parts, -1))

    def bprop(self, x, out, dout):
        k = x.shape[-1]
        return (dout[..., self.tp_index * k:(self.tp_index + 1) * k],)


@dataclass
class Comm:
    """The collectives one rank uses; ``None`` members mean the group has a single rank."""

    topo: Topology
    tp_allreduce: ops.AllReduce | None
    dp_allreduce: ops.AllReduce | None

    def copy_to_tp(self):
        return CopyToTP(self.tp_allreduce) if self.tp_allreduce is not None else None

    def reduce_from_tp(self):
        return ReduceFromTP(self.tp_allreduce) if self.tp_allreduce is not None else None

    def gather_last_from_tp(self):
        if self.tp_allreduce is None:
            return None
        return GatherLastFromTP(self.tp_allreduce, self.topo.tp, self.topo.tp_index)


def make_comm(topo: Topology, distributed: bool) -> Comm:
    """Create this rank's tp and dp groups (only the groups it belongs to, as MindSpore requires)."""
    if not distributed or topo.world == 1:
        return Comm(topo, None, None)
    from mindspore.communication import GlobalComm, create_group

    world = GlobalComm.WORLD_COMM_GROUP  # "mccl_world_group" on CPU after init()
    tp_ar = dp_ar = None
    if topo.tp > 1:
        name = world if topo.dp == 1 else f"tp_{topo.dp_index}"
        if topo.dp > 1:
            create_group(name, topo.tp_ranks)
        tp_ar = ops.AllReduce(group=name)
    if topo.dp > 1:
        name = world if topo.tp == 1 else f"dp_{topo.tp_index}"
        if topo.tp > 1:
            create_group(name, topo.dp_ranks)
        dp_ar = ops.AllReduce(group=name)
    return Comm(topo, tp_ar, dp_ar)


def prime_numpy_bridge() -> None:
    """Absorb MindSpore 2.10's failed NumPy-1.x C-API import under NumPy 2.

    MindSpore's C extension lazily calls ``import_array`` on the first PyNative op that parses
    Python arguments; under NumPy 2 that import fails ("A module that was compiled using NumPy 1.x
    cannot be run in NumPy 2..."), logs "Numpy init failed" and leaves a Python exception set, so
    the *first* tensor op raises ``SystemError``. Every later op works (the bridge is only used for
    numpy-typed arguments, which the trainer never passes to ops). Running one throwaway op here
    makes the failure happen at a known place; with NumPy 1.x this is a no-op.
    """
    try:
        ms.Tensor(1.0) * ms.Tensor(1.0)
    except SystemError:
        pass
