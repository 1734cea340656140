"""Catalog schema (SQLAlchemy 2.x ORM). Changes go through an alembic migration in migrations/.

Hot tables (``shards``, ``checkpoints``) hold only what the resume oracle and the verifier query;
per-tensor detail never lives here. Rows are never deleted by verification — history matters
when someone asks "why did we resume from step 4200?".
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


#: columns widened to 64 bits after their table was created (migration 0007): SQLite's INTEGER already holds
#: 64 bits, and re-declaring the column there would mean a table rebuild that drops its triggers
#: (migration 0002), so only PostgreSQL's columns were widened to BIGINT
WideInteger = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def as_utc(dt: datetime) -> datetime:
    """A timestamp read from the catalog, zone-aware: SQLite drops the zone (values are stored in
    UTC), PostgreSQL keeps it."""
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


class Base(DeclarativeBase):
    pass


class Run(Base):
    """A training run: one directory under the checkpoint root."""

    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    path: Mapped[str] = mapped_column(Text)
    world_size: Mapped[int | None] = mapped_column(Integer)  # from the strategy file or configuration
    # native | mindformers (ckptd.runlayout); NULL on rows from before migration 0005 (native)
    layout: Mapped[str | None] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    checkpoints: Mapped[list["Checkpoint"]] = relationship(back_populates="run")


class StrategyFile(Base):
    __tablename__ = "strategy_files"
    # one row per content seen at a path: a job restarted on a new layout overwrites its strategy
    # file, and the steps saved under the old layout must keep the layout they were saved with
    __table_args__ = (UniqueConstraint("run_id", "path", "content_hash"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    path: Mapped[str] = mapped_column(Text)
    content_hash: Mapped[str] = mapped_column(String(80), index=True)
    format: Mapped[str] = mapped_column(String(16))
    world_size: Mapped[int] = mapped_column(Integer)
    stages: Mapped[int] = mapped_column(Integer, default=1)
    error: Mapped[str | None] = mapped_column(Text)  # set when the file does not parse
    content: Mapped[bytes | None] = mapped_column(LargeBinary)  # the file as seen (strategy files are small)
    seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # the file's mtime when this content was first seen at this path (again, if the file went back
    # to it): a shard written at or after it was saved under this layout (states.layout_resave).
    # The trainer's clock, not ckptd's. NULL on rows from before migration 0004 (seen_at is used).
    mtime_ns: Mapped[int | None] = mapped_column(BigInteger)


class Checkpoint(Base):
    """One save of a run: all ranks' shards of (prefix, epoch, step) — or a derived (converted) copy."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("run_id", "prefix", "epoch", "step", "kind", "layout"),
        Index("ix_checkpoints_run_state_order", "run_id", "state", "epoch", "step"),  # the resume query
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    prefix: Mapped[str] = mapped_column(String(255))
    # epoch and step from the file name: any number ckptd.runnames lets through fits (migration 0007)
    epoch: Mapped[int] = mapped_column(WideInteger)
    step: Mapped[int] = mapped_column(BigInteger)
    # trained | breakpoint | converted | superseded (history: shards an older layout left, see ckptd.states)
    kind: Mapped[str] = mapped_column(String(16), default="trained")
    # converted copies: the target strategy hash; superseded history: the old one
    #: the strategy hash a copy is in ("" for saved steps: their strategy is ``strategy_id``'s); the
    #: column keeps its historic name ``layout`` -- "layout" in ckptd's names is a run's directory shape
    strategy_hash: Mapped[str] = mapped_column("layout", String(80), default="")
    global_step: Mapped[int | None] = mapped_column(BigInteger)  # from the files' content once verified
    # which restart of the job wrote it (the ``_k`` of MindSpore's renamed prefix, 0 for the first;
    # ckptd.runnames.parse_shard_name); NULL = names don't say (breakpoint saves, converted copies)
    incarnation: Mapped[int | None] = mapped_column(WideInteger)
    # the job's own health record calls this step abnormal (MindFormers' health_ckpts.json): why
    health_reason: Mapped[str | None] = mapped_column(Text)
    # a step whole only as the union of its files: JSON {rank: [ranks whose files hold its slices]}
    load_plan: Mapped[str | None] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), index=True)
    expected_ranks: Mapped[int | None] = mapped_column(Integer)
    strategy_id: Mapped[int | None] = mapped_column(ForeignKey("strategy_files.id"))
    step_checks_ok: Mapped[bool | None] = mapped_column(Boolean)
    reason: Mapped[str | None] = mapped_column(Text)  # why not verified (first failure)
    derived_from_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id"))
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    marked_bad: Mapped[bool] = mapped_column(Boolean, default=False)
    bad_reason: Mapped[str | None] = mapped_column(Text)
    # a resume answer or a conversion leases the step: retention must not delete it meanwhile
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)
    run: Mapped[Run] = relationship(back_populates="checkpoints")
    shards: Mapped[list["Shard"]] = relationship(back_populates="checkpoint")


class Shard(Base):
    """One rank's file of one checkpoint."""

    __tablename__ = "shards"
    __table_args__ = (
        Index("ix_shards_checkpoint_rank", "checkpoint_id", "rank"),
        Index("ix_shards_state_verified_at", "state", "verified_at"),  # the background scrub's oldest-first query
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text, unique=True)
    size: Mapped[int] = mapped_column(BigInteger)
    mtime_ns: Mapped[int] = mapped_column(BigInteger)
    inode: Mapped[int] = mapped_column(BigInteger)
    digest: Mapped[str | None] = mapped_column(String(64))  # fast content digest (xxh3-128) at ingest
    state: Mapped[str] = mapped_column(String(16), index=True)
    format: Mapped[str | None] = mapped_column(String(16))
    encryption: Mapped[str | None] = mapped_column(String(16))
    crc: Mapped[str | None] = mapped_column(String(16))  # valid | invalid | absent | unchecked
    global_step: Mapped[int | None] = mapped_column(BigInteger)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error: Mapped[str | None] = mapped_column(Text)
    quarantined: Mapped[bool] = mapped_column(Boolean, default=False)
    verified_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # bumped when a verification starts (and when the file changes): only the newest-started
    # verification may store its result, so a slow, older read never overwrites a newer verdict
    verify_seq: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # the node whose daemon sees the file (docs/ARCHITECTURE.md, Nodes): only it judges the file.
    # NULL on rows from before migration 0006: claimed by the first node whose rescan sees the file.
    node: Mapped[str | None] = mapped_column(String(255), index=True)
    claimed_by: Mapped[str | None] = mapped_column(String(255))  # the node verifying it right now
    # what the step check found in this file (JSON, ckptd.service.stepcheck.ShardFacts), keyed by
    # the verification and the layout it was checked against
    facts: Mapped[str | None] = mapped_column(Text)
    # the configuration the verdict depended on (Settings.verification_stamp): key, CRC and
    # encryption policies; another configuration re-verifies instead of trusting the verdict
    verified_config: Mapped[str | None] = mapped_column(String(32))
    checkpoint: Mapped[Checkpoint] = relationship(back_populates="shards")


class ShardCopy(Base):
    """A copy of one rank's shard of a step on a tier other than the file tier
    (``ckptd.states.Tier``; the file tier's copy is the shard row itself). Keyed by step and rank,
    not by shard row: a memory-tier snapshot of a step the job never saved to files has no shard
    row. ``location`` is a URI the tier's backend understands
    (``memory://<node>/<run>/rank_<r>/slot_<k>``, ``s3://<bucket>/<key>``)."""

    __tablename__ = "shard_copies"
    __table_args__ = (
        UniqueConstraint("checkpoint_id", "rank", "tier", "location"),
        Index("ix_shard_copies_tier_state", "tier", "state"),  # a tier's scrub and retention
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    tier: Mapped[str] = mapped_column(String(16))
    location: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))  # a ckptd.states.ShardState value
    size: Mapped[int | None] = mapped_column(BigInteger)
    digest: Mapped[str | None] = mapped_column(String(64))  # xxh3-128 of the copy's bytes
    node: Mapped[str | None] = mapped_column(String(255))  # the node that holds (memory) or wrote (object) it
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    verified_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Node(Base):
    """A daemon's node: it owns the files it sees; silent past ``node_timeout`` = unreachable."""

    __tablename__ = "nodes"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    pid: Mapped[int | None] = mapped_column(Integer)
    root: Mapped[str | None] = mapped_column(Text)


class VerificationEvent(Base):
    """Append-only log of every verification outcome (the evidence behind a state)."""

    __tablename__ = "verification_events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id"), index=True)
    shard_id: Mapped[int | None] = mapped_column(ForeignKey("shards.id"), index=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    kind: Mapped[str] = mapped_column(String(32))  # shard | step | rescan
    outcome: Mapped[str] = mapped_column(String(16))
    detail: Mapped[str | None] = mapped_column(Text)
    seconds: Mapped[float | None] = mapped_column(Float)


class StepHealth(Base):
    """Per-step training health reported by the trainer (used by the resume oracle)."""

    __tablename__ = "step_health"
    __table_args__ = (UniqueConstraint("run_id", "step"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    step: Mapped[int] = mapped_column(BigInteger)
    loss: Mapped[float | None] = mapped_column(Float)
    grad_norm: Mapped[float | None] = mapped_column(Float)
    # SQLite stores NaN as NULL, and NaN/inf is exactly what matters here: keep it explicitly
    loss_nonfinite: Mapped[str | None] = mapped_column(String(8))  # "nan" | "inf" | "-inf"
    grad_norm_nonfinite: Mapped[str | None] = mapped_column(String(8))
    overflow: Mapped[bool] = mapped_column(Boolean, default=False)
    reported_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ResumeGeneration(Base):
    """A per-run counter bumped by database triggers (migration 0002) on every catalog change that
    can change a resume answer; cached answers are reused only while it is unchanged. Written only
    by the triggers. No foreign key on purpose: a trigger must never make a write fail."""

    __tablename__ = "resume_generations"
    run_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    generation: Mapped[int] = mapped_column(BigInteger)
    bumped_by: Mapped[int | None] = mapped_column(BigInteger)  # PostgreSQL: the last bumping transaction id


class Job(Base):
    """A background job (re-verification, conversion, gc) with progress, visible over the API."""

    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))  # verify | convert | gc
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id"))
    state: Mapped[str] = mapped_column(String(16))  # queued | running | done | failed
    total: Mapped[int] = mapped_column(Integer, default=0)
    done: Mapped[int] = mapped_column(Integer, default=0)
    params: Mapped[str | None] = mapped_column(Text)  # JSON
    result: Mapped[str | None] = mapped_column(Text)  # JSON
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)


class ConversionJob(Base):
    """A re-sharding job and the lineage of what it produced."""

    __tablename__ = "conversion_jobs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id"))
    source_checkpoint_id: Mapped[int] = mapped_column(ForeignKey("checkpoints.id"))
    output_checkpoint_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id"))
    source_strategy_hash: Mapped[str | None] = mapped_column(String(80))
    target_strategy_hash: Mapped[str | None] = mapped_column(String(80))
    out_dir: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)
