"""Elastic restart: resume a job whose split differs from the checkpoint's, from ckptd's re-sharded copy.

Shared by ``ckptd launch --layout`` (:mod:`ckptd.launcher.command`) and ckptd's trainer
(``trainer.launch`` via ``trainer.elastic``). The newest restorable step can be in another split
than the relaunched job: another world size (a node lost, nodes added), or the same world size
split otherwise (tp=2,dp=2 -> tp=4,dp=1). ckptd knows which: asked with the job's split
(``?split=tp=..,dp=..``), its answer's ``conversion`` block says whether the step must be
re-sharded, to which strategy hash (derived from the strategy the step was saved with, as ckptd
catalogued it), and where a ready copy of exactly that layout is; the trainer, which knows the
hash of the strategy it will write, asks with ``?strategy_hash=`` instead.

The launcher derives nothing and lists no directory: it uses the copy ckptd offers, or has ckptd
make one (``POST /conversions`` with the split, admin token), waits for it (bounded) and asks
again. It never hands the job shards of another layout, and never starts fresh over them:
failures raise ConversionError.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ckptd.launcher.oracle import ConversionError, ResumeAnswer, request_conversion, wait_for_job
from ckptd.split import ParallelSplit

#: asks ckptd the same question again, for the newest restorable step at or before the given one
Reask = Callable[[int], ResumeAnswer]


def in_other_layout(answer: ResumeAnswer, target_hash: str | None) -> bool:
    """The answered step was saved with another world size, or with another strategy than this job's."""
    if answer.step is None:
        return False
    if answer.saved_world is not None:
        return True
    saved_hash = (answer.body or {}).get("strategy_hash")
    return bool(target_hash and saved_hash and saved_hash != target_hash)


def name_step(answer: ResumeAnswer) -> int:
    """The step as ckptd's step endpoints and conversions name it (the file name's step)."""
    named = (answer.body or {}).get("name_step")
    return int(named) if named is not None else int(answer.step or 0)


def short(h: str | None) -> str:
    return (h or "?").split(":")[-1][:12]


def _converted(answer: ResumeAnswer, world: int, target_hash: str, shards: list[dict], strategy_file: str | None,
               how: str) -> ResumeAnswer:
    """The resume answer pointing at a converted copy (ranks checked: exactly 0..world-1)."""
    try:
        ranks = sorted(int(s["rank"]) for s in shards)
    except (KeyError, TypeError, ValueError) as err:
        raise ConversionError(f"ckptd's converted copy of step {answer.step} is malformed ({err!r})") from None
    if ranks != list(range(world)):
        raise ConversionError(f"ckptd's converted copy of step {answer.step} covers ranks {ranks}, the job has {world}")
    assert answer.body is not None
    from_world = answer.saved_world or world
    # the mindformers block names the source's directory and file: a job given it would load the
    # shards of the old layout, so the converted answer has none (templates then use the copy's)
    body = dict(answer.body, shards=sorted(shards, key=lambda s: int(s["rank"])), strategy_file=strategy_file,
                world_size=world, strategy_hash=target_hash, converted_from_world_size=from_world,
                converted_from_strategy_hash=answer.body.get("strategy_hash"), mindformers=None)
    why = (f"ckptd: {how} of step {answer.step} (world size {from_world} -> {world}, "
           f"strategy {short(answer.body.get('strategy_hash'))} -> {short(target_hash)})")
    return ResumeAnswer(answer.step, body, why, from_world, answer.conversion)


def oracle_copy(answer: ResumeAnswer, world: int, target_hash: str) -> ResumeAnswer | None:
    """The oracle's ready copy (``conversion.existing``), if it is in exactly this job's layout: ckptd
    picks it by world size only, and tp=1,dp=2 and tp=2,dp=1 both have 2 ranks."""
    existing = (answer.conversion or {}).get("existing")
    if not isinstance(existing, dict) or existing.get("strategy_hash") != target_hash:
        return None
    return _converted(answer, world, target_hash, existing.get("shards") or [], existing.get("strategy_file"),
                      "re-sharded copy")


def resume_converted(url: str, run: str, split: ParallelSplit, target_hash: str | None, answer: ResumeAnswer,
                     timeout: float, log: Callable[..., None], reask: Reask) -> ResumeAnswer:
    """The resume answer for ``answer``'s step re-sharded for a job of ``split``: the ready copy
    ckptd offers (``conversion.existing`` of exactly ``target_hash``; None: the hash ckptd derived
    for the split, ``conversion.target_strategy_hash``), or a new one ckptd makes, after which
    ``reask(step)`` asks again and ckptd offers it."""
    world = split.world
    from_world = answer.saved_world or world
    conversion = answer.conversion or {}
    if conversion.get("impossible"):
        raise ConversionError(f"step {answer.step} {conversion['impossible']}")
    target_hash = target_hash or conversion.get("target_strategy_hash")
    if not target_hash:
        raise ConversionError(f"ckptd did not say which layout step {answer.step} must be re-sharded to for {split}")
    ready = oracle_copy(answer, world, target_hash)
    if ready is not None:
        log(event="convert_existing", step=answer.step, from_world=from_world, to_world=world, layout=split,
            reason="ckptd already has this step re-sharded for the job's layout")
        return ready
    saved_hash = (answer.body or {}).get("strategy_hash")
    why = (f"newest restorable step was saved with world size {from_world}" if from_world != world else
           f"newest restorable step was saved in another layout (strategy {short(saved_hash)}, "
           f"this job's {short(target_hash)})")
    log(event="convert_requested", step=answer.step, from_world=from_world, to_world=world, layout=split, reason=why)
    t0 = time.monotonic()
    job_id = request_conversion(url, run, name_step(answer), str(split))
    job = wait_for_job(url, job_id, timeout)
    result = job.get("result") if isinstance(job.get("result"), dict) else {}
    again = reask(int(answer.step or 0))
    ready = oracle_copy(again, world, target_hash) if again.step == answer.step else None
    if ready is None:
        raise ConversionError(f"conversion job {job_id} of step {answer.step} finished, but ckptd offers no "
                              f"{world}-rank copy with this job's strategy {short(target_hash)} "
                              f"(the job made {short(result.get('target_strategy_hash'))} in {result.get('out_dir')})")
    log(event="convert_done", step=answer.step, from_world=from_world, to_world=world, job=job_id,
        waited=f"{time.monotonic() - t0:.1f}s", out=result.get("out_dir"))
    return ready
