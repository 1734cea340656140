"""The memory tier, the daemon's side: a node's daemon owns the slots in its node's shared memory.

One thread (the daemon's ``ckptd-memory``) scans the memory root. Per slot it reads the commit
word only (16 bytes); a slot whose word changed is read by descriptor (pread, never a mapping: a
slot truncated while read would SIGBUS the daemon; cut short it is a refusal), its table parsed,
its identity checked and its digest streamed in chunks. A committed, whole snapshot becomes a
verified ``memory`` copy of its rank of its step (``catalog.copies``; the step row is the one its
file would have, created as ingest would). The copy that slot held before goes ``deleted`` (the
slot holds one snapshot at a time), and a step left with nothing anywhere loses its rows. Every
``persist_every``-th global step is written as a real checkpoint file at the path the table names,
in the run's layout, byte for byte what ``mindspore.save_checkpoint`` writes (CRC; encrypted with
the daemon's key when the run is), through the confined store with an atomic write: the watcher
then ingests and verifies it like any file. Training never waits for any of it.

Refused (logged once per slot and snapshot, and recorded as a ``corrupt`` copy when its identity
is known): a slot of another user than its run directory's, or readable by others; a slot
shorter than its header says; a table naming
a run directory outside this daemon's root, another rank, or a file outside the run; a global step
that disagrees with the step's; shapes that are not the strategy's slice for the rank; a digest
mismatch. A torn read (the job began overwriting the slot while it was read) is retried at the
next scan, never answered. The root is walked by descriptor without following links
(``ckptd.storage.memroot``): a linked region, rank directory or slot, or one of another user or
mode, is refused. Regions whose slots have not changed for ``release_after`` seconds
(no live job) are removed, their copies marked deleted. A region whose slots keep failing is
looked at again with back-off (1 s doubling to 60 s, reset when a commit word there moves; its
commit words are still read every scan).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from ckptd import runlayout
from ckptd.runnames import parse_rank_dir
from ckptd.catalog import copies, removal
from ckptd.errors import CkptdError
from ckptd.states import ShardState, Tier
from ckptd.storage import PosixStorage, memroot, memslot
from ckptd.storage.memroot import Region

log = logging.getLogger("ckptd.memory")

#: a region whose slots keep failing is looked at again after this, doubling up to the maximum
BACKOFF_MIN, BACKOFF_MAX = 1.0, 60.0


@dataclass
class Seen:
    """What this daemon last made of a slot: its commit word and the copy it recorded."""

    seq: int
    ckpt_id: int | None = None
    digest: str | None = None
    checked: float = 0.0  # when its digest was last computed (monotonic)
    failed: bool = False  # refused or corrupt: its region is re-examined with back-off


def region_of(path: str) -> str:
    """The run key of a slot path ``<root>/<key>/rank_<r>/<slot>``."""
    return os.path.basename(os.path.dirname(os.path.dirname(path)))


class MemoryTier:
    def __init__(self, sessions: sessionmaker[Session], store: PosixStorage, memory_root: str, node: str, *,
                 persist_every: int = 0, key: bytes | None = None, release_after: float = 3600.0,
                 scrub_after: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.sessions, self.store, self.root, self.node = sessions, store, memory_root, node
        self.persist_every, self.key, self.release_after = persist_every, key, release_after
        self.scrub_after, self.clock = scrub_after, clock
        # run key -> (when it is examined next, the delay that set it): a region whose slots keep
        # failing costs a scan of the root once per delay, not once per scan interval
        self.backoff: dict[str, tuple[float, float]] = {}
        self._strategies: dict[tuple[str, str], object] = {}
        self.seen: dict[str, Seen] = {}
        self._refused: set[tuple[str, int]] = set()
        self.active: dict[str, float] = {}  # run key -> when a commit word there last moved (monotonic)
        self.idle = True  # no region under the memory root at the last scan
        self.snapshots = 0  # catalogued (read at /metrics scrapes from another thread: ints, no lock needed)
        self.persisted = 0
        self.bytes_hashed = 0
        # the settled barrier's view (another thread asks): scans started / finished, and a wake-up
        # so a question after a crash is answered after a scan of the slots as they are now
        self._fence = threading.Condition()
        self._started = self._finished = 0
        self.wake = threading.Event()

    # --- start: what the catalog says this node holds ---------------------------------------------

    def reconcile(self) -> None:
        """At start: a copy the catalog says this node holds is kept only if its slot still holds
        that snapshot (same digest); a reboot or a cleared /dev/shm leaves none. Tells jobs the
        persist cadence (``memslot.PERSIST_MARKER``)."""
        self.advertise()
        with self.sessions.begin() as s:
            gone: list[int] = []
            for ckpt_id, _, loc, digest in copies.live_on_node(s, Tier.MEMORY, self.node):
                path = memslot.path_of(self.root, loc)
                header = self._parse_header(memroot.head_at(self.root, path, memslot.HEADER.size), path)
                if header is not None and header.seq and header.digest.hex() == digest:
                    # the same snapshot by its header: the next scan's scrub hashes it again
                    self.seen[path] = Seen(header.seq, ckpt_id, digest)
                else:
                    gone += copies.set_state_at(s, Tier.MEMORY, loc, ShardState.DELETED, "the slot no longer holds it")
            self._prune(s, gone)

    def advertise(self) -> None:
        """Write ``persist_every`` into the memory root (created like a job would: shared, sticky)."""
        from ckptd.atomic import atomic_write

        try:
            if not os.path.isdir(self.root):
                os.makedirs(self.root, exist_ok=True)
                os.chmod(self.root, 0o1777)
            with atomic_write(os.path.join(self.root, memslot.PERSIST_MARKER), overwrite=True) as fh:
                fh.write(str(self.persist_every).encode())
        except OSError as err:
            log.warning("memory tier: cannot write %s in %s (%s): jobs will not keep slots for persisting",
                        memslot.PERSIST_MARKER, self.root, err.strerror)

    # --- one pass ------------------------------------------------------------------------------------

    def scan_fence(self) -> int:
        """Ask for a scan now; :meth:`scanned_since` of the number returned is true once a scan that
        *started* after this call finished: every slot committed by then was examined."""
        with self._fence:
            self.wake.set()
            return self._started + 1

    def scanned_since(self, fence: int) -> bool:
        with self._fence:
            return self._finished >= fence

    def scan(self) -> int:
        """One pass over the memory root; returns the number of snapshots catalogued."""
        with self._fence:
            self._started += 1
            mine = self._started
        done = self._scan()
        with self._fence:
            self._finished = mine
        return done

    def _scan(self) -> int:
        done = 0
        now = self.clock()
        root_fd = memroot.open_root(self.root)
        visited: set[str] = set()
        self.idle = True
        if root_fd is not None:  # a root wiped whole: everything it held is forgotten below
            try:
                regions = self._regions(root_fd, now)
                self.idle = not regions
                for region in regions:
                    try:
                        done += self._scan_region(root_fd, region, now, visited)
                    finally:
                        region.close()
            finally:
                os.close(root_fd)
        # a region backing off was not looked at: what its slots held is kept until it is
        waiting = {k for k in self.backoff if self._backing_off(k, now)}
        for path in [p for p in self.seen if p not in visited and region_of(p) not in waiting]:
            self._gone(path, "the slot was removed")
        return done

    def _scan_region(self, root_fd: int, region: Region, now: float, visited: set[str]) -> int:
        done, moved, waiting = 0, False, self._backing_off(region.key, now)
        for rank, dir_fd, slot, path in region.slots:
            if not memroot.exists(dir_fd, slot):
                continue  # never written, or removed: _scan forgets what it held
            visited.add(path)
            before = self.seen.get(path)
            # backing off, only commit words are read (16 bytes): a moved one is examined at once,
            # so the settled barrier's scan never misses a new snapshot in a failing region
            if waiting and before is not None and self._word(dir_fd, path) == before.seq:
                continue
            done += self._examine(region, rank, dir_fd, path)
            if before is None or self.seen.get(path) is None or self.seen[path].seq != before.seq:
                self.active[region.key] = now  # a commit word moved: a job is writing here
                moved = True
        if not (region.failed or any(p in self.seen and self.seen[p].failed for *_, p in region.slots)):
            self.backoff.pop(region.key, None)
        elif moved or not waiting:  # backing off with no word moved: the delay runs on
            self._back_off(region.key, now, reset=moved)
        # a slot's mtime says nothing here (stores through a shared mapping of tmpfs do not
        # update it): a region is live while its commit words move
        if now - self.active.setdefault(region.key, now) > self.release_after:
            self._release(root_fd, region.key, [p for *_, p in region.slots])
            del self.active[region.key]
        return done

    def _backing_off(self, key: str, now: float) -> bool:
        b = self.backoff.get(key)
        return b is not None and now < b[0]

    def _back_off(self, key: str, now: float, reset: bool) -> None:
        """Next look at a failing region after 1 s, doubling to 60 s; from 1 s again after a
        commit word moved (a job wrote something new there)."""
        b = self.backoff.get(key)
        delay = BACKOFF_MIN if reset or b is None else min(b[1] * 2, BACKOFF_MAX)
        self.backoff[key] = (now + delay, delay)

    def _regions(self, root_fd: int, now: float) -> list[Region]:
        """The regions under the memory root, each level opened by descriptor without following a
        link and owner-checked (``ckptd.storage.memroot``); what fails is refused, logged once."""
        out, keys = [], memroot.names(root_fd)
        for gone in set(self.backoff) - set(keys):  # a region removed: nothing to back off from
            del self.backoff[gone]
        for key in keys:
            if key.startswith(".") or (key not in self.active and self._backing_off(key, now)):
                continue  # ckptd's own persist marker (and temp name); a region refused whole, backing off
            where = os.path.join(self.root, key)
            try:
                fd, uid = memroot.private_dir(root_fd, key, where)
            except FileNotFoundError:
                continue
            except memslot.SlotError as err:
                self._refuse_once(where, 0, str(err))
                self._back_off(key, now, reset=False)
                continue
            region = Region(key, uid, [fd], [])
            try:
                for name in memroot.names(fd):
                    rank = parse_rank_dir(name)
                    if rank is None:
                        continue
                    try:
                        rank_fd, _ = memroot.private_dir(fd, name, os.path.join(where, name), uid)
                    except FileNotFoundError:
                        continue
                    except memslot.SlotError as err:
                        self._refuse_once(os.path.join(where, name), 0, str(err))
                        region.failed = True
                        continue
                    region.fds.append(rank_fd)
                    region.slots += [(rank, rank_fd, slot, os.path.join(where, name, slot)) for slot in memslot.SLOTS]
            except OSError:
                region.close()
                continue
            out.append(region)
        return out

    @staticmethod
    def _header(dir_fd: int, path: str) -> memslot.Header | None:
        """The slot's header (its commit word is what a scan compares), None when unreadable;
        a slot that is a link raises SlotError."""
        try:
            fd = memroot.open_slot(dir_fd, os.path.basename(path), path)
        except OSError:
            return None
        try:
            return MemoryTier._parse_header(os.pread(fd, memslot.HEADER.size, 0), path)
        finally:
            os.close(fd)

    def _word(self, dir_fd: int, path: str) -> int:
        """A slot's commit word (-1: it is a link now, which _examine refuses)."""
        try:
            header = self._header(dir_fd, path)
        except memslot.SlotError:
            return -1
        return header.seq if header is not None else 0

    @staticmethod
    def _parse_header(head: bytes | None, path: str) -> memslot.Header | None:
        try:
            return memslot.read_header(head + b"\0" * (memslot.PAGE - len(head)), path) if head else None
        except memslot.SlotError:
            return None

    def _open(self, region: Region, dir_fd: int, path: str) -> memslot.Snapshot | None:
        fd = memroot.open_slot(dir_fd, os.path.basename(path), path)
        return memslot.snapshot_at(fd, path, uid=region.uid)

    def _examine(self, region: Region, rank: int, dir_fd: int, path: str) -> int:
        try:
            header = self._header(dir_fd, path)
        except memslot.SlotError as err:
            self._refuse_once(path, 0, str(err))
            self._gone(path, "the slot was replaced by a link")
            self.seen[path] = Seen(0, failed=True)
            return 0
        seq = header.seq if header is not None else 0
        known = self.seen.get(path)
        if known is not None and known.seq == seq:
            if known.ckpt_id is not None and self.clock() - known.checked > self.scrub_after:
                self._scrub(region, rank, dir_fd, path, known)
            return 0
        if seq == 0:  # being written: what it held is gone
            if known is not None and known.ckpt_id is not None:
                self._gone(path, "the slot is being overwritten")
            return 0
        try:
            snap = self._open(region, dir_fd, path)
        except FileNotFoundError:
            return 0
        except memslot.SlotError as err:
            self._refuse_once(path, seq, str(err))
            self._gone(path, "the slot was overwritten")
            self.seen[path] = Seen(seq, failed=True)
            return 0
        if snap is None:
            return 0  # torn: the next scan sees it committed or not
        try:
            return self._catalogue(region.key, rank, path, snap)
        finally:
            snap.close()

    def _catalogue(self, key: str, rank: int, path: str, snap: memslot.Snapshot) -> int:
        t = snap.table
        loc = memslot.location(self.node, key, rank, os.path.basename(path))
        run_dir = os.path.join(str(self.store.root), t.run)
        if os.path.abspath(t.run_dir) != run_dir or memslot.run_key(run_dir) != key:
            # another daemon's root (or a region renamed by hand): not this daemon's to judge
            self._gone(path, "the slot was overwritten")
            self.seen[path] = Seen(snap.seq)
            return 0
        name = runlayout.classify(str(self.store.root), os.path.normpath(os.path.join(run_dir, t.file)))
        problem = None
        if not isinstance(name, runlayout.ShardName) or name.run != t.run or name.kind != "trained":
            self._refuse_once(path, snap.seq, f"{path}: names the file {t.file!r}, not a trained step's shard of "
                                              f"run {t.run!r}: not catalogued")
            self._gone(path, "the slot was overwritten")
            self.seen[path] = Seen(snap.seq, failed=True)
            return 0
        if name.rank != rank or t.rank != rank:
            problem = f"the slot of rank {rank} holds rank {t.rank}'s snapshot named {t.file}"
        target = os.path.normpath(os.path.join(run_dir, t.file))
        persist = bool(self.persist_every) and t.global_step % self.persist_every == 0 and \
            self.store.stat(target) is None
        held: dict[str, memoryview] | None = None
        try:
            if problem is None and persist:
                # the job reuses this slot two snapshots later, sooner than a file is written:
                # copy it out once (that copy is the one read of the slot), hash and write the copy
                held = self._copy_out(snap)
                if held is None:
                    return 0
            elif problem is None:
                problem = self._digest_problem(snap)
        except memslot.SlotError as err:
            problem = err.message
        if problem == "torn":
            return 0
        with self.sessions.begin() as s:
            ckpt = copies.step_for_copy(s, t.run, run_dir, name.prefix, name.epoch, name.step, name.incarnation,
                                        t.world_size)
            if problem is None and ckpt.global_step is not None and ckpt.global_step != t.global_step:
                problem = f"holds global step {t.global_step}, the step's files say {ckpt.global_step}"
            if problem is None:
                problem = self._slice_problem(s, ckpt, rank, {e.name: e.shape for e in t.entries if e.is_tensor})
            if problem is None and ckpt.global_step is None:
                ckpt.global_step = t.global_step
            state = ShardState.CORRUPT if problem else ShardState.VERIFIED
            copies.record(s, ckpt.id, rank, Tier.MEMORY, loc, state=state, size=snap.nbytes, digest=snap.digest,
                          node=self.node, error=problem)
            old = copies.set_state_at(s, Tier.MEMORY, loc, ShardState.DELETED, "the slot was overwritten",
                                      except_step=ckpt.id)
            self._prune(s, old)
            ckpt_id = ckpt.id
        if problem:
            log.warning("memory tier: %s: step %s rank %d: %s", path, t.global_step, rank, problem)
        self.seen[path] = Seen(snap.seq, ckpt_id, snap.digest, self.clock(), failed=bool(problem))
        self.snapshots += 1
        if not problem and held is not None:
            self._persist(t, held, target, snap.seq)
        return 1

    def _copy_out(self, snap: memslot.Snapshot) -> dict[str, memoryview] | None:
        """Every tensor of the snapshot copied into this daemon's memory and checked against the
        digest (None: the job began overwriting the slot meanwhile)."""
        buf = memoryview(bytearray(snap.nbytes))
        out: dict[str, memoryview] = {}
        for e in snap.table.entries:
            if e.is_tensor:  # pread into this daemon's buffer: a slot cut meanwhile is a SlotError
                out[e.name] = buf[e.offset:e.offset + e.nbytes]
                snap.readinto(e, out[e.name])
        hasher = snap.hasher()
        for e in snap.table.entries:
            if e.is_tensor:
                hasher.update(out[e.name])
        self.bytes_hashed += snap.nbytes
        return out if snap.check(hasher.digest()) else None

    def _slice_problem(self, s: Session, ckpt, rank: int, shapes: dict[str, tuple[int, ...]]) -> str | None:  # noqa: ANN001
        """Shapes against the strategy the step is bound to -- binding it, as ingest does for a
        step's first file, when it is not yet; None when no strategy is catalogued (as for files:
        the step is then "layout unchecked")."""
        from ckptd.catalog.models import Run, StrategyFile
        from ckptd.format.strategy import parse_strategy_bytes
        from ckptd.service import rank_strategies, stepcheck

        row = s.get(StrategyFile, ckpt.strategy_id) if ckpt.strategy_id else None
        if row is None:
            run = s.get(Run, ckpt.run_id)
            row = rank_strategies.current(s, self.store, run) if run is not None else None
            if row is not None and not row.error:
                ckpt.strategy_id, ckpt.expected_ranks = row.id, row.world_size
        if row is None or row.error or row.content is None:
            return None
        key = (row.path, row.content_hash)
        if key not in self._strategies:
            try:
                self._strategies[key] = parse_strategy_bytes(row.content, row.path)
            except CkptdError:
                return None
        found = stepcheck.slice_problems(rank, shapes, self._strategies[key])
        return "; ".join(found[:3]) if found else None

    def _scrub(self, region: Region, rank: int, dir_fd: int, path: str, known: Seen) -> None:
        """Hash an idle slot again (a job that crashed left it; a restore will trust it): damage
        makes its copy ``corrupt`` with the reason, so it is never answered."""
        known.checked = self.clock()
        try:
            snap = self._open(region, dir_fd, path)
            if snap is None or snap.seq != known.seq:
                return  # being overwritten: the next scan catalogues what comes
            try:
                self.bytes_hashed += snap.nbytes
                snap.verify()
                return
            finally:
                snap.close()
        except FileNotFoundError:
            return
        except memslot.SlotError as err:
            problem = err.message
        loc = memslot.location(self.node, region.key, rank, os.path.basename(path))
        with self.sessions.begin() as s:
            copies.set_state_at(s, Tier.MEMORY, loc, ShardState.CORRUPT, problem)
        log.warning("memory tier: %s", problem)

    def _digest_problem(self, snap: memslot.Snapshot) -> str | None:
        self.bytes_hashed += snap.nbytes
        return None if snap.verify() else "torn"

    # --- persisting --------------------------------------------------------------------------------

    def _persist(self, t: memslot.Table, held: dict[str, memoryview], path: str, seq: int) -> None:
        """The snapshot (its checked copy) as the shard file the job would have written, atomically
        and never over an existing file."""
        if t.encrypted and self.key is None:
            self._refuse_once(path, seq, f"{path}: the run is encrypted and this daemon has no key: step "
                                         f"{t.global_step} stays in memory only (configure key_file)")
            return
        from ckptd.format.checkpoint import write_checkpoint_to

        items = [(e.name, np.frombuffer(held[e.name], dtype=e.dtype).reshape(e.shape) if e.is_tensor else e.value)
                 for e in t.entries]
        try:
            with self.store.create(path, mode=0o400) as fh:
                write_checkpoint_to(fh, items, crc=not t.encrypted, enc_key=self.key if t.encrypted else None)
        except FileExistsError:
            return  # the job's own save of this step landed first: the same bytes
        except (CkptdError, OSError) as err:
            self._refuse_once(path, seq, f"{path}: persisting step {t.global_step} failed: {err}")
            return
        self.persisted += 1
        log.info("memory tier: persisted step %d of %s rank %d to %s", t.global_step, t.run, t.rank, path)

    # --- slots that go ----------------------------------------------------------------------------

    def _gone(self, path: str, why: str) -> None:
        known = self.seen.pop(path, None)
        if known is None or known.ckpt_id is None:
            return
        key = os.path.basename(os.path.dirname(os.path.dirname(path)))
        rank = parse_rank_dir(os.path.basename(os.path.dirname(path)))
        loc = memslot.location(self.node, key, rank if rank is not None else -1, os.path.basename(path))
        with self.sessions.begin() as s:
            self._prune(s, copies.set_state_at(s, Tier.MEMORY, loc, ShardState.DELETED, why))

    def _release(self, root_fd: int, key: str, paths: list[str]) -> None:
        """A region no job has written for ``release_after``: its memory goes back to the node
        (removed by name under the root's descriptor: a link inside is unlinked, never followed)."""
        for path in paths:
            self._gone(path, f"released: no snapshot for {self.release_after:.0f} s")
        memroot.remove_tree(root_fd, key)
        log.info("memory tier: released %s (no snapshot for %.0f s)", key, self.release_after)

    @staticmethod
    def _prune(s: Session, ckpt_ids: list[int]) -> None:
        for ckpt_id in copies.orphans(s, ckpt_ids):
            removal.delete_checkpoint_rows(s, ckpt_id)

    def _refuse_once(self, path: str, seq: int, message: str) -> None:
        if (path, seq) not in self._refused:
            self._refused.add((path, seq))
            log.warning("memory tier: %s", message)


