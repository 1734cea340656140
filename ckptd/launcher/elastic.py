"""Elastic restart: resume a job whose layout differs from the checkpoint's, from ckptd's re-sharded copy.

Shared by ``ckptd launch --layout`` (:mod:`ckptd.launcher.command`) and ckptd's trainer
(``trainer.launch`` via ``trainer.elastic``). Two ways the newest restorable step can be in another
layout than the relaunched job:

* another world size (a node lost, nodes added): ckptd's resume answer says so (``world_size``) and,
  asked with ``?world_size=W``, points at a ready converted copy for that world size;
* the same world size in another layout (tp=2,dp=2 -> tp=4,dp=1): ckptd's oracle compares world
  sizes only, so the launcher compares strategies -- the trainer with the hash of the strategy it
  will write, ``ckptd launch`` with the strategy ckptd's ``--to-layout`` rule derives from the saved
  one for the declared layout (:func:`conversion_target`).

Either way the launcher uses a converted copy whose strategy hash is exactly the job's -- the
oracle's, or one listed by ``GET /v1/runs/{run}/conversions`` -- or has ckptd make one
(``POST /conversions`` with ``tp=..,dp=..``, admin token) and waits for it (bounded). It never hands
the job shards of another layout, and never starts fresh over them: failures raise ConversionError.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from ckptd import runlayout
from ckptd.launcher.oracle import ConversionError, ResumeAnswer, list_conversions, request_conversion, wait_for_job


@dataclass(frozen=True)
class Layout:
    """A job's parallel layout as ckptd's ``--to-layout`` spells it."""
    tp: int
    dp: int
    pp: int | None = None

    @property
    def world(self) -> int:
        return self.tp * self.dp * (self.pp or 1)

    def __str__(self) -> str:
        return f"tp={self.tp},dp={self.dp}" + (f",pp={self.pp}" if self.pp is not None else "")


@dataclass(frozen=True)
class Target:
    """What the answered step must be re-sharded to for the job's declared layout."""
    #: the copy's strategy hash; None when only ckptd can tell (see :func:`conversion_target`)
    hash: str | None
    why: str


def conversion_target(answer: ResumeAnswer, layout: Layout) -> Target | None:
    """What the answered step must be re-sharded to for a job declaring ``layout``, or None when the
    step is already in that layout (or is nothing ckptd converts: no step, or a Checkpoint 2.0
    iteration, which MindFormers re-shards itself).

    The target is what ckptd's conversion of ``to_layout=<layout>`` derives from the saved strategy
    (:func:`ckptd.convert.derive_strategy`), so its hash is the one ckptd records for the copy. The
    saved strategy is read from the answer's ``strategy_file``; a job restarted in another layout may
    have overwritten that file since, and then only ckptd (which keeps the content each step was
    saved with) can derive the target: ``Target(None, ...)``, the conversion is requested as is."""
    body = answer.body or {}
    if answer.step is None or body.get("world_size") is None:
        return None
    from ckptd.convert.layouts import derive_strategy, same_placement
    from ckptd.errors import CkptdError
    from ckptd.format.strategy import load_strategy

    from_world = answer.saved_world or layout.world
    other_world = f"newest restorable step was saved with world size {from_world}"
    path = body.get("strategy_file")
    if not path:
        if answer.saved_world is None:
            return None  # data parallel without a strategy file: every rank holds everything
        raise ConversionError(f"step {answer.step} was saved with world size {answer.saved_world} and ckptd has no "
                              f"strategy file for it, so it cannot be re-sharded for {layout} (put the job's "
                              f"strategy file in the run directory, or launch with world size {answer.saved_world})")
    try:
        saved = load_strategy(path)
    except (CkptdError, OSError):
        saved = None
    if saved is None or (body.get("strategy_hash") and saved.content_hash() != body["strategy_hash"]):
        changed = f"{path} has changed since step {answer.step} was saved"
        return Target(None, f"{other_world}; {changed}, so ckptd derives the target from the strategy it catalogued"
                      if answer.saved_world else
                      f"{changed}: its layout cannot be compared here, so ckptd re-shards it from the strategy it "
                      f"catalogued (a copy it already has is reused)")
    try:
        target = derive_strategy(saved, layout.tp, layout.dp, layout.pp)
    except CkptdError as err:
        raise ConversionError(f"step {answer.step} cannot be re-sharded for the declared layout {layout}: {err.message}"
                              f" ({err.hint or 'convert it with ckptd convert --to-strategy'})") from None
    if answer.saved_world is None and same_placement(saved, target):
        return None
    h = target.content_hash()
    return Target(h, other_world if answer.saved_world else
                  f"newest restorable step was saved in another layout (strategy {short(body.get('strategy_hash'))}, "
                  f"this job's {short(h)})")


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


def listed_copy(conversion: dict, answer: ResumeAnswer, world: int, target_hash: str) -> ResumeAnswer | None:
    """A finished conversion (``GET /conversions`` row or a conversion job's result) of the answered step
    into this job's layout, read from its output directory (``<out>/rank_<r>/<name>.ckpt``, one file per
    rank: the converter's documented output), or None if it is not that or its files are gone."""
    if (conversion.get("state") != "done" or conversion.get("source_step") != name_step(answer)
            or conversion.get("target_strategy_hash") != target_hash or not conversion.get("out_dir")):
        return None
    out = str(conversion["out_dir"])
    shards = []
    for rank in range(world):
        files = glob.glob(os.path.join(runlayout.shard_dir(out, rank), "*.ckpt"))
        if len(files) != 1:
            return None  # deleted (retention) or not a complete conversion: ask for a new one
        shards.append({"rank": rank, "path": files[0]})
    strategy = runlayout.converted_strategy_path(out)
    return _converted(answer, world, target_hash, shards, strategy if os.path.exists(strategy) else None,
                      f"re-sharded copy (conversion {conversion.get('id')})")


def resume_converted(url: str, run: str, layout: Layout, target_hash: str | None, answer: ResumeAnswer,
                     timeout: float, log: Callable[..., None], why: str | None = None) -> ResumeAnswer:
    """The resume answer for ``answer``'s step (asked with ``?world_size=`` this job's) re-sharded for
    this job: a ready copy, or a new one. ``target_hash`` None: the copy's strategy is whatever ckptd
    derives for ``layout`` (nothing to pick a ready copy by: ckptd reuses an intact one itself)."""
    world = layout.world
    from_world = answer.saved_world or world
    if target_hash is not None:
        ready = oracle_copy(answer, world, target_hash)
        if ready is None:
            ready = next((c for c in (listed_copy(row, answer, world, target_hash)
                                      for row in list_conversions(url, run)) if c is not None), None)
        if ready is not None:
            log(event="convert_existing", step=answer.step, from_world=from_world, to_world=world, layout=layout,
                reason="ckptd already has this step re-sharded for the job's layout")
            return ready
    if why is None:
        saved_hash = (answer.body or {}).get("strategy_hash")
        why = (f"newest restorable step was saved with world size {from_world}" if from_world != world else
               f"newest restorable step was saved in another layout (strategy {short(saved_hash)}, "
               f"this job's {short(target_hash)})")
    log(event="convert_requested", step=answer.step, from_world=from_world, to_world=world, layout=layout, reason=why)
    t0 = time.monotonic()
    job_id = request_conversion(url, run, name_step(answer), str(layout))
    job = wait_for_job(url, job_id, timeout)
    result = job.get("result") if isinstance(job.get("result"), dict) else {}
    want = target_hash if target_hash is not None else result.get("target_strategy_hash")
    ready = listed_copy(result, answer, world, want) if want else None
    if ready is None:
        raise ConversionError(f"conversion job {job_id} of step {answer.step} finished, but its output is not a "
                              f"{world}-rank copy with this job's strategy {short(want)} "
                              f"(got {short(result.get('target_strategy_hash'))} in {result.get('out_dir')})")
    log(event="convert_done", step=answer.step, from_world=from_world, to_world=world, job=job_id,
        waited=f"{time.monotonic() - t0:.1f}s", out=result.get("out_dir"))
    return ready
