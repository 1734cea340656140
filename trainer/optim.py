"""AdamWeightDecay over sharded parameters, with global-norm clipping across the tp group.

MindSpore's ``nn.AdamWeightDecay`` semantics (no bias correction, decoupled weight decay), written
with MindSpore ops so the moments are ordinary Parameters named ``adam_m.<name>`` / ``adam_v.<name>``
-- the names checkpoints and the strategy file use, with the weight's own layout.

The global gradient norm must equal the unsharded model's: squared norms of tp-split gradients are
summed over the tp group, replicated gradients (RMSNorm weights, identical on every tp rank) are
counted once. Data-parallel gradients are averaged over the dp group before anything else, so every
replica applies the identical update.
"""

from __future__ import annotations

import math

import mindspore as ms
from mindspore import ops

from trainer.config import OptimConfig, ParamSpec
from trainer.parallel import Comm


class AdamW:
    def __init__(self, params: dict[str, ms.Parameter], specs: list[ParamSpec], oc: OptimConfig, comm: Comm) -> None:
        self.params, self.oc, self.comm = params, oc, comm
        self.specs = {s.name: s for s in specs}
        self.names = [s.name for s in specs]
        self.m = {n: ms.Parameter(ops.zeros_like(p), name="adam_m." + n) for n, p in params.items()}
        self.v = {n: ms.Parameter(ops.zeros_like(p), name="adam_v." + n) for n, p in params.items()}

    def state_items(self) -> list[tuple[str, ms.Parameter]]:
        """Moments in checkpoint order (all m, then all v)."""
        return [("adam_m." + n, self.m[n]) for n in self.names] + [("adam_v." + n, self.v[n]) for n in self.names]

    def reduce_grads(self, grads: list[ms.Tensor]) -> list[ms.Tensor]:
        """Average over dp (sum via AllReduce, then divide: identical on every replica)."""
        if self.comm.dp_allreduce is None:
            return grads
        inv = 1.0 / self.comm.topo.dp
        return [self.comm.dp_allreduce(g) * inv for g in grads]

    def global_norm(self, grads: list[ms.Tensor]) -> float:
        split, rep = [], []
        for n, g in zip(self.names, grads):
            (rep if self.specs[n].split == "rep" else split).append(ops.sum(g * g))
        sq = ops.addn(split)
        if self.comm.tp_allreduce is not None:
            sq = self.comm.tp_allreduce(sq)
        if rep:
            sq = sq + ops.addn(rep)
        return float(ops.sqrt(sq).asnumpy())

    def step(self, grads: list[ms.Tensor], lr: float) -> tuple[float, bool]:
        """Clip, update in place; returns (grad_norm, overflow). A non-finite norm skips the update."""
        norm = self.global_norm(grads)
        if not math.isfinite(norm):
            return norm, True
        oc = self.oc
        scale = min(1.0, oc.clip / (norm + 1e-6))
        lr_t = ms.Tensor(lr, ms.float32)
        for n, g in zip(self.names, grads):
            p, m, v = self.params[n], self.m[n], self.v[n]
            if scale < 1.0:
                g = g * scale
            m_new = m * oc.beta1 + g * (1.0 - oc.beta1)
            v_new = v * oc.beta2 + ops.square(g) * (1.0 - oc.beta2)
            update = m_new / (ops.sqrt(v_new) + oc.eps)
            if self.specs[n].decay and oc.weight_decay:
                update = update + p * oc.weight_decay
            ops.assign(m, m_new)
            ops.assign(v, v_new)
            ops.assign(p, p - update * lr_t)
        return norm, False
