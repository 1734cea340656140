"""One front door for every checkpoint file MindSpore writes: ``open_checkpoint`` / ``write_checkpoint``.

``open_checkpoint`` sniffs the format (encrypted ``.ckpt``, plain ``.ckpt``, safetensors) from the
bytes, not the file name, indexes it and hands out numpy arrays on demand. Nothing is read
eagerly except record headers, so opening a 10 GB shard costs milliseconds and little memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal

from ckptd.errors import (
    CkptdError,
    CorruptError,
    KeyRequiredError,
    NotEncryptedError,
    UnknownFormatError,
)
from ckptd.format import ckpt as ckpt_fmt
from ckptd.format import crypto
from ckptd.format import safetensors_format as st_fmt
from ckptd.format.crc import crc32, parallel_crc32
from ckptd.format.digest import StreamDigest
from ckptd.format.dtypes import numpy_dtype, scalar_value
from ckptd.format.entry import TensorEntry
from ckptd.format.index_cache import IndexCache
from ckptd.format.limits import DEFAULT_LIMITS, FormatLimits, LimitExceededError
from ckptd.format.source import ByteSource, MmapSource

if TYPE_CHECKING:  # numpy loads when an array is made: an index, a CRC or a scalar needs none (start-up)
    import numpy as np

Format = Literal["ckpt", "safetensors"]


@dataclass(frozen=True)
class CrcInfo:
    """A checksum stored in the file; ``covered`` = bytes it covers (ckpt) or None (safetensors)."""

    stored: int
    covered: int | None


@dataclass
class CheckpointFile:
    """An opened, indexed checkpoint. Use as a context manager; arrays are read-only views."""

    path: str
    format: Format
    encryption: crypto.EncMode | None
    entries: dict[str, TensorEntry]
    crc: CrcInfo | None
    metadata: dict[str, str]
    problems: tuple[CkptdError, ...]
    source: ByteSource = field(repr=False)
    _st_index: Any = field(default=None, repr=False)

    # --- reading -------------------------------------------------------------------------------

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise CkptdError(f"no entry named {name!r}", path=self.path, hint="list entries with `ckptd inspect`") from None

    def iter_payload(self, name: str) -> Iterator[memoryview]:
        """The raw payload bytes of an entry, segment by segment (no copies for plain files)."""
        for off, length in self.entry(name).segments:
            yield self.source.view(off, length)

    def read_range(self, name: str, start: int, length: int) -> bytes:
        """``length`` payload bytes from ``start`` of an entry, across split-record boundaries."""
        ent = self.entry(name)
        if start < 0 or length < 0 or start + length > ent.nbytes:
            raise CkptdError(f"byte range {start}+{length} outside entry {name!r} of {ent.nbytes} bytes", path=self.path)
        out = bytearray()
        pos = 0
        for off, seg_len in ent.segments:
            lo, hi = max(start, pos), min(start + length, pos + seg_len)
            if lo < hi:
                out += self.source.view(off + lo - pos, hi - lo)
            pos += seg_len
            if pos >= start + length:
                break
        return bytes(out)

    def array(self, name: str) -> np.ndarray:
        """The tensor as a numpy array (raw uint16 bits for BFloat16). Zero-copy when possible."""
        ent = self.entry(name)
        if ent.is_string or ent.dtype == ckpt_fmt.MAP_TENSOR_TYPE:
            raise CkptdError(f"entry {name!r} is a {ent.dtype}, not an array", path=self.path, hint="use value()")
        dt = numpy_dtype(ent.dtype)
        expected = ent.expected_nbytes()
        if expected != ent.nbytes:
            raise CorruptError(
                f"tensor {name!r} needs {expected} bytes but holds {ent.nbytes}", path=self.path, offset=ent.record_offset
            )
        if len(ent.segments) == 1:
            buf: Any = self.source.view(*ent.segments[0])
        else:
            buf = b"".join(bytes(v) for v in self.iter_payload(name))
        import numpy as np

        arr = np.frombuffer(buf, dtype=dt).reshape(ent.shape)
        arr.flags.writeable = False
        return arr

    def value(self, name: str) -> Any:
        """Python value of an ``append_dict``-style entry (int/float/bool/str), else the array."""
        ent = self.entry(name)
        if ent.is_string:
            try:
                return ckpt_fmt.decode_string(b"".join(bytes(v) for v in self.iter_payload(name)))
            except CkptdError as exc:
                raise exc.with_path(self.path) from None
        if ent.is_scalar and ent.dtype not in ("BFloat16", "Int4") and ent.expected_nbytes() == ent.nbytes:
            return scalar_value(ent.dtype, self.read_range(name, 0, ent.nbytes))
        return self.array(name)

    # --- integrity -----------------------------------------------------------------------------

    def compute_crc(self, workers: int | None = None) -> int:
        """The CRC MindSpore would compute for this file's content (needs a full read).

        For a ``.ckpt`` without a trailer it is the CRC of all records (what a trailer would hold).
        """
        if self.format == "safetensors":
            return st_fmt.compute_crc(self.source, self._st_index, workers=workers)
        covered = self.crc.covered if self.crc is not None and self.crc.covered is not None else self.source.size
        if isinstance(self.source, MmapSource):
            return parallel_crc32(self.source.view(0, covered), workers, release=self.source.release,
                                  prefetch=self.source.prefetch)
        value, done = 0, 0
        for block in self.source.iter_plaintext():  # type: ignore[attr-defined]
            take = min(len(block), covered - done)
            value = crc32(block[:take], value)
            done += take
            if done >= covered:
                break
        return value

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> "CheckpointFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def summary(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "encryption": self.encryption.value if self.encryption else None,
            "size": os.path.getsize(self.path),
            "entries": len(self.entries),
            "crc": None if self.crc is None else {"stored": self.crc.stored},
            "metadata": self.metadata,
        }


def _format_of(head: bytes, size: int, path: str) -> tuple[Format, crypto.EncMode | None]:
    """Decide the format from the first bytes (file names lie; MindSpore writes ``.ckpt`` either way)."""
    if not head:
        return "ckpt", None  # indexing reports the empty file precisely
    mode = crypto.sniff_encryption(head)
    if mode is not None:
        return "ckpt", mode
    if st_fmt.sniff_safetensors(head, size):
        return "safetensors", None
    if head[0] == 0x0A:  # field 1, length-delimited: a Checkpoint record
        return "ckpt", None
    # never the bytes themselves: the file may be another file's name (a planted link) and its
    # first bytes would then end up in reasons, logs and API answers
    raise UnknownFormatError("not a MindSpore checkpoint: expected a .ckpt record (first byte 0A), an encryption "
                             "block magic or a safetensors header at the start", path=path, offset=0)


def open_checkpoint(
    path: str | os.PathLike[str],
    key: bytes | None = None,
    *,
    mode: crypto.EncMode | None = None,
    workers: int | None = None,
    index_cache: IndexCache | None = None,
    limits: FormatLimits = DEFAULT_LIMITS,
    digest: StreamDigest | None = None,
) -> CheckpointFile:
    """Open and index a checkpoint. ``key`` decrypts encrypted ``.ckpt`` files (mode auto-detected).
    ``index_cache`` reuses the record index of a plaintext ``.ckpt`` opened before, unchanged.
    ``limits`` bounds what indexing may build (:mod:`ckptd.format.limits`); a file beyond them
    raises :class:`~ckptd.format.limits.LimitExceededError`. ``digest`` hashes the file's bytes as
    they are read and released (:mod:`ckptd.format.digest`)."""
    path = os.fspath(path)
    source: ByteSource
    try:  # one open: the format is sniffed from the mapping the reads then use
        raw = MmapSource(path, digest)
        try:
            fmt, enc = _format_of(bytes(raw.view(0, min(16, raw.size))), raw.size, path)
            if enc is None and key is not None:
                raise NotEncryptedError(f"file is a plaintext {fmt} file but a key was given", path=path)
            if enc is not None and key is None:
                raise KeyRequiredError(f"file is {enc.value} encrypted", path=path)
            source = raw if enc is None else crypto.EncryptedSource(path, key, mode or enc, workers=workers, raw=raw)
        except BaseException:
            raw.close()
            raise
    except CkptdError as exc:
        raise exc.with_path(path) from None
    try:
        if fmt == "safetensors":
            sti = st_fmt.index_safetensors(source, limits=limits)
            crc = None if sti.crc_stored is None else CrcInfo(sti.crc_stored, None)
            entries = {e.name: e for e in sti.entries}
            return CheckpointFile(path, fmt, None, entries, crc, dict(sti.metadata), (), source, sti)
        idx = None
        if index_cache is not None and isinstance(source, MmapSource):
            cache_key = index_cache.key_for(source.stat)
            idx = index_cache.get(cache_key)
            if idx is not None and idx.records > limits.max_entries:  # cached under larger limits
                raise LimitExceededError(
                    f"{idx.records} records: more than the limit of {limits.max_entries} entries per checkpoint file",
                    offset=0,
                )
        if idx is None:
            idx = ckpt_fmt.index_ckpt(source, limits=limits)
            if index_cache is not None and isinstance(source, MmapSource):
                index_cache.put(cache_key, idx)
        crc = None if idx.crc is None else CrcInfo(idx.crc.stored, idx.crc.offset)
        problems = tuple(p.with_path(path) for p in idx.problems)
        trailer = getattr(source, "trailer", b"")
        meta = {"trailing_plaintext": trailer.hex()} if trailer else {}
        return CheckpointFile(path, fmt, enc, idx.entries, crc, meta, problems, source)
    except CkptdError as exc:
        source.close()
        raise exc.with_path(path) from None
    except BaseException:
        source.close()
        raise


def write_checkpoint(
    path: str | os.PathLike[str],
    items: Iterable[tuple[str, Any]],
    *,
    crc: bool = False,
    enc_key: bytes | None = None,
    enc_mode: crypto.EncMode | str = crypto.EncMode.AES_GCM,
    overwrite: bool = False,
    block_size: int = crypto.ENCRYPT_BLOCK_SIZE,
) -> None:
    """Atomically write a ``.ckpt`` that ``mindspore.load_checkpoint`` loads.

    With ``enc_key`` the plaintext stream is encrypted in MindSpore's block format. With both
    ``enc_key`` and ``crc`` the CRC trailer goes *inside* the plaintext, where MindSpore's loader
    looks for it after decrypting (MindSpore's own writer puts it outside, producing files it
    cannot load itself; see docs/FORMATS.md).
    """
    from ckptd.atomic import atomic_write

    with atomic_write(path, overwrite=overwrite) as fh:
        write_checkpoint_to(fh, items, crc=crc, enc_key=enc_key, enc_mode=enc_mode, block_size=block_size)


def write_checkpoint_to(
    fh: Any,
    items: Iterable[tuple[str, Any]],
    *,
    crc: bool = False,
    enc_key: bytes | None = None,
    enc_mode: crypto.EncMode | str = crypto.EncMode.AES_GCM,
    block_size: int = crypto.ENCRYPT_BLOCK_SIZE,
) -> None:
    """:func:`write_checkpoint`'s bytes into an open file (the caller makes it atomic)."""
    from ckptd.format import ckpt_write  # the writer (numpy) loads only when writing: readers start fast

    if enc_key is None:
        ckpt_write.write_ckpt_stream(fh, items, crc=crc)
        return
    mode = crypto.EncMode(enc_mode)
    crypto.validate_key(enc_key, mode)
    writer = crypto.EncryptingWriter(fh, enc_key, mode, block_size=block_size)
    ckpt_write.write_ckpt_stream(writer, items, crc=crc)  # type: ignore[arg-type]
    writer.close()
