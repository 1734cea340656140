"""Complete verification of one checkpoint file, reporting *every* problem found.

Order (each step only if the previous left the file readable): sniff + decrypt-header scan ->
index every record -> decrypt and authenticate every block (encrypted files) -> recompute the
CRC when one is stored -> decode string entries. Structural damage stops the walk (nothing after
a corrupt length can be trusted); semantic problems are collected and the walk continues (up to
``limits.max_problems`` of them are listed, the rest counted in one last problem).

Strategy files sit next to checkpoints (``<run>/strategy.ckpt``, ``<run>/strategy/*_rank_<r>.ckpt``,
a conversion's ``strategy_*.ckpt``) under the same suffix. :func:`sniff_kind` tells them apart by
their first byte, and :func:`verify_path` checks each file as what it is: a checkpoint with
:func:`verify_file`, a strategy with :func:`verify_strategy_file` (it must parse as a
``ParallelStrategyMap`` or JSON strategy whose layouts are consistent).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptd.errors import ChecksumMismatchError, CkptdError, CorruptError
from ckptd.format import crypto
from ckptd.format import safetensors_format as st_fmt
from ckptd.format.checkpoint import CheckpointFile, open_checkpoint
from ckptd.format.digest import StreamDigest
from ckptd.format.index_cache import IndexCache
from ckptd.format.limits import DEFAULT_LIMITS, DEFAULT_STRATEGY_LIMITS, MAX_PROBLEMS, FormatLimits, StrategyLimits
from ckptd.format.strategy import load_strategy

CrcState = Literal["valid", "invalid", "absent", "unchecked"]
FileKind = Literal["checkpoint", "strategy"]

#: First bytes of a protobuf ``ParallelStrategyMap``: keys of its fields 1 (current_stage, varint),
#: 2 and 3 (items, length-delimited). A checkpoint record starts with 0x0A (field 1, length-delimited).
_STRATEGY_FIRST_BYTES = frozenset({0x08, 0x12, 0x1A})


@dataclass(frozen=True)
class Problem:
    code: str
    message: str
    offset: int | None
    hint: str

    @classmethod
    def from_error(cls, err: CkptdError) -> "Problem":
        return cls(err.code, err.message, err.offset, err.hint)

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "message": self.message, "offset": self.offset, "hint": self.hint}


@dataclass
class FileReport:
    """What verification found. ``kind`` "strategy": ``format`` is "proto"/"json", ``entries`` the
    parameter layouts and ``strategy`` a summary (stages, devices per stage, content hash)."""

    path: str
    format: str | None = None
    encryption: str | None = None
    crc: CrcState = "unchecked"
    entries: int = 0
    size: int = 0
    problems: list[Problem] = field(default_factory=list)
    inspected: object = None  # what verify_file's ``inspect`` returned
    kind: FileKind = "checkpoint"
    strategy: dict[str, Any] | None = None
    max_problems: int = field(default=MAX_PROBLEMS, repr=False)
    dropped: int = field(default=0, repr=False)  # problems beyond max_problems, counted only

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, err: CkptdError) -> None:
        """Record a problem; beyond ``max_problems`` they are only counted, in one last problem
        (an index's own such summary, ``err.unlisted``, adds its count)."""
        had_summary = self.dropped > 0
        listed = len(self.problems) - had_summary
        unlisted = getattr(err, "unlisted", 0)
        if not unlisted and listed < self.max_problems:
            self.problems.insert(listed, Problem.from_error(err))  # before the summary, which stays last
            return
        self.dropped += unlisted or 1
        summary = Problem("format", f"{self.dropped} more problems not listed (ckptd keeps the first "
                          f"{self.max_problems})", None, "fix the problems listed first; the file is not usable as it is")
        if had_summary:
            self.problems[-1] = summary
        else:
            self.problems.append(summary)

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "path": self.path,
            "ok": self.ok,
            "kind": self.kind,
            "format": self.format,
            "encryption": self.encryption,
            "crc": self.crc,
            "entries": self.entries,
            "size": self.size,
            "problems": [p.to_dict() for p in self.problems],
        }
        if self.strategy is not None:
            out["strategy"] = self.strategy
        return out


def sniff_kind(path: str | os.PathLike[str]) -> FileKind:
    """Whether a file is a checkpoint or a strategy file, from its first bytes (names say ``.ckpt``
    for both). Anything that is not recognisably a strategy is a checkpoint, so that checkpoint
    verification reports what is wrong with it (unreadable, empty, unknown format)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError:
        return "checkpoint"
    if not head or crypto.sniff_encryption(head) is not None or st_fmt.sniff_safetensors(head, size):
        return "checkpoint"
    if head[0] in _STRATEGY_FIRST_BYTES:
        return "strategy"
    text = head[3:] if head.startswith(b"\xef\xbb\xbf") else head
    return "strategy" if text.lstrip()[:1] == b"{" else "checkpoint"


def verify_path(
    path: str | os.PathLike[str],
    key: bytes | None = None,
    *,
    require_crc: bool = False,
    workers: int | None = None,
    limits: FormatLimits = DEFAULT_LIMITS,
    strategy_limits: StrategyLimits = DEFAULT_STRATEGY_LIMITS,
) -> FileReport:
    """:func:`verify_strategy_file` for a strategy file, else :func:`verify_file` (``sniff_kind``)."""
    if sniff_kind(path) == "strategy":
        return verify_strategy_file(path, limits=strategy_limits, max_problems=limits.max_problems)
    return verify_file(path, key, require_crc=require_crc, workers=workers, limits=limits)


def verify_strategy_file(
    path: str | os.PathLike[str],
    *,
    limits: StrategyLimits = DEFAULT_STRATEGY_LIMITS,
    max_problems: int = MAX_PROBLEMS,
) -> FileReport:
    """Check a strategy file completely (it parses, its layouts agree); never raises for its content."""
    report = FileReport(path=os.fspath(path), kind="strategy", crc="absent", max_problems=max_problems)
    try:
        report.size = os.path.getsize(report.path)
        strategy = load_strategy(report.path, limits=limits)
    except CkptdError as err:
        report.add(err)
        return report
    except OSError as err:
        report.add(CkptdError(f"cannot read file: {err.strerror}", path=report.path, hint="check the path and permissions"))
        return report
    report.format = strategy.format
    report.entries = len(strategy.entries)
    report.strategy = {
        "stages": strategy.stages,
        "devices_per_stage": strategy.stage_device_num,
        "world_size": strategy.world_size,
        "merged": strategy.merged,
        "content_hash": strategy.content_hash(),
    }
    return report


def verify_file(
    path: str | os.PathLike[str],
    key: bytes | None = None,
    *,
    require_crc: bool = False,
    workers: int | None = None,
    inspect: Callable[[CheckpointFile], object] | None = None,
    index_cache: IndexCache | None = None,
    limits: FormatLimits = DEFAULT_LIMITS,
    digest: StreamDigest | None = None,
) -> FileReport:
    """Check a file completely; never raises for bad file content (it becomes a problem).

    A ``.ckpt`` cut exactly at a record boundary is indistinguishable from a shorter complete
    file (the format has no header or count). ``require_crc`` closes that gap for jobs that save
    with ``crc_check=True``: a missing trailer is then a problem, not a shrug.
    ``inspect`` runs on the open file once it checked out clean; its result is ``report.inspected``
    (callers that need something from the content need not open the file again).
    ``limits`` bound indexing (a file beyond them gets one ``limit_exceeded`` problem) and the
    problems listed. ``digest`` is fed the file's bytes as the verification reads them (one pass
    over the disk for digest and verification); call its ``finish`` afterwards for the value.
    """
    report = FileReport(path=os.fspath(path), max_problems=limits.max_problems)
    try:
        report.size = os.path.getsize(report.path)
        ckpt = open_checkpoint(report.path, key, workers=workers, index_cache=index_cache, limits=limits, digest=digest)
    except CkptdError as err:
        report.add(err)
        return report
    except OSError as err:
        report.add(CkptdError(f"cannot read file: {err.strerror}", path=report.path, hint="check the path and permissions"))
        return report
    with ckpt:
        report.format = ckpt.format
        report.encryption = ckpt.encryption.value if ckpt.encryption else None
        report.entries = len(ckpt.entries)
        for prob in ckpt.problems:
            report.add(prob)
        _check_content(ckpt, report, workers)
        if require_crc and ckpt.crc is None:
            report.add(
                CorruptError(
                    "no CRC stored although one is required: the file may be cut short at a record boundary",
                    path=ckpt.path,
                    offset=report.size,
                    hint="save with crc_check=True, or verify without --require-crc",
                )
            )
        if inspect is not None and report.ok:
            try:
                report.inspected = inspect(ckpt)
            except CkptdError as err:
                report.add(err)
    return report


def _check_content(ckpt: CheckpointFile, report: FileReport, workers: int | None) -> None:
    try:
        if ckpt.crc is not None:
            computed = ckpt.compute_crc(workers)  # for encrypted files this also authenticates every block
            if computed == ckpt.crc.stored:
                report.crc = "valid"
            else:
                report.crc = "invalid"
                report.add(
                    ChecksumMismatchError(
                        f"CRC mismatch: stored {ckpt.crc.stored:#010x}, content gives {computed:#010x}",
                        path=ckpt.path,
                        offset=ckpt.crc.covered,
                    )
                )
        else:
            report.crc = "absent"
            if ckpt.encryption is not None:
                ckpt.source.verify_all()  # type: ignore[attr-defined]
    except CkptdError as err:
        report.add(err.with_path(ckpt.path))
        return
    trailer = ckpt.metadata.get("trailing_plaintext")
    if trailer:
        report.add(
            CorruptError(
                "plaintext CRC trailer after the encrypted blocks (MindSpore's enc_key+crc_check defect): "
                "mindspore.load_checkpoint cannot load this file",
                path=ckpt.path,
                offset=report.size - len(trailer) // 2,
                hint="re-save without crc_check when encrypting, or rewrite with `ckptd` which keeps the CRC inside the ciphertext",
            )
        )
    for ent in ckpt.entries.values():
        if ent.is_string:
            try:
                ckpt.value(ent.name)
            except CkptdError as err:
                report.add(err.with_path(ckpt.path))
