"""Elastic restart for ckptd's trainer: the shared machinery is :mod:`ckptd.launcher.elastic` (also
``ckptd launch --layout``'s); what is the trainer's own is the target strategy -- the hash of the
strategy file the trainer will write for its tp/dp (same model arguments, same rule as
:func:`trainer.checkpoint.build_strategy`; ckptd's ``--to-layout`` derivation yields the identical
strategy, so the hashes are comparable)."""

from __future__ import annotations

from collections.abc import Callable

from ckptd.launcher import elastic
from ckptd.launcher.elastic import in_other_layout  # noqa: F401 -- re-exported: trainer.launch imports it from here
from ckptd.launcher.oracle import ResumeAnswer, ask_http
from ckptd.split import ParallelSplit


def job_strategy_hash(tp: int, dp: int, train_args: list[str]) -> str:
    """The content hash of the strategy file the trainer will write for this job (raises ValueError when
    the model cannot be split tp ways)."""
    from trainer.checkpoint import build_strategy
    from trainer.config import ModelConfig, param_specs
    from trainer.topology import Topology
    from trainer.train import build_parser

    extra = [a for a in train_args if a != "--"]
    targs, _ = build_parser().parse_known_args(["--run-dir", ".", *extra])
    cfg = ModelConfig(hidden=targs.hidden, heads=targs.heads, ffn=targs.ffn, layers=targs.layers, seq=targs.seq)
    cfg.check(tp)
    return build_strategy(param_specs(cfg), Topology(tp, dp, 0)).content_hash()


def resume_converted(url: str, run: str, tp: int, dp: int, target_hash: str, answer: ResumeAnswer,
                     timeout: float, log: Callable[..., None]) -> ResumeAnswer:
    """:func:`ckptd.launcher.elastic.resume_converted` for the trainer's ``tp x dp``: ckptd is asked
    for the answered step's copy of exactly the strategy the trainer will write (``strategy_hash``)."""
    split = ParallelSplit(tp, dp)

    def reask(step: int) -> ResumeAnswer:
        return ask_http(url, run, split.world, world_size=split.world, strategy_hash=target_hash, max_step=step)

    return elastic.resume_converted(url, run, split, target_hash, reask(int(answer.step or 0)), timeout, log, reask)
