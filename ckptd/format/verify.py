"""Complete verification of one checkpoint file, reporting *every* problem found.

Order (each step only if the previous left the file readable): sniff + decrypt-header scan ->
index every record -> decrypt and authenticate every block (encrypted files) -> recompute the
CRC when one is stored -> decode string entries. Structural damage stops the walk (nothing after
a corrupt length can be trusted); semantic problems are collected and the walk continues.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from ckptd.errors import ChecksumMismatchError, CkptdError, CorruptError
from ckptd.format.checkpoint import CheckpointFile, open_checkpoint
from ckptd.format.index_cache import IndexCache

CrcState = Literal["valid", "invalid", "absent", "unchecked"]


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
    path: str
    format: str | None = None
    encryption: str | None = None
    crc: CrcState = "unchecked"
    entries: int = 0
    size: int = 0
    problems: list[Problem] = field(default_factory=list)
    inspected: object = None  # what verify_file's ``inspect`` returned

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, err: CkptdError) -> None:
        self.problems.append(Problem.from_error(err))

    def to_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "ok": self.ok,
            "format": self.format,
            "encryption": self.encryption,
            "crc": self.crc,
            "entries": self.entries,
            "size": self.size,
            "problems": [p.to_dict() for p in self.problems],
        }


def verify_file(
    path: str | os.PathLike[str],
    key: bytes | None = None,
    *,
    require_crc: bool = False,
    workers: int | None = None,
    inspect: Callable[[CheckpointFile], object] | None = None,
    index_cache: IndexCache | None = None,
) -> FileReport:
    """Check a file completely; never raises for bad file content (it becomes a problem).

    A ``.ckpt`` cut exactly at a record boundary is indistinguishable from a shorter complete
    file (the format has no header or count). ``require_crc`` closes that gap for jobs that save
    with ``crc_check=True``: a missing trailer is then a problem, not a shrug.
    ``inspect`` runs on the open file once it checked out clean; its result is ``report.inspected``
    (callers that need something from the content need not open the file again).
    """
    report = FileReport(path=os.fspath(path))
    try:
        report.size = os.path.getsize(report.path)
        ckpt = open_checkpoint(report.path, key, workers=workers, index_cache=index_cache)
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
