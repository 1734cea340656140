"""Flash checkpoints, the job's side: each rank copies its training state into its node's shared
memory at a step end (the memory tier; the slot format is :mod:`ckptd.storage.memslot`).

The training thread does only the copy: one ``numpy.copyto`` per tensor from the tensor's own
memory (MindSpore's ``asnumpy()`` on the CPU is a view, no copy) into the slot's mapping. A
background thread then hashes what was copied and writes the digest and, last, the commit word;
the next snapshot waits for it only if it comes before that thread is done (it then writes the
other slot). The node's ``ckptd serve`` reads committed slots, catalogues them as the step's
``memory`` copies and persists every ``persist_every``-th as a real checkpoint file.

Space is reserved up front (``posix_fallocate`` on tmpfs: a later copy cannot die of SIGBUS on a
full ``/dev/shm``). When two slots do not fit, :class:`MemoryTierUnavailable` says how many bytes
were needed and how many are free; the job trains on with file saves only.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import shutil
import stat
import threading
import time
from typing import Any

import numpy as np
import xxhash

from ckptd.storage import memslot

#: where slots live unless ``$CKPTD_MEMORY_ROOT`` says otherwise (tmpfs: RAM, gone at reboot)
DEFAULT_ROOT = "/dev/shm/ckptd"
#: bytes hashed per call: xxhash holds the GIL while it hashes, so the training thread gets it back
#: between chunks (a 4 MiB chunk is about a millisecond)
HASH_CHUNK = 4 << 20
#: the longest a slot is kept for the daemon to persist (a daemon that is down must not pin it)
HOLD_MAX = 120.0

log = logging.getLogger(__name__)


class MemoryTierUnavailable(RuntimeError):
    """The memory tier cannot run for this rank (space, permissions); the job goes on with files."""


def memory_root() -> str:
    return os.environ.get("CKPTD_MEMORY_ROOT") or DEFAULT_ROOT


def rank_dir(root: str, run_dir: str, rank: int) -> str:
    return os.path.join(root, memslot.run_key(run_dir), f"rank_{rank}")


def _make_dirs(root: str, run_dir: str, rank: int) -> str:
    # the memory root is shared by every user's jobs on the node, like /tmp (sticky); a run's
    # directories are its user's alone
    if not os.path.isdir(root):
        try:
            os.makedirs(root, exist_ok=True)
            os.chmod(root, 0o1777)
        except PermissionError as exc:
            raise MemoryTierUnavailable(f"cannot create the memory root {root}: {exc.strerror}") from None
    path = rank_dir(root, run_dir, rank)
    for d in (os.path.dirname(path), path):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        try:  # checked and set through a descriptor: the name may be swapped for a link meanwhile
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            fd = -1
        try:
            st = os.fstat(fd) if fd >= 0 else None
            if st is None or st.st_uid != os.geteuid():
                raise MemoryTierUnavailable(f"{d} is not a directory of this user (uid {os.geteuid()}): refusing to "
                                            "put this rank's state there")
            if stat.S_IMODE(st.st_mode) != 0o700:
                os.fchmod(fd, 0o700)  # exactly 0700 whatever the umask (the daemon refuses anything looser)
        finally:
            if fd >= 0:
                os.close(fd)
    return path


class FlashWriter:
    """One rank's two slots. ``snapshot`` copies; a background thread commits. Not thread-safe:
    the training thread calls it."""

    def __init__(self, run_dir: str, rank: int, world_size: int, *, encrypted: bool = False,
                 root: str | None = None) -> None:
        self.run_dir = os.path.abspath(run_dir)
        self.run, self.rank, self.world_size, self.encrypted = os.path.basename(self.run_dir), rank, world_size, encrypted
        self.root = root or memory_root()
        self.dir = _make_dirs(self.root, self.run_dir, rank)
        self.paths = [os.path.join(self.dir, name) for name in memslot.SLOTS]
        self.maps: list[Any] = [None, None]
        self.sizes = [0, 0]  # bytes of each slot file, once mapped
        self.rooms = [0, 0]  # bytes reserved for each slot's table
        # one committer thread for the writer's life (a thread per snapshot cost the training
        # thread its start-up and GIL hand-offs every step)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._committer: threading.Thread | None = None
        self.error: BaseException | None = None
        # numbering continues after a restart: a reader must never see an older seq as newer
        # the node daemon's persist cadence: a snapshot of such a step is kept until its file exists
        self.persist_every = memslot.read_persist_every(self.root)
        self.held: tuple[int, str, float] | None = None  # (slot, the file it waits for, since)
        newest = memslot.newest(self.paths, uid=os.geteuid())
        self.seq, self.newest_slot = (newest.seq, self.paths.index(newest.path)) if newest else (0, 1)
        if newest is not None:
            newest.close()

    # --- space ----------------------------------------------------------------------------------

    def _reserve(self, slot: int, table_len: int, payload_len: int) -> None:
        """Size and map ``slot`` for a snapshot of this shape. Only that slot changes: the other
        holds the newest snapshot, which a growing state must not destroy. The first time, the
        room for both slots is checked (the error at job start the operator needs)."""
        import mmap

        room = max(memslot.PAGE, -(-table_len * 2 // memslot.PAGE) * memslot.PAGE)  # step numbers grow
        size = memslot.slot_size(room, payload_len)
        first = all(m is None for m in self.maps)
        mine = [slot, 1 - slot] if first else [slot]
        have = sum(os.stat(self.paths[i]).st_blocks * 512 if os.path.exists(self.paths[i]) else 0 for i in mine)
        vfs = os.statvfs(self.root)
        free = vfs.f_bavail * vfs.f_frsize
        if len(mine) * size - have > free:
            raise MemoryTierUnavailable(
                f"the memory tier needs {2 * size} bytes for rank {self.rank}'s two slots ({size} each) in "
                f"{self.root}, and {free} bytes are free there (plus {have} this rank already holds): snapshots are "
                f"off for this rank, file checkpoints go on; give /dev/shm more room (e.g. docker --shm-size) or "
                f"set CKPTD_MEMORY_ROOT")
        if self.maps[slot] is not None:
            self.maps[slot].close()
            self.maps[slot] = None
        path = self.paths[slot]
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != 0o600:
                # exactly 0600 whatever the umask (0400 would lock the job out of its own slot on reopen)
                os.fchmod(fd, 0o600)
                st = os.fstat(fd)
            memslot.check_owner(st, path, os.geteuid())
            if st.st_size != size:
                # this slot's snapshot (if any) is the older one, about to be overwritten anyway
                os.ftruncate(fd, 0)
                os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise MemoryTierUnavailable(f"{path}: no room for {size} bytes in {self.root} "
                                                f"(fallocate: {exc.strerror})") from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            self.maps[slot] = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.sizes[slot], self.rooms[slot] = size, room

    # --- snapshot -------------------------------------------------------------------------------

    def snapshot(self, global_step: int, epoch: int, file: str, tensors: list[tuple[str, np.ndarray]],
                 values: list[tuple[str, Any]], order: list[str] | None = None) -> float:
        """Copy ``tensors`` (C-contiguous arrays) and ``values`` into the free slot; returns the
        seconds the caller was held. ``order``: entry names in the shard file's order (default:
        tensors, then values). ``file``: the shard file this step would be, relative to the run."""
        t0 = time.perf_counter()
        self.wait()
        # not np.ascontiguousarray: it makes a 0-d array (1,), and the file would then say so
        arrays = {name: a if a.flags.c_contiguous else a.copy(order="C") for name, a in tensors}
        specs = [(n, a.dtype.str, tuple(a.shape), a.nbytes) for n, a in arrays.items()]
        placed = dict(zip(arrays, memslot.layout_of(specs)))
        by_name: dict[str, memslot.Entry] = {
            n: memslot.Entry(n, a.dtype.str, tuple(a.shape), *placed[n]) for n, a in arrays.items()}
        by_name.update({n: memslot.Entry(n, value=v) for n, v in values})
        names = order if order is not None else [n for n, _ in tensors] + [n for n, _ in values]
        table = memslot.Table(self.run, self.run_dir, self.rank, self.world_size, int(global_step), int(epoch), file,
                              tuple(by_name[n] for n in names), self.encrypted)
        raw = table.encode()
        payload_len = table.payload_len
        slot = self._free_slot()
        if len(raw) > self.rooms[slot] or memslot.slot_size(self.rooms[slot], payload_len) != self.sizes[slot]:
            self._reserve(slot, len(raw), payload_len)
        if self.persist_every and global_step % self.persist_every == 0:
            self.held = (slot, os.path.join(self.run_dir, file), time.monotonic())
        m = self.maps[slot]
        off = memslot.payload_offset(self.rooms[slot])
        m[memslot.SEQ_OFFSET:memslot.SEQ_OFFSET + 8] = b"\0" * 8  # uncommitted from here on
        m[:memslot.HEADER.size] = memslot.HEADER.pack(memslot.MAGIC, 0, len(raw), off, payload_len, b"\0" * 16,
                                                      int(global_step))
        m[memslot.PAGE:memslot.PAGE + len(raw)] = raw
        for name, a in arrays.items():
            e = by_name[name]
            np.copyto(np.ndarray(a.shape, a.dtype, buffer=m, offset=off + e.offset), a, casting="no")
        stall = time.perf_counter() - t0
        if self._committer is None:
            self._committer = threading.Thread(target=self._commit_loop, name="ckptd-flash-commit", daemon=True)
            self._committer.start()
        self._idle.clear()
        self._jobs.put((slot, raw, table, off))
        return stall

    def _free_slot(self) -> int:
        """The slot a snapshot goes to: the one without the newest snapshot -- unless that one holds a
        step the daemon has yet to persist; the newest is then overwritten (while it is, the held
        step is the one whole snapshot: the price of persisting it)."""
        slot = 1 - self.newest_slot
        if self.held is not None and self.held[0] == slot:
            _, waits_for, since = self.held
            if os.path.exists(waits_for) or time.monotonic() - since > HOLD_MAX:
                self.held = None
            else:
                return self.newest_slot
        return slot

    def _commit_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._commit(*job)
            self._idle.set()

    def _commit(self, slot: int, raw: bytes, table: memslot.Table, off: int) -> None:
        try:
            m = self.maps[slot]
            mv = memoryview(m)
            hasher = xxhash.xxh3_128(raw)
            for e in table.entries:
                if e.is_tensor:
                    start = off + e.offset
                    for pos in range(start, start + e.nbytes, HASH_CHUNK):
                        hasher.update(mv[pos:min(pos + HASH_CHUNK, start + e.nbytes)])
            mv.release()
            m[memslot.DIGEST_OFFSET:memslot.DIGEST_OFFSET + 16] = hasher.digest()
            seq = self.seq + 1
            m[memslot.SEQ_OFFSET:memslot.SEQ_OFFSET + 8] = seq.to_bytes(8, "little")  # the commit, last
            self.seq, self.newest_slot = seq, slot
        except BaseException as exc:  # noqa: BLE001 -- reported by the next wait(), on the training thread
            self.error = exc

    def wait(self) -> None:
        """The last snapshot is committed (or its failure raised here)."""
        self._idle.wait()
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def close_maps(self) -> None:
        for i, m in enumerate(self.maps):
            if m is not None:
                m.close()
                self.maps[i] = None

    def release(self) -> None:
        """A clean end: the run's slots are no one's resume point any more (its files are)."""
        self.wait()
        if self._committer is not None:
            self._jobs.put(None)
            self._committer.join()
            self._committer = None
        self.close_maps()
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.dir))  # the run's directory, once its last rank is gone
        except OSError:
            pass


def load_into(path: str, targets: dict[str, np.ndarray], *, verified: str | None = None) -> memslot.Table:
    """Copy the committed snapshot in slot ``path`` into ``targets`` (name -> writable C-contiguous
    array, e.g. a MindSpore parameter's ``asnumpy()`` view on the CPU). Every name, shape and dtype
    is checked before a byte is copied.

    ``verified``: the digest the node's daemon computed when it catalogued this copy (the resume
    answer's ``digest`` of the shard). When the slot's header carries that same digest, the daemon's
    verdict covers these bytes and the load is a plain copy (one read of the slot, at memcpy speed):
    the daemon re-hashes slots every ``memory_scrub_after`` seconds, which is the file tier's trust
    model too (a launcher does not re-hash a verified file before loading it). Without it, the
    digest is computed in the same pass as the copy (each chunk hashed, then copied while it is in
    the cache). Either way the commit word is checked after the copy: a snapshot overwritten
    meanwhile, or damaged, raises :class:`~ckptd.storage.memslot.SlotError` *after* the parameters
    were written, so a caller must not train on after that error (restore() raises it out of the
    job, which then restarts from what the oracle answers next)."""
    snap = memslot.open_snapshot(path, uid=os.geteuid())
    if snap is None:
        raise memslot.SlotError(f"{path}: holds no committed snapshot", hint="resume from the files instead")
    try:
        entries = {e.name: e for e in snap.table.entries if e.is_tensor}
        missing = [n for n in targets if n not in entries]
        wrong = [n for n, a in targets.items() if n in entries and (tuple(a.shape) != entries[n].shape
                                                                    or a.dtype.str != entries[n].dtype)]
        if missing or wrong:
            raise memslot.SlotError(f"{path}: the snapshot does not match this model: missing {missing[:3]}, "
                                    f"other shape or dtype {wrong[:3]}")
        if verified is not None and verified == snap.digest:
            for e in entries.values():
                if e.name in targets:  # pread straight into the parameter: no mapping to fault on
                    snap.readinto(e, memoryview(targets[e.name].reshape(-1).view(np.uint8)))
            if not snap.still_committed():
                raise memslot.SlotError(f"{path}: overwritten while it was loaded", hint="resume from the files instead")
            return snap.table
        hasher = snap.hasher()
        for e, pos, chunk in snap.chunks(HASH_CHUNK):
            hasher.update(chunk)
            if e.name in targets:
                dst = targets[e.name].reshape(-1).view(np.uint8)
                dst[pos:pos + len(chunk)] = np.frombuffer(chunk, np.uint8)
        if not snap.check(hasher.digest()):  # raises on a damaged snapshot
            raise memslot.SlotError(f"{path}: overwritten while it was loaded", hint="resume from the files instead")
        return snap.table
    finally:
        snap.close()
