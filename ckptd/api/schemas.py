"""Request and response bodies: the documented, stable JSON of the API (served as OpenAPI)."""

from __future__ import annotations

from typing import Literal, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ckptd.split import MAX_WORLD_SIZE

#: bounds of what the catalog stores (steps BIGINT, ids and counts INTEGER on PostgreSQL)
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
#: integers in JSON bodies: at most 2^53 - 1, the largest every JSON implementation (JavaScript,
#: schema validators parsing numbers as doubles) holds exactly; path and query values are text and
#: go up to INT64_MAX
JSON_INT_MAX = 2**53 - 1

#: Text from a client: never a NUL character (PostgreSQL text cannot hold one, and no path, reason
#: or name has one). Written as a pattern so the OpenAPI document says it too.
Text = Annotated[str, Field(pattern=r"^[^\x00]*$")]
StepNumber = Annotated[int, Field(ge=0, le=JSON_INT_MAX)]
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]


class _Out(BaseModel):
    model_config = ConfigDict(extra="allow")


class ShardRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rank: int
    path: str
    node: str | None = Field(description="the node whose daemon saw the file (null: catalogued before nodes existed)")


class SubsetShardRef(ShardRef):
    """A rank of a step that is whole only as the union of its files (remove_redundancy, dying-gasp saves)."""

    own_file: bool = Field(description="false when the rank has no file of its own: ``path`` is a replica's")
    load_from: list[str] = Field(description="every file holding the rank's slices")


class IterationFileRef(ShardRef):
    """A file of a Checkpoint 2.0 iteration (``rank`` is its number in the iteration, see ``role``)."""

    role: str = Field(description="model | opt | common | metadata")


class MemorySlotRef(ShardRef):
    """A rank's snapshot in its node's shared memory (the memory tier): ``path`` is the slot file."""

    location: str = Field(description="memory://<node>/<run key>/rank_<r>/slot_<k>")
    tier: str = Field(description="memory")


class ObjectRef(ShardRef):
    """A rank's object on the object tier: ``path`` is where its file belongs under the run's
    directory (``ckptd fetch`` / the launcher download it there, checked against the manifest)."""

    location: str = Field(description="s3://<bucket>/<prefix>/<run>/<step>/<run-relative path>")
    tier: Literal["object"] = Field(description="object")


class TrackerInfo(BaseModel):
    path: str
    iteration: int | None = Field(description="what latest_checkpointed_iteration.txt names (null: nothing usable)")
    agrees: bool = Field(description="MindFormers, trusting the tracker, would load the answered iteration")
    note: str


class MindFormersResume(BaseModel):
    load_checkpoint: str = Field(description="MindFormers' load_checkpoint: the directory holding rank_<r>/ "
                                             "(legacy), or the answered iteration_<it>/ directory (Checkpoint 2.0)")
    resume_training: str | bool | None = Field(description="MindFormers' resume_training: the file name (legacy; "
                                                           "rank 0's, MindFormers substitutes each rank's _rank_<r>), "
                                                           "or true (Checkpoint 2.0)")
    checkpoint_dir: str | None = Field(default=None, description="Checkpoint 2.0: the directory holding the tracker "
                                                                 "and iteration_<it>/ (load from it after --repair-tracker)")
    tracker: TrackerInfo | None = Field(default=None, description="Checkpoint 2.0: what the commit record says")
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
    target_strategy_hash: str | None = Field(default=None, description="asked with split=: the strategy hash of the "
                                                                       "copy this split needs (its conversion's target)")
    impossible: str | None = Field(default=None, description="asked with split=: why no conversion can make it")


class ResumeAnswer(BaseModel):
    run: str
    step: int = Field(description="training step to resume at (global step when the files record it)")
    epoch: int
    global_step: int | None
    name_step: int = Field(description="the step in the shard file names")
    prefix: str
    incarnation: int | None = Field(description="which restart into the run's directory wrote it (MindSpore's _k "
                                                "prefix suffix); null when the file names do not say")
    layout: str = Field(description="native (<run>/rank_<r>/), mindformers (<run>/checkpoint/rank_<r>/) or "
                                    "mindformers2 (Checkpoint 2.0: <run>/checkpoint/iteration_<it>/)")
    world_size: int | None
    strategy_file: str | None
    strategy_hash: str | None
    reason: str | None = Field(default=None, description="what the chosen step's checks could not prove although its "
                                                         "files verified (\"layout unchecked: <why>\"); null normally")
    tier: str = Field(default="file", description="where the answer is loaded from: file (the shard files), memory "
                                                  "(each rank's slot in its node's shared memory: restore() loads it) "
                                                  "or object (the files are gone; fetch them from the object tier)")
    files_whole: bool | None = Field(default=None, description="memory answers: whether the step's files are whole "
                                                               "too (a fallback if a slot is lost)")
    manifest: str | None = Field(default=None, description="object answers: the step's manifest (s3:// URI)")
    shards: list[ObjectRef | MemorySlotRef | ShardRef | SubsetShardRef | IterationFileRef] = Field(
        description="what each rank loads: one verified shard per rank, or its memory slot")
    unreachable_nodes: list[str] = Field(description="nodes holding shards of this step whose daemon is silent: their "
                                                     "files were verified but cannot be seen now (exclude_unreachable=true "
                                                     "answers the newest step without them)")
    skipped: list[Skipped] = Field(description="newer steps that were passed over, newest first, with why")
    split: str | None = Field(default=None, description="the split asked (?split=), echoed; null when none was")
    conversion: ConversionInfo | None = Field(description="set when a target world size, strategy hash or split "
                                                          "was asked and the step is not in it")
    mindformers: MindFormersResume | None = Field(description="MindFormers runs: what its own resume needs to load "
                                                              "exactly this step")


class HealthReport(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: StepNumber
    loss: float | None = Field(default=None, description="NaN/inf allowed (send as JSON NaN/Infinity or strings)")
    grad_norm: float | None = None
    overflow: bool = False

    @field_validator("loss", "grad_norm", mode="before")
    @classmethod
    def _not_a_bool(cls, v: object) -> object:
        # pydantic's lax mode reads true/false as 1.0/0.0; a boolean loss is a client bug, not a loss
        if isinstance(v, bool):
            raise ValueError("a number (or NaN/Infinity), not a boolean")
        return v


class HealthCleared(BaseModel):
    run: str
    from_step: int | None = Field(description="records at or after this step were removed (null: all of them)")
    removed: int = Field(description="health records removed")
    nonfinite_removed: int = Field(description="of which a NaN/inf loss (those rule steps out of resume answers)")


class MarkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: Text | None = Field(default=None, max_length=2000)


class VerifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: StepNumber | None = Field(default=None, description="one step, or every step of the run when omitted")


class GcRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keep_last: Count | None = 5
    keep_every: Count | None = None
    dry_run: bool = True


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")
    code: str = Field(description="machine-readable: invalid_request, invalid_run_name, unauthorized, forbidden, "
                                  "not_found, no_restorable_step, conflict, payload_too_large, ...")
    message: str
    hint: str | None = None
    skipped: list[Skipped] | None = Field(default=None, description="no_restorable_step: the steps passed over, with why")
    unjudged: list[int] | None = Field(default=None, description="no_restorable_step: skipped steps whose verification "
                                                                 "has not finished (they may still become restorable)")
    unjudged_unreachable: dict[str, list[str]] | None = Field(
        default=None, description="no_restorable_step: skipped steps awaiting a verdict only from nodes whose daemon is "
                                  "silent: step -> those nodes")


class ErrorOut(BaseModel):
    """Every error answer: ``{"detail": {code, message, hint}}``."""

    detail: ErrorDetail


class RunOut(_Out):
    name: str
    path: str
    layout: str | None = None
    world_size: int | None
    steps: dict[str, int]
    latest_restorable_step: int | None


class StepOut(_Out):
    step: int = Field(description="the step in the shard file names (MindFormers: within the epoch); "
                                  "address a step by global_step")
    epoch: int
    incarnation: int | None = None
    kind: str
    global_step: int | None = Field(description="the training step the files record (what /steps/{step} and the "
                                                "CLI take); null until a shard is verified")
    training_step: int | None = Field(None, description="the step as users count training: global_step, else the "
                                                        "one this step's verified shards hold (a torn save), else "
                                                        "the file names' step in epoch 1; null: not known yet")
    file_name_note: str | None = Field(None, description="how the file names count this step, where that differs "
                                                         "from training_step (ModelCheckpoint and MindFormers count "
                                                         "steps within the epoch)")
    state: str
    restorable: bool
    expected_ranks: int | None
    reason: str | None
    marked_bad: bool
    pinned: bool
    strategy_file: str | None
    tiers: list[str] | None = Field(None, description="the storage tiers the step is whole on (file, memory, "
                                                      "object): every live shard has a verified copy there")


class CopyOut(_Out):
    rank: int
    tier: str = Field(description="file | memory | object")
    location: str = Field(description="the copy's URI (file://, memory://, s3://)")
    state: str
    size: int | None
    digest: str | None
    node: str | None
    error: str | None
    verified_at: str | None


class ShardOut(_Out):
    rank: int
    path: str
    state: str
    size: int
    digest: str | None
    format: str | None
    encryption: str | None
    crc: str | None
    global_step: int | None
    error_code: str | None
    error: str | None
    quarantined: bool | None = None
    verified_at: str | None
    node: str | None = None  # the node whose daemon saw the file (docs/ARCHITECTURE.md, Nodes)
    reachable: bool | None = None  # its daemon's heartbeat is within node_timeout (None: no registered node)
    copies: list[CopyOut] | None = Field(None, description="every copy of the shard, the file tier's first")


class StepDetailOut(StepOut):
    shards: list[ShardOut]
    copies_without_file: list[CopyOut] = Field(default_factory=list, description="copies on other tiers of ranks "
                                                                               "with no shard file catalogued")


class JobOut(_Out):
    id: int
    kind: str
    state: str
    total: int
    done: int
    progress: float


class ConversionOut(_Out):
    id: int
    state: str
    source_step: int | None
    source_strategy_hash: str | None
    target_strategy_hash: str | None
    out_dir: str | None
    output_checkpoint_id: int | None
    error: str | None


class GcOut(_Out):
    dry_run: bool
    runs: list[dict[str, Any]] = Field(description="per run: the retention plan (delete/keep with reasons)")
    deleted_steps: int
    deleted_files: int
    refused: list[str]
    torn_temps: list[str] = Field(default_factory=list, description="temp files of saves that never finished, "
                                                                   "untouched for gc_torn_grace: removed (dry run: "
                                                                   "would be)")


class SettledStep(_Out):
    step: int = Field(description="the step in the file names")
    epoch: int
    training_step: int | None = Field(description="the step as users count training (see StepOut)")
    label: str = Field(description="the step in one token, as log lines name it")
    state: str


class Unjudged(_Out):
    node: str | None = Field(description="the node that saw the files (null: a row from before nodes)")
    reachable: bool | None = Field(description="its heartbeat is within node_timeout (null: no such node registered)")
    shards: int = Field(description="its shards of the run without a verdict")
    steps: list[str] = Field(description="the steps they belong to (labels); a step whose shards all have their "
                                         "verdict but whose step checks are due counts here with 0 shards")
    blocking: bool = Field(description="whether this holds the barrier: only a reachable node will judge soon")


class SettledOut(_Out):
    run: str
    settled: bool = Field(description="ckptd has judged everything committed under the run up to the question: "
                                      "this node examined every file there (a rescan started after the question "
                                      "finished, nothing waits for examination) and no reachable node holds a "
                                      "catalogued shard or step of the run without a verdict")
    node: str = Field(description="the node answering; files on other nodes' disks that their daemon has not "
                                  "catalogued yet are not known here")
    waited: float = Field(description="seconds the answer waited")
    rescanned: bool = Field(description="a rescan that started after the question finished")
    examining: int = Field(description="paths under the run waiting for (or in) their examination on this node")
    catalogued: bool = Field(description="false: the catalog has no such run (nothing under the root holds it)")
    steps: list[SettledStep] = Field(description="the run's newest trained steps, newest first, down to the newest "
                                                 "verified one")
    unjudged: list[Unjudged] = Field(description="what the catalog holds without a verdict, per node")


class ObjectTierProblem(_Out):
    kind: str = Field(description="credentials, bucket, unreachable or other")
    error: str = Field(description="what is wrong, in words (never a secret)")
    store: str = Field(description="s3://BUCKET/PREFIX")


class ObjectTierStatus(_Out):
    store: str
    problem: ObjectTierProblem | None = Field(default=None, description="null while the tier works")
    passes: int = Field(default=0, description="passes of the object tier's loop since the daemon started")
    shard_attempts: int = Field(default=0, description="shard uploads tried (each read back before it counts)")
    shard_failures: int = Field(default=0, description="shards not recorded: the object read back differently from "
                                                       "the verified file, or the file could not be opened (each "
                                                       "handed back to the verifier and backed off 30 s doubling to 1 h)")
    gc_runs: int = Field(default=0, description="object retention runs (after the tier changed, else every "
                                                "object_gc_interval)")
    uploaded_bytes: int = Field(default=0, description="bytes of shards uploaded and proven by read-back")
    upload_seconds: float = Field(default=0.0, description="seconds spent uploading and reading back those shards")
    last_manifest_delay_seconds: float | None = Field(
        default=None, description="for the newest step committed here: seconds from its files verified (restorable) "
                                  "to its manifest written; null before the first (histogram "
                                  "ckptd_restorable_to_manifest_seconds)")


class HealthzOut(_Out):
    status: str = Field(description="ok when the catalog takes writes and the workers make progress; "
                                    "catalog_unavailable (HTTP 503) when the catalog is read-only, gone, locked or "
                                    "unreachable; stalled (HTTP 503) when a verification worker, the ingest thread "
                                    "or the job thread is stuck")
    catalog: str = Field(default="ok", description="ok, or why the catalog cannot take writes (in words)")
    stalled: dict[str, float] = Field(default_factory=dict, description="stuck threads: name -> seconds busy with one "
                                                                        "unit of work (past worker_stall_seconds)")
    object_tier: ObjectTierStatus | None = Field(default=None, description="the object tier (null: not configured)")


class ConversionRequest(BaseModel):
    """Exactly one of ``to_layout`` / ``to_strategy`` (both or neither: 400)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"oneOf": [
        {"required": ["to_layout"], "properties": {"to_layout": {"type": "string"}}},
        {"required": ["to_strategy"], "properties": {"to_strategy": {"type": "string"}}},
    ]})
    step: StepNumber = Field(description="a verified step of the run")
    # no pattern here: ckptd.split.parse_split is the one grammar (the route applies
    # it, so a bad value is 400 with what is wrong, as the job would have failed)
    to_layout: str | None = Field(default=None, max_length=200,
                                  description="derive the target from the source strategy: tp=N,dp=N[,pp=N] (positive "
                                              f"integers, tp x dp x pp at most {MAX_WORLD_SIZE} ranks; otherwise 400)")
    to_strategy: Text | None = Field(default=None, max_length=4096,
                                     description="a strategy file inside the checkpoint root, or 'none'")
