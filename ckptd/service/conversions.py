"""Conversions of catalogued checkpoints, registered as derived checkpoints with lineage.

``convert_step`` re-shards one verified step of a run (through :mod:`ckptd.convert`, which writes
atomically and verifies every slice) into ``<root>/<run>/converted/<step>-<target hash>/`` — a
place the watcher never mistakes for training shards — and records the result as a ``converted``
checkpoint (``derived_from_id`` → the source step; target strategy registered) plus a
``conversion_jobs`` row holding both strategy hashes. The resume oracle then serves it to a job
restarting on the target layout. The source step is leased while it is being read.
"""

from __future__ import annotations

import os
import shutil
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from ckptd.catalog import repo
from ckptd.catalog.models import Checkpoint, ConversionJob, Shard, StrategyFile
from ckptd.errors import CkptdError
from ckptd.format.strategy import Strategy, load_strategy, parse_strategy_bytes, save_strategy
from ckptd.service.catalog import InvalidRequestError, _iso, get_run, get_step
from ckptd.service.verifier import file_digest, stat_of
from ckptd.states import ShardState, StepState

CONVERT_LEASE = timedelta(hours=2)


def check_source(s: Session, run_name: str, step: int) -> tuple[Checkpoint, dict[int, str], StrategyFile | None]:
    run = get_run(s, run_name)
    ckpt = get_step(s, run, step)
    if ckpt.state != StepState.VERIFIED.value:
        raise InvalidRequestError(
            f"step {step} of run {run_name!r} is {ckpt.state}, not verified",
            hint="convert a restorable step (see `ckptd ls RUN --state verified`)",
        )
    files = dict(s.execute(select(Shard.rank, Shard.path).where(
        Shard.checkpoint_id == ckpt.id, Shard.state == ShardState.VERIFIED.value)).all())
    strategy = s.get(StrategyFile, ckpt.strategy_id) if ckpt.strategy_id else None
    return ckpt, files, strategy


def resolve_target(src: Strategy | None, to_strategy: str | None, to_layout: str | None) -> Strategy | None:
    if (to_strategy is None) == (to_layout is None):
        raise InvalidRequestError("give exactly one of to_strategy / to_layout")
    if to_layout is not None:
        from ckptd.convert import derive_strategy, parse_layout_spec

        if src is None:
            raise InvalidRequestError("to_layout needs a source strategy file", hint="use to_strategy")
        return derive_strategy(src, **parse_layout_spec(to_layout))
    return None if to_strategy == "none" else load_strategy(to_strategy)


def convert_step(
    sessions: sessionmaker[Session],
    root: str,
    run_name: str,
    step: int,
    *,
    to_strategy: str | None = None,
    to_layout: str | None = None,
    out_dir: str | None = None,
    key: bytes | None = None,
    out_key: bytes | None = None,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    from ckptd.convert import convert, plan_conversion
    from ckptd.convert.execute import read_inventory

    with sessions.begin() as s:
        ckpt, files, strat_row = check_source(s, run_name, step)
        if strat_row is None:
            raise InvalidRequestError(f"step {step} has no strategy file in the catalog", hint="convert with --src-strategy")
        src_id, src_path, src_hash, src_content = ckpt.id, strat_row.path, strat_row.content_hash, strat_row.content
        ckpt.lease_until = datetime.now(timezone.utc) + CONVERT_LEASE
        meta = (ckpt.run_id, ckpt.prefix, ckpt.epoch, ckpt.step, ckpt.global_step)
    # the strategy the step was saved with, as catalogued (the file may have been overwritten since)
    src_strategy = parse_strategy_bytes(src_content, src_path) if src_content is not None else load_strategy(src_path)
    target = resolve_target(src_strategy, to_strategy, to_layout)
    target_hash = target.content_hash() if target is not None else "none"
    out = out_dir or os.path.join(root, run_name, "converted", f"{meta[3]}-{target_hash.split(':')[-1][:12]}")
    with sessions.begin() as s:
        reused = _intact_copy(s, src_id, target_hash, out)
        if reused is not None:  # converting the same step into the same layout again: it is done
            s.get(Checkpoint, src_id).lease_until = None
            return reused
    plan = plan_conversion(read_inventory(files, key), src_strategy, target)
    with sessions.begin() as s:
        job = ConversionJob(run_id=meta[0], source_checkpoint_id=src_id, source_strategy_hash=src_hash,
                            target_strategy_hash=target_hash, out_dir=out, state="running")
        s.add(job)
        s.flush()
        job_id = job.id
    try:
        report = convert(None, src_strategy, target, out, plan=plan, key=key, out_key=out_key,
                         workers=workers, progress=progress)
        strategy_path = os.path.join(out, "strategy.ckpt") if target is not None else None
        if target is not None and not os.path.exists(strategy_path):
            save_strategy(target, strategy_path)
        derived = _register(sessions, meta, src_id, target, target_hash, strategy_path, report)
    except BaseException as exc:
        with sessions.begin() as s:
            row = s.get(ConversionJob, job_id)
            row.state, row.error = "failed", (str(exc) if isinstance(exc, CkptdError) else exc.__class__.__name__)
        raise
    finally:
        with sessions.begin() as s:
            src = s.get(Checkpoint, src_id)
            if src is not None:
                src.lease_until = None
    with sessions.begin() as s:
        row = s.get(ConversionJob, job_id)
        row.state, row.progress, row.output_checkpoint_id = "done", 1.0, derived
        return conversion_dict(row, s) | {"report": report.to_dict(), "reused": False}


def _intact_copy(s: Session, src_id: int, target_hash: str, out: str) -> dict[str, Any] | None:
    """The finished conversion of this step into this layout at ``out``, if its files are still
    the ones catalogued (converted copies are not watched, so check size/mtime/inode here)."""
    copy = s.execute(select(Checkpoint).where(
        Checkpoint.derived_from_id == src_id, Checkpoint.kind == "converted", Checkpoint.layout == target_hash,
        Checkpoint.state == StepState.VERIFIED.value)).scalars().first()
    if copy is None:
        return None
    job = s.execute(select(ConversionJob).where(
        ConversionJob.output_checkpoint_id == copy.id, ConversionJob.state == "done", ConversionJob.out_dir == out,
    ).order_by(ConversionJob.id.desc())).scalars().first()
    if job is None:
        return None
    shards = s.execute(select(Shard.path, Shard.size, Shard.mtime_ns, Shard.inode).where(Shard.checkpoint_id == copy.id)).all()
    if not shards or any(stat_of(p) != repo.FileStat(size, mtime, inode) for p, size, mtime, inode in shards):
        return None  # changed or gone: converting again will say what is in the way
    return conversion_dict(job, s) | {"reused": True}


def _register(sessions, meta, src_id, target, target_hash, strategy_path, report) -> int:  # noqa: ANN001
    run_id, prefix, epoch, step, global_step = meta
    now = datetime.now(timezone.utc)
    with sessions.begin() as s:
        strat_id = None
        if strategy_path is not None:
            run = s.get(repo.Run, run_id)
            with open(strategy_path, "rb") as fh:
                content = fh.read()
            strat_id = repo.upsert_strategy(s, run, strategy_path, target_hash, target.format, target.world_size,
                                            target.stages, None, content).id
        ckpt = Checkpoint(run_id=run_id, prefix=prefix, epoch=epoch, step=step, kind="converted", layout=target_hash,
                          global_step=global_step, state=StepState.VERIFIED.value,
                          expected_ranks=target.world_size if target is not None else 1, strategy_id=strat_id, step_checks_ok=True,
                          derived_from_id=src_id, pinned=False, marked_bad=False, created_at=now, updated_at=now)
        s.add(ckpt)
        s.flush()
        for rank in report.ranks:
            st = stat_of(rank.path)
            s.add(Shard(checkpoint_id=ckpt.id, rank=rank.rank, path=rank.path, size=st.size, mtime_ns=st.mtime_ns,
                        inode=st.inode, digest=file_digest(rank.path), state=ShardState.VERIFIED.value,
                        format=report.out_format, encryption="AES-GCM" if report.encrypted else None,
                        crc="valid" if not report.encrypted else "absent", global_step=global_step,
                        quarantined=False, verified_at=now, seen_at=now))
        repo.add_event(s, ckpt.id, None, "step", "ok", f"converted from checkpoint {src_id}; every slice re-read and verified")
        return ckpt.id


def conversion_dict(row: ConversionJob, s: Session) -> dict[str, Any]:
    src = s.get(Checkpoint, row.source_checkpoint_id)
    return {
        "id": row.id,
        "state": row.state,
        "source_step": src.step if src else None,
        "source_strategy_hash": row.source_strategy_hash,
        "target_strategy_hash": row.target_strategy_hash,
        "out_dir": row.out_dir,
        "output_checkpoint_id": row.output_checkpoint_id,
        "error": row.error,
        "created_at": _iso(row.created_at),
    }


def list_conversions(s: Session, run_name: str) -> list[dict[str, Any]]:
    run = get_run(s, run_name)
    rows = s.execute(select(ConversionJob).where(ConversionJob.run_id == run.id).order_by(ConversionJob.id.desc())).scalars()
    return [conversion_dict(r, s) for r in rows]


def delete_derived(s: Session, ckpt_id: int, root: str) -> list[str]:
    """Rows and files of the converted copies of a step that retention is deleting."""
    from ckptd.service.retention import _inside, delete_checkpoint_rows

    removed = []
    for copy in s.execute(select(Checkpoint).where(Checkpoint.derived_from_id == ckpt_id)).scalars().all():
        dirs = {os.path.dirname(os.path.dirname(p)) for p in s.execute(
            select(Shard.path).where(Shard.checkpoint_id == copy.id)).scalars()}
        for d in dirs:
            if _inside(root, d) and os.path.isdir(d):
                shutil.rmtree(d)
                removed.append(d)
        s.execute(ConversionJob.__table__.delete().where(ConversionJob.output_checkpoint_id == copy.id))
        delete_checkpoint_rows(s, copy.id)
    s.execute(ConversionJob.__table__.delete().where(ConversionJob.source_checkpoint_id == ckpt_id))
    return removed
