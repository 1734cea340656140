"""Step-level checks: do the shards of one save form one consistent checkpoint?

Runs once every shard of a step is verified. Reports *all* problems (per rank), like restic:

* every expected rank present exactly once, no rank outside the world, and a shard that records
  its rank (``rank_id``) sits in that rank's directory;
* all shards carry the same global step (``global_step`` / ``step_num`` entries);
* every parameter the strategy assigns to a rank is in that rank's file with exactly the slice
  shape the strategy implies (the full shape is inferred from each rank and must agree);
* ranks that hold identical replicas of a parameter hold identical bytes (sampled or full), and
  ranks the strategy gives *different* slices do not hold identical bytes of non-constant float
  parameters (at least ``MIN_TWIN_PARAMS`` of them: data-parallel replicas described as
  tensor-parallel ranks, the lie a wrong strategy file tells; shapes alone cannot show it, since
  a strategy file does not record the full shape).
Reads only record headers, plus the payloads of the compared replicas. The checks are split in
two so that a step whose files live on several nodes can be judged without any node reading
another's files: :func:`shard_facts` (one file, by the node that sees it) and :func:`combine`
(the step, from every file's facts); ``ckptd.service.stepjudge`` runs them.

Subset saves (``subset=True``, MindFormers runs). With ``remove_redundancy`` every rank saves only
the parameters MindSpore assigns to it (safetensors metadata ``remove_redundancy: "True"``); after
a dying-gasp save (MindIO TTP) only some ranks of a data-parallel group wrote files. Such a step
is whole exactly when every slice of the layout — each parameter's replica group — is held by at
least one file with the right shape. Then :attr:`StepVerdict.load_plan` says, for every rank of
the world, which ranks' files hold its slices, and a rank without a file of its own is not a
problem. A slice nobody holds is one; with ranks missing it only means "not (yet) whole"
(:attr:`StepVerdict.incomplete`), since their files may still be arriving.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from dataclasses import dataclass, field
from typing import Mapping

import xxhash

from ckptd.convert.consistency import EVIDENCE_DTYPES, MIN_TWIN_PARAMS, PROBE_BYTES, repeats_one_element
from ckptd.errors import CkptdError
from ckptd.storage import PosixStorage
from ckptd.format.checkpoint import CheckpointFile
from ckptd.format.dtypes import itemsize
from ckptd.format.index_cache import IndexCache
from ckptd.format.layout import full_shape_from_local, local_shape
from ckptd.format.strategy import Strategy
from ckptd.service.shardopen import open_shard

STEP_ENTRY_NAMES = ("global_step", "step_num", "step")
RANK_ENTRY_NAMES = ("rank_id", "rank")


@dataclass(frozen=True)
class ShardRef:
    rank: int
    path: str


@dataclass(frozen=True)
class StepVerdict:
    problems: list[str]
    #: ranks without a file of their own (only possible with ``subset``)
    missing: tuple[int, ...] = ()
    #: rank -> ranks whose files hold its slices (only when it differs from "its own file")
    load_plan: dict[int, tuple[int, ...]] | None = None

    @property
    def incomplete(self) -> bool:
        """Not whole, but only because ranks are missing: more files may still arrive."""
        return bool(self.problems) and bool(self.missing)


REDUNDANCY_REMOVED = "remove_redundancy"


def redundancy_removed(ckpt: CheckpointFile) -> bool:
    """MindSpore marks a file saved with ``remove_redundancy`` (safetensors only) in its metadata."""
    return str(ckpt.metadata.get(REDUNDANCY_REMOVED, "")).lower() == "true"


def content_step(ckpt: CheckpointFile) -> int | None:
    """The training step a shard says it holds (optimizer ``global_step`` first)."""
    for name in STEP_ENTRY_NAMES:
        ent = ckpt.entries.get(name)
        if ent is None or ent.is_string or ent.numel != 1 or ent.dtype not in ("Int32", "Int64", "UInt32", "UInt64"):
            continue
        try:
            return int(ckpt.array(name).reshape(-1)[0])
        except CkptdError:
            return None
    return None


def content_rank(ckpt: CheckpointFile) -> int | None:
    """The rank a shard says saved it, when the trainer records one (``append_dict={"rank_id": r}``)."""
    for name in RANK_ENTRY_NAMES:
        ent = ckpt.entries.get(name)
        if ent is not None and ent.is_scalar and ent.dtype in ("Int32", "Int64"):
            try:
                return int(ckpt.array(name))
            except CkptdError:
                return None
    return None


def _payload_digest(ckpt: CheckpointFile, name: str) -> tuple[str, bool]:
    """(digest of the payload, whether equal digests of two slices prove a lie): a float tensor
    that is not one value repeated (zero-initialised moments are equal on every rank)."""
    ent = ckpt.entries[name]
    evidence = ent.dtype in EVIDENCE_DTYPES
    h = xxhash.xxh3_128()
    for i, view in enumerate(ckpt.iter_payload(name)):
        h.update(view)
        if evidence and i == 0:
            isz = itemsize(ent.dtype)
            head = bytes(view[: min(len(view), PROBE_BYTES) // isz * isz])
            evidence = not repeats_one_element(head, isz)
    return h.hexdigest(), evidence


# --- per-shard facts: what one node finds in one file --------------------------------------------


@dataclass(frozen=True)
class ShardFacts:
    """What the step check needs from one rank's file, computed by the node that sees it.

    A step whose files live on several nodes is checked by combining every node's facts; no node
    reads another's files. ``full``: each parameter's full shape as this file implies it;
    ``missing``: parameters of its stage it does not hold (remove_redundancy subsets);
    ``digests``: payload digests of the parameters sampled for the replica comparison;
    ``evidence``: those of them whose equality across different slices proves a lie (see
    :func:`_payload_digest`)."""

    rank: int
    problems: tuple[str, ...] = ()
    step: int | None = None
    full: dict[str, tuple[int, ...]] = field(default_factory=dict)
    missing: tuple[str, ...] = ()
    digests: dict[str, str] = field(default_factory=dict)
    readable: bool = True
    shapes_ok: bool = True  # the file holds the slices the strategy gives its rank
    evidence: tuple[str, ...] = ()

    def encode(self) -> str:
        doc = {"rank": self.rank, "problems": list(self.problems), "step": self.step, "missing": list(self.missing),
               "full": {n: list(v) for n, v in self.full.items()}, "digests": self.digests, "readable": self.readable, "shapes_ok": self.shapes_ok,
               "evidence": list(self.evidence)}
        return base64.b64encode(zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 6)).decode()

    @classmethod
    def decode(cls, text: str) -> "ShardFacts":
        doc = json.loads(zlib.decompress(base64.b64decode(text)))
        return cls(doc["rank"], tuple(doc["problems"]), doc["step"], {n: tuple(v) for n, v in doc["full"].items()},
                   tuple(doc["missing"]), dict(doc["digests"]), doc["readable"], doc["shapes_ok"],
                   tuple(doc.get("evidence", ())))  # facts stored before the twin check have none


@dataclass(frozen=True)
class ReplicaCheck:
    """Which parameters' replicas a step check compares: ``off``, a ``sample`` of ``sample``
    parameters per step, or ``full`` (the ``replica_check`` / ``replica_sample`` settings)."""

    mode: str = "sample"
    sample: int = 8


def replica_names(strategy: Strategy | None, mode: str, sample: int, seed: str) -> tuple[str, ...]:
    """The parameters whose replicas are compared: all (``full``), or a sample that is
    deterministic per step and different across steps, so over time every parameter is compared."""
    if strategy is None or mode == "off":
        return ()
    names = sorted({e.name for e in strategy.entries})
    if mode == "sample" and len(names) > sample:
        names = sorted(names, key=lambda n: hashlib.blake2b((seed + n).encode(), digest_size=8).digest())[:sample]
    return tuple(names)


def shard_facts(store: PosixStorage, ref: ShardRef, strategy: Strategy | None, key: bytes | None,
                digest_names: tuple[str, ...] = (), *, subset: bool = False,
                index_cache: IndexCache | None = None) -> ShardFacts:
    """Read one rank's file (headers, plus the payloads of ``digest_names``) into its facts;
    opened through the confined ``store`` (a FIFO or symlink there is unreadable, never waited on
    or followed)."""
    try:
        with open_shard(store, ref.path, key, index_cache) as ck:
            return facts_of(ck, ref.rank, strategy, digest_names, subset=subset)
    except CkptdError as err:
        return ShardFacts(ref.rank, (f"rank {ref.rank}: {err}",), readable=False)
    except OSError as err:
        return ShardFacts(ref.rank, (f"rank {ref.rank}: cannot read {ref.path}: {err.strerror or err}",),
                          readable=False)


def facts_of(ck: CheckpointFile, rank: int, strategy: Strategy | None, digest_names: tuple[str, ...] = (), *,
             subset: bool = False) -> ShardFacts:
    """:func:`shard_facts` of a file already open (the verifier's, while its bytes are in hand)."""
    problems: list[str] = []
    claimed = content_rank(ck)
    if claimed is not None and claimed != rank:
        problems.append(f"rank {rank}: the file says it was saved by rank {claimed} (shards swapped or misplaced)")
    full: dict[str, tuple[int, ...]] = {}
    missing: list[str] = []
    shape_problems: list[str] = []
    if strategy is not None and rank < strategy.world_size:
        partial = subset and redundancy_removed(ck)
        shape_problems = _rank_shapes(rank, ck, strategy, partial, full, missing)
    read = {n: _payload_digest(ck, n) for n in digest_names if n in ck.entries}
    return ShardFacts(rank, tuple(problems + shape_problems), content_step(ck), full, tuple(missing),
                      {n: d for n, (d, _) in read.items()}, shapes_ok=not shape_problems,
                      evidence=tuple(n for n, (_, ev) in read.items() if ev))


def _rank_shapes(rank: int, ck: CheckpointFile, strategy: Strategy, partial: bool,
                 full: dict[str, tuple[int, ...]], missing: list[str]) -> list[str]:
    """Does the file hold exactly the slices the strategy gives ``rank``? Fills ``full`` (the full
    shape each parameter implies) and ``missing``. ``partial``: a remove_redundancy file may hold
    a subset of its stage's parameters (coverage is checked across ranks)."""
    problems: list[str] = []
    stage, _ = strategy.stage_and_local(rank)
    for e in strategy.entries:
        if e.stage != stage:
            continue
        ent = ck.entries.get(e.name)
        if ent is None:
            missing.append(e.name)
            if not partial:
                problems.append(f"rank {rank}: strategy assigns {e.name!r} but the shard does not hold it")
            continue
        try:
            shape = e.tensor_shape or full_shape_from_local(e.layout, ent.shape)
            want = local_shape(e.layout, shape)
        except CkptdError as err:
            problems.append(f"rank {rank}: {e.name!r} {ent.shape}: {err.message}")
            continue
        full[e.name] = tuple(shape)
        if tuple(ent.shape) != tuple(want):
            problems.append(f"rank {rank}: {e.name!r} has shape {ent.shape}, the strategy's slice is {want}")
    return problems


def slice_problems(rank: int, shapes: Mapping[str, tuple[int, ...]], strategy: Strategy) -> list[str]:
    """Does a rank's state (name -> shape: a memory snapshot's table) hold exactly the slices the
    strategy gives ``rank``? The same rule as for a file (:func:`_rank_shapes`)."""
    from types import SimpleNamespace

    held = SimpleNamespace(entries={name: SimpleNamespace(shape=tuple(shape)) for name, shape in shapes.items()})
    return _rank_shapes(rank, held, strategy, False, {}, [])  # type: ignore[arg-type]


# --- the step from its shards' facts --------------------------------------------------------------


def combine(shards: list[ShardRef], facts: Mapping[int, ShardFacts], expected_ranks: int | None,
            strategy: Strategy | None, digest_names: tuple[str, ...] = (), *, subset: bool = False) -> StepVerdict:
    """The verdict on a step from every shard's facts (computed here or by the nodes holding them)."""
    problems: list[str] = []
    by_rank: dict[int, ShardRef] = {}
    for ref in shards:
        if ref.rank in by_rank:
            problems.append(f"rank {ref.rank} has two shard files: {by_rank[ref.rank].path} and {ref.path}")
        by_rank[ref.rank] = ref
    missing: list[int] = []
    plan: dict[int, tuple[int, ...]] | None = None
    if expected_ranks is not None:
        missing = sorted(set(range(expected_ranks)) - set(by_rank))
        extra = sorted(r for r in by_rank if r >= expected_ranks)
        if missing and not (subset and strategy is not None):  # without a strategy nothing says who holds what
            problems.append(f"ranks missing: {missing}")
        if extra:
            problems.append(f"ranks outside the world of {expected_ranks}: {extra}")
    readable = {r: f for r, f in sorted(facts.items()) if f.readable}
    for _, f in sorted(facts.items()):
        problems += f.problems
    steps = {r: f.step for r, f in readable.items()}
    if len(set(steps.values())) > 1:
        problems.append(f"shards disagree on the global step: {dict(sorted(steps.items()))}")
    if strategy is not None:
        full_shapes: dict[str, tuple[int, ...]] = {}
        shapes_ok = all(f.shapes_ok for f in readable.values())
        for r, f in readable.items():
            for name, shape in f.full.items():
                seen = full_shapes.setdefault(name, shape)
                if seen != shape:
                    problems.append(f"rank {r}: {name!r} implies full shape {shape}, other ranks {seen}")
                    shapes_ok = False
        if subset and shapes_ok:
            holds = {r: set(f.full) for r, f in readable.items()}
            uncovered, plan = _coverage(holds, strategy, full_shapes, expected_ranks or strategy.world_size)
            problems += uncovered
        problems += _check_replicas(readable, strategy, digest_names, full_shapes)
        problems += _check_twins(readable, strategy, digest_names, full_shapes)
    return StepVerdict(problems, tuple(missing) if subset else (), plan)


def _coverage(
    holds: dict[int, set[str]], strategy: Strategy, full_shapes: dict[str, tuple[int, ...]], world: int
) -> tuple[list[str], dict[int, tuple[int, ...]]]:
    """Is every slice of every parameter held by some file? (shapes already checked). Returns
    the uncovered slices and, per rank, the ranks whose files it loads from."""
    problems: list[str] = []
    needs: dict[int, list[frozenset[int]]] = {}  # rank -> for each of its slices, the ranks holding it
    for e in strategy.entries:
        full = full_shapes.get(e.name) or e.tensor_shape
        if full is None:
            problems.append(f"no file holds {e.name!r} (stage {e.stage})")
            continue
        try:
            groups = [g for g in strategy.replicas(e.name, full) if strategy.stage_and_local(g[0])[0] == e.stage]
        except CkptdError as err:
            problems.append(f"{e.name!r}: {err.message}")
            continue
        for group in groups:
            holders = [r for r in group if e.name in holds.get(r, ())]
            if not holders:
                problems.append(f"no file holds the slice of {e.name!r} that ranks {list(group)} share")
                continue
            for r in group:
                needs.setdefault(r, []).append(frozenset(holders))
    plan = {}
    for r, sets in sorted(needs.items()):
        src = _fewest_files(r, sets)
        if r < world and src != {r}:
            plan[r] = tuple(sorted(src))
    return problems[:20] + ([f"and {len(problems) - 20} more uncovered slices"] if len(problems) > 20 else []), plan


def _fewest_files(rank: int, needs: list[frozenset[int]]) -> set[int]:
    """Ranks whose files give ``rank`` all its slices: its own file first, then greedily the file
    holding most of what is still missing (so a lost rank loads one replica's file, not pieces)."""
    chosen: set[int] = set()
    todo = list(needs)
    while todo:
        if any(rank in h for h in todo):
            pick = rank
        else:
            counts: dict[int, int] = {}
            for h in todo:
                for r in h:
                    counts[r] = counts.get(r, 0) + 1
            pick = min(counts, key=lambda r: (-counts[r], r))
        chosen.add(pick)
        todo = [h for h in todo if pick not in h]
    return chosen


def _check_replicas(facts: Mapping[int, ShardFacts], strategy: Strategy, names: tuple[str, ...],
                    full_shapes: dict[str, tuple[int, ...]]) -> list[str]:
    problems: list[str] = []
    for name in names:
        full = full_shapes.get(name)
        if full is None:
            continue
        try:
            groups = strategy.replicas(name, full)
        except CkptdError:
            continue  # shape problems are reported with the shapes
        for group in groups:
            digests = {r: facts[r].digests[name] for r in group if r in facts and name in facts[r].digests}
            if len(set(digests.values())) > 1:
                problems.append(f"replicas of {name!r} differ across ranks {sorted(digests)}")
    return problems


def _check_twins(facts: Mapping[int, ShardFacts], strategy: Strategy, names: tuple[str, ...],
                 full_shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Ranks holding the same bytes of parameters the strategy slices differently for them."""
    twins: dict[tuple[int, int], list[str]] = {}
    for name in names:
        full = full_shapes.get(name)
        if full is None:
            continue
        try:
            group_of = {r: i for i, g in enumerate(strategy.replicas(name, full)) for r in g}
        except CkptdError:
            continue  # shape problems are reported with the shapes
        first: dict[str, int] = {}  # digest -> the first rank holding it
        for r, f in sorted(facts.items()):
            if name not in f.evidence or r not in group_of:
                continue
            r1 = first.setdefault(f.digests[name], r)
            if r1 != r and group_of.get(r1) != group_of[r]:
                twins.setdefault((r, r1), []).append(name)
    if len({n for found in twins.values() for n in found}) < MIN_TWIN_PARAMS:
        return []  # one parameter could be a coincidence (e.g. a tensor initialised alike)
    return [f"rank {r}: holds the same bytes as rank {r1} in {', '.join(repr(n) for n in found[:4])}"
            f"{' and more' if len(found) > 4 else ''} although the strategy gives the two ranks different "
            "slices (data-parallel replicas described as tensor-parallel ranks? check the strategy files)"
            for (r, r1), found in sorted(twins.items())]
