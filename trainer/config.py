"""Model / optimisation configuration and the parameter table derived from it (pure, no MindSpore)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from trainer.topology import Split


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the Llama-style decoder. Defaults train at a visible pace on 2 CPU cores."""

    vocab: int = 256  # byte-level tokens
    hidden: int = 64
    heads: int = 4
    ffn: int = 128
    layers: int = 2
    seq: int = 32
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check(self, tp: int) -> None:
        """Megatron sharding needs every split dimension to divide by tp."""
        if self.hidden % self.heads or self.head_dim % 2:
            raise ValueError("hidden must be heads * an even head_dim")
        for what, n in (("vocab", self.vocab), ("heads", self.heads), ("ffn", self.ffn)):
            if n % tp:
                raise ValueError(f"{what}={n} is not divisible by tp={tp}")


@dataclass(frozen=True)
class OptimConfig:
    """AdamWeightDecay (MindSpore semantics: no bias correction) + warmup/cosine + global-norm clip."""

    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 10
    total_steps: int = 200
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip: float = 1.0


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    split: Split
    init: str  # "normal" or "ones"
    decay: bool  # weight decay applies (not to norms)


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Every trainable parameter with its *full* shape, in a fixed order (the checkpoint order)."""
    h, f, v, qd = cfg.hidden, cfg.ffn, cfg.vocab, cfg.heads * cfg.head_dim
    specs = [ParamSpec("embed.weight", (v, h), "col", "normal", True)]
    for i in range(cfg.layers):
        p = f"layers.{i}."
        specs += [
            ParamSpec(p + "attn_norm.weight", (h,), "rep", "ones", False),
            ParamSpec(p + "attn.wq.weight", (qd, h), "col", "normal", True),
            ParamSpec(p + "attn.wk.weight", (qd, h), "col", "normal", True),
            ParamSpec(p + "attn.wv.weight", (qd, h), "col", "normal", True),
            ParamSpec(p + "attn.wo.weight", (h, qd), "row", "normal", True),
            ParamSpec(p + "mlp_norm.weight", (h,), "rep", "ones", False),
            ParamSpec(p + "mlp.w_gate.weight", (f, h), "col", "normal", True),
            ParamSpec(p + "mlp.w_up.weight", (f, h), "col", "normal", True),
            ParamSpec(p + "mlp.w_down.weight", (h, f), "row", "normal", True),
        ]
    specs += [
        ParamSpec("norm.weight", (h,), "rep", "ones", False),
        ParamSpec("head.weight", (v, h), "col", "normal", True),
    ]
    return specs


def full_init(spec: ParamSpec, seed: int) -> np.ndarray:
    """The unsharded initial value: a function of (seed, name) only, so every layout starts equal."""
    if spec.init == "ones":
        return np.ones(spec.shape, np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
    return (rng.standard_normal(spec.shape) * 0.02).astype(np.float32)


def lr_at(step: int, oc: OptimConfig) -> float:
    """Learning rate for optimizer step ``step`` (1-based): linear warmup, then cosine to min_lr."""
    import math

    if oc.warmup > 0 and step <= oc.warmup:
        return oc.lr * step / oc.warmup
    span = max(1, oc.total_steps - oc.warmup)
    t = min(1.0, (step - oc.warmup) / span)
    return oc.min_lr + 0.5 * (oc.lr - oc.min_lr) * (1.0 + math.cos(math.pi * t))
