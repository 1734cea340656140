"""The memory tier's slot: one rank's snapshot of its training state in a node's shared memory.

Format (docs/FORMATS.md 8). A rank owns two slot files, ``<memory_root>/<run>/rank_<r>/slot_0`` and
``slot_1`` (mode 0600, directories 0700, owned by the job's user). Double buffering: a snapshot is
written into the slot that does *not* hold the rank's newest committed snapshot, so a crash in the
middle of a copy leaves the other slot whole. Each file::

    [0, 4096)            header: magic, commit word, table length, payload offset, payload length,
                         digest (xxh3-128), global step -- little-endian, see HEADER
    [4096, 4096+T)       the table: UTF-8 JSON (identity of the snapshot and every entry)
    [P, P+L)             the payload: each tensor's C-order bytes at its table offset (64-aligned)

The commit word (``seq``) is 0 while the slot is being written and is set last, to one more than
the rank's previous snapshot's, after the digest. A reader takes the commit word, reads and hashes
table and tensors, and takes the commit word again: the snapshot is whole only if both are the same
non-zero value and the digest matches (a changed word means the writer began overwriting the slot
meanwhile: a torn read, not a corrupt slot). The digest is xxh3-128 over the table bytes followed
by each tensor's bytes in table order (padding excluded), so a reader that streams the tensors into
a file hashes them in the same pass.

The table: ``{"version": 1, "run", "run_dir" (absolute), "rank", "world_size", "global_step", "epoch",
"file" (the shard file this snapshot would be, relative to the run directory, in the run's layout),
"encrypted", "entries": [...]}``;
an entry is ``{"name", "dtype" (numpy dtype string), "shape", "offset", "nbytes"}`` for a tensor or
``{"name", "value"}`` for a scalar append value (int, float, bool or str), in the order the shard
file would hold them.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any, Iterator

import xxhash

from ckptd.errors import CkptdError

MAGIC = b"CKPTDSL1"
#: magic, commit seq, table length, payload offset, payload length, digest (16 bytes), global step
HEADER = struct.Struct("<8sQQQQ16sQ")
SEQ_OFFSET = 8
DIGEST_OFFSET = 40
PAGE = 4096
ALIGN = 64
SLOTS = ("slot_0", "slot_1")
#: a table is the names and shapes of one rank's tensors: a few MiB for the largest models
MAX_TABLE = 64 << 20
#: the node daemon's ``persist_every``, in the memory root: a job keeps the slot of such a step
#: until its file exists (a slot otherwise lives two snapshots, maybe shorter than a file write)
PERSIST_MARKER = ".persist-every"


def read_persist_every(memory_root: str) -> int:
    try:
        with open(os.path.join(memory_root, PERSIST_MARKER), "rb") as fh:
            value = int(fh.read(32).decode().strip() or 0)
    except (OSError, ValueError):
        return 0
    return max(value, 0)


class SlotError(CkptdError):
    code = "memory_slot"
    default_hint = "the memory tier skips this slot; the files of the run are unaffected"


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str | None = None  # tensors: the numpy dtype string
    shape: tuple[int, ...] = ()
    offset: int = 0  # from the payload's start
    nbytes: int = 0
    value: Any = None  # append values: int, float, bool, str

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None


@dataclass(frozen=True)
class Table:
    run: str
    run_dir: str  # the run's directory under its checkpoint root (absolute): whose daemon catalogues it
    rank: int
    world_size: int
    global_step: int
    epoch: int
    file: str
    entries: tuple[Entry, ...]
    encrypted: bool = False  # the run's files are encrypted: a persisted file must be too

    def encode(self) -> bytes:
        entries = [{"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "offset": e.offset, "nbytes": e.nbytes}
                   if e.is_tensor else {"name": e.name, "value": e.value} for e in self.entries]
        return json.dumps({"version": 1, "run": self.run, "run_dir": self.run_dir, "rank": self.rank,
                           "world_size": self.world_size, "global_step": self.global_step, "epoch": self.epoch,
                           "file": self.file, "encrypted": self.encrypted, "entries": entries},
                          separators=(",", ":")).encode()

    @property
    def payload_len(self) -> int:
        return max((e.offset + e.nbytes for e in self.entries if e.is_tensor), default=0)


def decode_table(raw: bytes, where: str) -> Table:
    try:
        doc = json.loads(raw)
        entries = tuple(Entry(e["name"], e["dtype"], tuple(int(x) for x in e["shape"]), int(e["offset"]),
                              int(e["nbytes"])) if "dtype" in e else Entry(e["name"], value=e["value"])
                        for e in doc["entries"])
        table = Table(str(doc["run"]), str(doc["run_dir"]), int(doc["rank"]), int(doc["world_size"]),
                      int(doc["global_step"]), int(doc["epoch"]), str(doc["file"]), entries, bool(doc["encrypted"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise SlotError(f"{where}: the slot's table does not parse ({exc.__class__.__name__}: {exc})") from None
    if any(e.offset < 0 or e.nbytes < 0 or e.offset % ALIGN for e in entries if e.is_tensor):
        raise SlotError(f"{where}: the slot's table places a tensor at a negative or unaligned offset")
    return table


def layout_of(entries: list[tuple[str, str, tuple[int, ...], int]]) -> list[tuple[int, int]]:
    """(offset, nbytes) of each tensor ``(name, dtype, shape, nbytes)``, each 64-byte aligned."""
    out, pos = [], 0
    for _, _, _, nbytes in entries:
        out.append((pos, nbytes))
        pos += -(-nbytes // ALIGN) * ALIGN
    return out


def payload_offset(table_len: int) -> int:
    return PAGE + -(-table_len // PAGE) * PAGE


def slot_size(table_len: int, payload_len: int) -> int:
    return payload_offset(table_len) + -(-payload_len // PAGE) * PAGE


def run_key(run_dir: str) -> str:
    """The directory of a run's slots under the memory root: its name and a hash of its directory,
    so two runs of one name under different checkpoint roots never share slots."""
    run_dir = os.path.abspath(run_dir)
    return f"{os.path.basename(run_dir)}.{xxhash.xxh64_hexdigest(run_dir.encode())[:12]}"


def location(node: str, key: str, rank: int, slot: str) -> str:
    """A memory copy's URI: the node holding it, then the slot's place under the memory root."""
    return f"memory://{node}/{key}/rank_{rank}/{slot}"


def path_of(memory_root: str, uri: str) -> str:
    """The slot file a ``memory://node/key/rank_r/slot_k`` location names under ``memory_root``."""
    rest = uri.split("://", 1)[1].split("/", 1)[1]
    return os.path.join(memory_root, rest)


# --- reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    seq: int
    table_len: int
    payload_off: int
    payload_len: int
    digest: bytes
    global_step: int


def read_header(buf: Any, where: str) -> Header:
    if len(buf) < PAGE:
        raise SlotError(f"{where}: {len(buf)} bytes, shorter than a slot header ({PAGE})")
    magic, seq, table_len, payload_off, payload_len, digest, step = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise SlotError(f"{where}: not a ckptd memory slot (magic {magic!r})")
    return Header(seq, table_len, payload_off, payload_len, bytes(digest), step)


def commit_word(buf: Any) -> int:
    return struct.unpack_from("<Q", buf, SEQ_OFFSET)[0]


#: the unit a reader streams a slot in: bounded memory whatever a tensor's size
CHUNK = 4 << 20


def truncated(path: str, fd: int, needed: int) -> SlotError:
    """The error for a slot shorter than its header says (its file cut while it was read)."""
    try:
        have = os.fstat(fd).st_size
    except OSError:
        have = -1
    return SlotError(f"{path}: slot truncated: header says {needed} bytes, file has {have}",
                     hint="the job (or someone) shrank the slot; it is skipped until rewritten")


def pread_into(fd: int, dst: memoryview, offset: int, path: str, needed: int) -> None:
    """Fill ``dst`` from ``offset`` with pread: a slot cut short becomes a SlotError, never the
    SIGBUS a mapping of it would raise in the whole process."""
    done = 0
    while done < len(dst):
        n = os.preadv(fd, [dst[done:]], offset + done)
        if n <= 0:
            raise truncated(path, fd, needed)
        done += n


@dataclass
class Snapshot:
    """A committed slot, open by descriptor: every read is a pread (a slot truncated meanwhile is a
    :class:`SlotError`, not a SIGBUS). Valid only while :attr:`seq` is still the slot's commit word
    (:meth:`still_committed`): the writer may begin to overwrite it at any time after."""

    path: str
    seq: int
    table: Table
    table_bytes: bytes
    digest_bytes: bytes
    fd: int
    payload_off: int
    payload_len: int

    @property
    def digest(self) -> str:
        return self.digest_bytes.hex()

    @property
    def nbytes(self) -> int:
        return self.table.payload_len

    @property
    def _end(self) -> int:
        return self.payload_off + self.payload_len

    def readinto(self, e: Entry, dst: memoryview, pos: int = 0) -> None:
        """Bytes ``[pos, pos+len(dst))`` of tensor ``e`` into ``dst`` (the caller's own buffer)."""
        pread_into(self.fd, dst, self.payload_off + e.offset + pos, self.path, self._end)

    def read_tensor(self, e: Entry) -> memoryview:
        """Tensor ``e``'s bytes, copied into a new writable buffer."""
        buf = memoryview(bytearray(e.nbytes))
        self.readinto(e, buf)
        return buf

    def chunks(self, size: int = CHUNK) -> Iterator[tuple[Entry, int, memoryview]]:
        """(entry, position in it, bytes) of every tensor in table order, in chunks of at most
        ``size`` read into one reused buffer: each chunk is valid until the next is yielded."""
        buf = memoryview(bytearray(size))
        for e in self.table.entries:
            if e.is_tensor:
                for pos in range(0, e.nbytes, size):
                    part = buf[:min(size, e.nbytes - pos)]
                    self.readinto(e, part, pos)
                    yield e, pos, part

    def still_committed(self) -> bool:
        word = os.pread(self.fd, 8, SEQ_OFFSET)
        return len(word) == 8 and int.from_bytes(word, "little") == self.seq

    def hasher(self) -> Any:
        """xxh3-128 seeded with the table: feed it each tensor's bytes in table order."""
        return xxhash.xxh3_128(self.table_bytes)

    def check(self, got: bytes) -> bool:
        """Judge a digest computed over this snapshot: True = whole; False = the writer began to
        overwrite the slot meanwhile (a torn read, not damage); a mismatch raises SlotError."""
        if not self.still_committed():
            return False
        if got != self.digest_bytes:
            raise SlotError(f"{self.path}: digest mismatch (the slot says {self.digest}, its contents hash to "
                            f"{got.hex()}): the snapshot of step {self.table.global_step} is damaged")
        return True

    def verify(self) -> bool:
        """Hash the whole snapshot, streamed in chunks, and :meth:`check` it."""
        hasher = self.hasher()
        for _, _, part in self.chunks():
            hasher.update(part)
        return self.check(hasher.digest())

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def check_owner(st: os.stat_result, where: str, uid: int | None) -> None:
    """A slot readable or writable by others, or owned by another user than the run's, is refused:
    a region of the node's shared memory is no one's proof of anything until its owner is the job's."""
    if not stat.S_ISREG(st.st_mode):
        raise SlotError(f"{where}: not a regular file", hint="remove it; the job re-creates its slots")
    if st.st_mode & 0o077:
        raise SlotError(f"{where}: mode {stat.S_IMODE(st.st_mode):04o}, other users may read or change it "
                        f"(a slot is 0600)", hint="the job creates its slots 0600; remove this one")
    if uid is not None and st.st_uid != uid:
        raise SlotError(f"{where}: owned by uid {st.st_uid}, not by the run's user (uid {uid})",
                        hint="a slot of another user is never read; remove it")


def open_snapshot(path: str, *, uid: int | None = None) -> Snapshot | None:
    """The committed snapshot in slot ``path``, open by descriptor, its table parsed (its digest is
    :meth:`Snapshot.verify`'s job), or None when the slot holds none (never written, being written,
    or overwritten while its table was read). A slot that fails its checks, or is shorter than its
    header says, raises :class:`SlotError` saying why. ``uid``: the owner it must have."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    return snapshot_at(fd, path, uid=uid)


def snapshot_at(fd: int, path: str, *, uid: int | None = None) -> Snapshot | None:
    """:func:`open_snapshot` over an open descriptor, which the snapshot takes over (closed here
    unless a snapshot is returned)."""
    try:
        st = os.fstat(fd)
        check_owner(st, path, uid)
        snap = _snapshot_in(fd, path, st.st_size) if st.st_size >= PAGE else None  # smaller: being created
    except BaseException:
        os.close(fd)
        raise
    if snap is None:
        os.close(fd)
    return snap


def _seq_at(fd: int) -> int:
    word = os.pread(fd, 8, SEQ_OFFSET)
    return int.from_bytes(word, "little") if len(word) == 8 else 0


def _snapshot_in(fd: int, path: str, size: int) -> Snapshot | None:
    head = bytearray(PAGE)
    pread_into(fd, memoryview(head), 0, path, PAGE)
    h = read_header(head, path)
    if h.seq == 0:
        return None
    if h.table_len > MAX_TABLE:
        raise SlotError(f"{path}: the header's table length {h.table_len} is over {MAX_TABLE} bytes")
    needed = max(PAGE + h.table_len, h.payload_off + h.payload_len)
    if needed > size:
        raise truncated(path, fd, needed)
    raw = bytearray(h.table_len)
    pread_into(fd, memoryview(raw), PAGE, path, needed)
    raw = bytes(raw)
    try:
        table = decode_table(raw, path)
    except SlotError:
        if _seq_at(fd) != h.seq:
            return None  # overwritten while read
        raise
    if _seq_at(fd) != h.seq:
        return None
    if table.payload_len > h.payload_len:
        raise SlotError(f"{path}: the table's tensors end at {table.payload_len}, past the payload "
                        f"({h.payload_len} bytes)")
    return Snapshot(path, h.seq, table, raw, h.digest, fd, h.payload_off, h.payload_len)


def newest(paths: list[str], *, uid: int | None = None) -> Snapshot | None:
    """The newest committed, whole snapshot among a rank's slots (skipping damaged ones)."""
    best: Snapshot | None = None
    for path in paths:
        try:
            snap = open_snapshot(path, uid=uid)
            if snap is not None and not snap.verify():
                snap.close()
                snap = None
        except (FileNotFoundError, SlotError):
            continue
        if snap is None:
            continue
        if best is None or snap.seq > best.seq:
            if best is not None:
                best.close()
            best = snap
        else:
            snap.close()
    return best
