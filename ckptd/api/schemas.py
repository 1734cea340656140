"""Request and response bodies: the documented, stable JSON of the API (served as OpenAPI)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ShardRef(BaseModel):
    rank: int
    path: str


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
    world_size: int | None
    strategy_file: str | None
    strategy_hash: str | None
    shards: list[ShardRef] = Field(description="one verified shard per rank")
    skipped: list[Skipped] = Field(description="newer steps that were passed over, newest first, with why")
    conversion: ConversionInfo | None = Field(description="set when a target world size was asked and differs")


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
    world_size: int | None
    steps: dict[str, int]
    latest_restorable_step: int | None


class StepOut(_Out):
    step: int
    epoch: int
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
