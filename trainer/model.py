"""A Llama-style decoder whose parameters are this rank's Megatron slices.

Embedding and LM head are vocab-parallel, q/k/v and gate/up column-parallel, o and down
row-parallel, RMSNorm weights replicated. Weights are stored (out, in) like ``nn.Dense``. Each rank
creates only its slice, cut from the layout-independent full init with ckptd's own
``slice_for_rank`` -- the same function the strategy file is checked against -- so "what a rank
holds" and "what the strategy says it holds" cannot drift apart.

The forward pass is a plain function over a name->Parameter dict (differentiated with
``mindspore.value_and_grad``) so that checkpoint names are exactly the names in :func:`param_specs`.
"""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import ops

from ckptd.format.layout import local_shape, slice_for_rank
from trainer.config import ModelConfig, ParamSpec, full_init, param_specs
from trainer.parallel import Comm
from trainer.topology import Topology, layout_for


def local_slice(spec: ParamSpec, full: np.ndarray, topo: Topology) -> np.ndarray:
    """This rank's part of ``full`` according to the layout written in the strategy file."""
    layout = layout_for(spec.split, len(spec.shape), topo)
    return np.ascontiguousarray(full[slice_for_rank(layout, spec.shape, topo.rank).index])


def local_shape_of(spec: ParamSpec, topo: Topology) -> tuple[int, ...]:
    return local_shape(layout_for(spec.split, len(spec.shape), topo), spec.shape)


def _rope_tables(cfg: ModelConfig) -> tuple[ms.Tensor, ms.Tensor]:
    half = cfg.head_dim // 2
    inv = 1.0 / (cfg.rope_base ** (np.arange(half, dtype=np.float64) / half))
    ang = np.outer(np.arange(cfg.seq, dtype=np.float64), inv)  # (S, half)
    return ms.Tensor(np.cos(ang).astype(np.float32)), ms.Tensor(np.sin(ang).astype(np.float32))


class Llama:
    """Parameters (this rank's slices) + the sharded forward pass."""

    def __init__(self, cfg: ModelConfig, topo: Topology, comm: Comm, seed: int) -> None:
        cfg.check(topo.tp)
        self.cfg, self.topo, self.comm = cfg, topo, comm
        self.specs = param_specs(cfg)
        self.params: dict[str, ms.Parameter] = {
            s.name: ms.Parameter(ms.Tensor(local_slice(s, full_init(s, seed), topo)), name=s.name) for s in self.specs
        }
        self.copy_in = comm.copy_to_tp()
        self.reduce_out = comm.reduce_from_tp()
        self.gather_vocab = comm.gather_last_from_tp()
        self.local_heads = cfg.heads // topo.tp
        self.vocab_start = topo.tp_index * (cfg.vocab // topo.tp)
        self.local_vocab = cfg.vocab // topo.tp
        self.cos, self.sin = _rope_tables(cfg)
        causal = np.triu(np.full((cfg.seq, cfg.seq), -1e9, np.float32), k=1)
        self.causal = ms.Tensor(causal)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        # MatMul/matmul on CPU costs ~10x more per call than dense/BatchMatMul (measured), so use those
        self.bmm_qk = ops.BatchMatMul(transpose_b=True)
        self.bmm = ops.BatchMatMul()

    # --- tensor-parallel helpers -----------------------------------------------------------------

    def _f(self, x):
        return self.copy_in(x) if self.copy_in is not None else x

    def _g(self, x):
        return self.reduce_out(x) if self.reduce_out is not None else x

    # --- layers --------------------------------------------------------------------------------

    def _rmsnorm(self, x, w):
        var = (x * x).sum(-1, keepdims=True) * (1.0 / self.cfg.hidden)
        return x * ops.rsqrt(var + self.cfg.norm_eps) * w

    def _embed(self, ids):
        table = self.params["embed.weight"]
        if self.topo.tp == 1:
            return ops.gather(table, ids, 0)
        local = ids - self.vocab_start
        mask = ops.logical_and(local >= 0, local < self.local_vocab)
        safe = ops.where(mask, local, ops.zeros_like(local))
        out = ops.gather(table, safe, 0) * ops.expand_dims(mask.astype(ms.float32), -1)
        return self._g(out)

    def _rope(self, x):  # x: (B, h, S, d)
        half = self.cfg.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return ops.cat([x1 * self.cos - x2 * self.sin, x1 * self.sin + x2 * self.cos], -1)

    def _attention(self, x, p):
        b, s, _ = x.shape
        h, d = self.local_heads, self.cfg.head_dim
        xin = self._f(x)

        def heads(w):
            return ops.transpose(ops.dense(xin, w).reshape(b, s, h, d), (0, 2, 1, 3))

        q = self._rope(heads(self.params[p + "attn.wq.weight"]))
        k = self._rope(heads(self.params[p + "attn.wk.weight"]))
        v = heads(self.params[p + "attn.wv.weight"])
        scores = self.bmm_qk(q, k) * self.scale + self.causal
        att = self.bmm(ops.softmax(scores, -1), v)
        att = ops.transpose(att, (0, 2, 1, 3)).reshape(b, s, h * d)
        return self._g(ops.dense(att, self.params[p + "attn.wo.weight"]))

    def _mlp(self, x, p):
        xin = self._f(x)
        gate = ops.dense(xin, self.params[p + "mlp.w_gate.weight"])
        up = ops.dense(xin, self.params[p + "mlp.w_up.weight"])
        return self._g(ops.dense(ops.silu(gate) * up, self.params[p + "mlp.w_down.weight"]))

    def loss(self, ids, onehot):
        """Mean next-token cross-entropy over this rank's micro-batch (full-vocab logits).

        ``onehot`` (tokens, vocab) float32 targets: ``log_softmax * onehot`` is far cheaper on MindSpore
        CPU than ``ops.cross_entropy`` / ``nll_loss`` (measured ~10x), and exactly as deterministic.
        """
        x = self._embed(ids)
        for i in range(self.cfg.layers):
            p = f"layers.{i}."
            x = x + self._attention(self._rmsnorm(x, self.params[p + "attn_norm.weight"]), p)
            x = x + self._mlp(self._rmsnorm(x, self.params[p + "mlp_norm.weight"]), p)
        x = self._rmsnorm(x, self.params["norm.weight"])
        logits = ops.dense(self._f(x), self.params["head.weight"])  # (B, S, V/tp)
        if self.gather_vocab is not None:
            logits = self.gather_vocab(logits)
        b, s, v = logits.shape
        logp = ops.log_softmax(logits.reshape(b * s, v), -1)
        return (logp * onehot).sum() * (-1.0 / (b * s))
