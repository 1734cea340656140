"""Request and response bodies: the documented, stable JSON of the API (served as OpenAPI)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ShardRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rank: int
    path: str


class SubsetShardRef(ShardRef):
    """A rank of a step that is whole only as the union of its files (remove_redundancy, dying-gasp saves)."""

    own_file: bool = Field(description="false when the rank has no file of its own: ``path`` is a replica's")
    load_from: list[str] = Field(description="every file holding the rank's slices")


class MindFormersResume(BaseModel):
    load_checkpoint: str = Field(description="MindFormers' load_checkpoint: the directory holding rank_<r>/")
    resume_training: str | None = Field(description="MindFormers' resume_training: the file name (rank 0's; "
                                                    "MindFormers substitutes each rank's _rank_<r>)")
    loadable_by_mindformers: bool = Field(description="every rank has a file of its own (else load per shards[].load_from)")
    remove_redundancy: bool = Field(description="each rank's file holds only its share: load with remove_redundancy=True")


class Skipped(BaseModel):
    step: int
    reason: str


class ConversionInfo(BaseModel):
    needed: bool
    from_world_size: int | None
    to_world_size: int | None = Field(description="null when only a strategy_hash was asked for and no copy exists")
    existing: dict[str, Any] | None = Field(description="a ready converted copy: {shards, strategy_file}, or null")
    hint: str | None = None


class ResumeAnswer(BaseModel):
    run: str
    step: int = Field(description="training step to resume at (global step when the files record it)")
    epoch: int
    global_step: int | None
    name_step: int = Field(description="the step in the shard file names")
    prefix: str
    incarnation: int | None = Field(description="which restart into the run's directory wrote it (MindSpore's _k "
                                                "prefix suffix); null when the file names do not say")
    layout: str = Field(description="native (<run>/rank_<r>/) or mindformers (<run>/checkpoint/rank_<r>/)")
    world_size: int | None
    strategy_file: str | None
    strategy_hash: str | None
    shards: list[ShardRef | SubsetShardRef] = Field(description="the file each rank loads (one verified shard per rank)")
    skipped: list[Skipped] = Field(description="newer steps that were passed over, newest first, with why")
    conversion: ConversionInfo | None = Field(description="set when a target world size was asked and differs")
    mindformers: MindFormersResume | None = Field(description="MindFormers runs: what its own resume needs to load "
                                                              "exactly this step")


class HealthReport(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: int = Field(ge=0)
    loss: float | None = Field(default=None, description="NaN/inf allowed (send as JSON NaN/Infinity or strings)")
    grad_norm: float | None = None
    overflow: bool = False


class MarkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str | None = Field(default=None, max_length=2000)


class VerifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: int | None = Field(default=None, ge=0, description="one step, or every step of the run when omitted")


class GcRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keep_last: int | None = Field(default=5, ge=1)
    keep_every: int | None = Field(default=None, ge=1)
    dry_run: bool = True


class RunOut(_Out):
    name: str
    path: str
    layout: str | None = None
    world_size: int | None
    steps: dict[str, int]
    latest_restorable_step: int | None


class StepOut(_Out):
    step: int
    epoch: int
    incarnation: int | None = None
    kind: str
    global_step: int | None
    state: str
    restorable: bool
    expected_ranks: int | None
    reason: str | None
    marked_bad: bool
    pinned: bool
    strategy_file: str | None


class JobOut(_Out):
    id: int
    kind: str
    state: str
    total: int
    done: int
    progress: float


class ConversionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: int = Field(ge=0, description="a verified step of the run")
    to_layout: str | None = Field(default=None, pattern=r"^[a-z]+=\d+(,[a-z]+=\d+)*$",
                                  description="derive the target from the source strategy: tp=..,dp=..[,pp=..]")
    to_strategy: str | None = Field(default=None, description="a strategy file inside the checkpoint root, or 'none'")
