"""When is a MindFormers Checkpoint 2.0 iteration whole — from its files, not from the tracker.

MindFormers trusts ``latest_checkpointed_iteration.txt`` alone and checks an iteration by file
*names* (a directory missing its optimizer file passes). Here an iteration is whole when:

* every file ``metadata.json`` places a tensor in exists (single-rank saves have no metadata.json:
  then the model file and its optimizer file), and ``common.json`` exists;
* each such file verified on its own (the verifier: the safetensors parse completely), and holds
  every tensor ``metadata.json`` places in it, with its dtype and local shape;
* ``common.json`` names this iteration.

Missing files make the iteration *incomplete* (they may still arrive: async saves write rank 0's
JSON records first, and ``*.tmp`` files say which are being written); a file that lies about its
content makes it *corrupt*. The tracker plays no part: MindSpore renames each file into place
complete, so an iteration whose every file is there and checks out is whole even before an async
save's finalize advances the tracker (the resume answer says so).
``common.json``'s ``ckpt_status`` 1 (abnormal) is a health reason, like ``health_ckpts.json``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable

from ckptd import runlayout
from ckptd.errors import CkptdError
from ckptd.format import mf2
from ckptd.format.checkpoint import open_checkpoint
from ckptd.storage import PosixStorage

_MAX_TENSOR_PROBLEMS = 20  # per iteration: enough to see the pattern, bounded for a 70B metadata.json
ABNORMAL_REASON = "common.json: ckpt_status=1 (MindFormers' health monitor flags this save as abnormal)"


@dataclass(frozen=True)
class IterationVerdict:
    problems: list[str]  # content that cannot become right: the iteration is corrupt
    missing: list[str] = field(default_factory=list)  # files that must exist and do not (yet)
    in_flight: list[str] = field(default_factory=list)  # ``*.tmp`` files of a save being written
    required: int = 0  # how many files the iteration has when whole
    health_reason: str | None = None

    @property
    def incomplete(self) -> bool:
        return not self.problems and bool(self.missing)

    def reason(self) -> str | None:
        return "; ".join([*self.problems, *([describe_missing(self.missing, self.in_flight)] if self.missing else [])]) or None


def describe_missing(missing: list[str], in_flight: list[str]) -> str:
    text = "missing " + ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
    if in_flight:
        text += "; a save is still being written (" + ", ".join(in_flight[:5]) + ")"
    return text


def in_flight(store: PosixStorage, directory: str) -> list[str]:
    """``*.tmp`` files in an iteration directory: MindSpore writes ``<stem>.tmp``, then renames."""
    try:
        return sorted(e.name for e in store.entries(directory) if e.name.endswith(".tmp") and not e.name.startswith("."))
    except OSError:
        return []


def required_by_names(file_names: Iterable[str]) -> set[str]:
    """The files an iteration needs, as far as the names seen so far tell (``metadata.json`` may
    name more: the step check has the last word). Every ``-<i>-<n>`` name tells its side's ``n``;
    a single-rank save is a model + optimizer pair; several files come with a ``metadata.json``."""
    present = set(file_names)
    sides: dict[str, tuple[str | None, int]] = {}  # role -> (file prefix, file count)
    for name in sorted(present):
        parsed = runlayout.parse_iteration_file("", 0, name)
        if parsed is not None and parsed.role in ("model", "opt"):
            prefix = name[: name.rindex(f"{parsed.role}-")].removesuffix("-") or None
            sides[parsed.role] = (prefix, max(parsed.total or 1, sides.get(parsed.role, (None, 0))[1]))
    multi = runlayout.MF2_METADATA in present or any(total > 1 for _, total in sides.values())
    prefix = next((p for p, _ in sides.values()), None)
    if "model" not in sides:
        sides["model"] = (prefix, 1)
    if "opt" not in sides and not multi:
        sides["opt"] = (prefix, 1)  # MindFormers' own check passes without it; the optimizer state is then lost
    need = {runlayout.MF2_COMMON} | ({runlayout.MF2_METADATA} if multi else set())
    for role, (p, total) in sides.items():
        need |= {runlayout.iteration_file_name(p, role, i, total) for i in range(total)}  # type: ignore[arg-type]
    return need


def judge(store: PosixStorage, iteration: int, files: dict[int, str]) -> IterationVerdict:
    """Judge iteration ``iteration`` from its catalogued files (slot -> path; see
    :func:`ckptd.runlayout.iteration_slot`). Reads the two JSON records and the safetensors
    headers (not their payloads: the verifier read those), each through the confined ``store``."""
    problems: list[str] = []
    by_name = {os.path.basename(p): p for p in files.values()}
    directory = os.path.dirname(next(iter(files.values())))
    common, health = None, None
    slot = runlayout.iteration_slot
    if slot("common") in files:
        try:
            common = mf2.parse_common(store.read(files[slot("common")], mf2.MAX_COMMON_BYTES),
                                      files[slot("common")])
        except (CkptdError, OSError) as err:
            problems.append(f"common.json: {err}")
    if common is not None:
        if not common.names_iteration(iteration):
            problems.append(f"common.json says step_num {common.step_num}, global_step {common.global_step}: "
                            f"not iteration {iteration} (a file of another save)")
        health = ABNORMAL_REASON if common.abnormal else None
    placements = _placements(store, files, problems)
    required = required_by_names(by_name) if placements is None else (
        set(placements) | {runlayout.MF2_METADATA, runlayout.MF2_COMMON})
    missing = sorted(n for n in required if n not in by_name)
    bad = 0
    for name, wanted in sorted((placements or {}).items()):
        if name in by_name and bad < _MAX_TENSOR_PROBLEMS:
            found = _tensor_problems(store, by_name[name], wanted, _MAX_TENSOR_PROBLEMS - bad)
            bad += len(found)
            problems.extend(found)
    problems.extend(f"metadata.json places tensors in {name!r}, which is not a Checkpoint 2.0 file name"
                    for name in sorted(placements or {}) if runlayout.parse_iteration_file("", 0, name) is None)
    return IterationVerdict(problems, missing, in_flight(store, directory), len(required), health)


def _placements(store: PosixStorage, files: dict[int, str], problems: list[str]) -> dict[str, list[mf2.Placement]] | None:
    """File name -> what metadata.json places in it; None without a metadata.json (single rank:
    the names decide), ``{}`` when it cannot be read (the problem is appended)."""
    path = files.get(runlayout.iteration_slot("metadata"))
    if path is None:
        return None
    try:
        return mf2.parse_metadata(store.read(path, mf2.MAX_METADATA_BYTES), path).by_file()
    except (CkptdError, OSError) as err:
        problems.append(f"metadata.json: {err}")
        return {}


def _tensor_problems(store: PosixStorage, path: str, wanted: list[mf2.Placement], limit: int) -> list[str]:
    name = os.path.basename(path)
    try:
        with store.opened(path) as fd_name, open_checkpoint(fd_name) as ckpt:
            entries = dict(ckpt.entries)
    except (CkptdError, OSError) as err:
        return [f"{name}: {err}"]  # the verifier has the details; the step is not whole
    out: list[str] = []
    for p in wanted:
        entry = entries.get(p.tensor)
        if entry is None:
            out.append(f"{name} lacks {p.tensor!r} (slice {p.slice_index}), which metadata.json places there")
        elif entry.dtype != p.dtype:
            out.append(f"{name}: {p.tensor!r} is {entry.dtype}, metadata.json says {p.dtype}")
        elif p.local_shape is not None and tuple(entry.shape) != p.local_shape:
            out.append(f"{name}: {p.tensor!r} has shape {list(entry.shape)}, metadata.json says slice "
                       f"{p.slice_index} is {list(p.local_shape)}")
        if len(out) >= limit:
            break
    return out
