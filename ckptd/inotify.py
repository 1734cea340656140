"""Linux inotify for the watcher's hot path: one reader thread, paths out, nothing else.

Why not watchdog's observer on Linux: per event it hops three threads (inotify reader → emitter →
observer dispatch), builds event objects ckptd discards (the watcher only needs "look at this
path again"), and pairs every ``IN_MOVED_TO`` with its ``IN_MOVED_FROM`` by scanning a queue —
quadratic in a burst where 512 ranks rename their shards at once. Measured on a 512-rank burst it
was about a third of the daemon's CPU (bench/RESULTS.md). watchdog stays the portable backend
(``watch_backend = "watchdog"``, and the default off Linux).

What the watcher relies on, and this module promises:

* every path below the root that may have changed is reported (``on_paths``) at least once after
  it changed, with names the caller's ``wanted`` filter rejects left out (``*.tmp``: a save in
  flight is never a shard, and its create/close/rename-away would be three wasted examinations);
* a directory that appears is watched *before* it is listed, so a file created in between is
  reported by the listing or by an event (duplicates are harmless: the watcher debounces);
* anything that may have lost events — the kernel queue overflowed, a watch could not be added
  (``fs.inotify.max_user_watches``), a directory was moved away, the root itself went — is
  reported through ``on_lost``; the watcher answers with a full rescan, which is the source of
  truth anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import os
import select
import struct
import threading
from collections.abc import Callable

from ckptd.errors import CkptdError

log = logging.getLogger("ckptd.inotify")

# <sys/inotify.h>
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_UNMOUNT = 0x00002000
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000

# Changes only: no IN_MODIFY (every write() of a multi-GB save), no IN_ATTRIB (MindSpore's chmod
# 0400 right after its rename), no opens or reads (ckptd's own verification would feed back).
# IN_EXCL_UNLINK: a file deleted while still open (rotation during a read) stops reporting.
_MASK = (IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
         | IN_ONLYDIR | IN_DONT_FOLLOW | IN_EXCL_UNLINK)
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name
_READ_SIZE = 256 * 1024  # ~900 shard renames per read(); the kernel never splits an event
_ROOT_RETRY_MS = 2000


class InotifyError(CkptdError):
    code = "inotify"
    default_hint = "check fs.inotify.max_user_instances / max_user_watches, or set watch_backend = \"watchdog\""


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.inotify_init1.argtypes = [ctypes.c_int]
    libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


def available() -> bool:
    """True where the kernel interface exists (Linux); elsewhere the watcher uses watchdog."""
    try:
        return hasattr(_libc(), "inotify_init1")
    except OSError:
        return False


class InotifyTree:
    """Recursive inotify watch of one directory tree.

    Call order: ``open()`` (watches the whole tree; from here on the kernel queues events) →
    ``start()`` (the reader thread delivers them) → ``close()``. ``on_paths`` and ``on_lost``
    run on the reader thread and must be quick (the watcher only queues).
    """

    def __init__(
        self,
        root: str,
        on_paths: Callable[[list[str]], None],
        on_lost: Callable[[str], None],
        *,
        wanted: Callable[[str], bool] = lambda name: True,
    ) -> None:
        self.root = os.path.abspath(root)
        self.on_paths = on_paths
        self.on_lost = on_lost
        self.wanted = wanted
        self._fd = -1
        self._wake_r = self._wake_w = -1
        self._path_of: dict[int, str] = {}  # wd -> directory path (only this thread changes it after open)
        self._wd_of: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self._full_warned = False

    # --- lifecycle -----------------------------------------------------------------------------

    def open(self) -> None:
        fd = _libc().inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise InotifyError(f"cannot start watching files: inotify_init1: {os.strerror(err)}", path=self.root)
        self._fd = fd
        self._wake_r, self._wake_w = os.pipe()
        if self._watch(self.root) is None:
            self.close()
            raise InotifyError("cannot watch the checkpoint root", path=self.root)
        self._add_tree(self.root, report=False)  # the daemon's first rescan covers what exists now

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ckptd-inotify", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
            if self._thread.is_alive():  # still walking a huge tree: leak the fds rather than pull them away
                log.warning("inotify reader did not stop within 5 s; leaving its descriptors open")
                return
        for fd in (self._fd, self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._fd = self._wake_r = self._wake_w = -1

    @property
    def watched(self) -> int:
        return len(self._path_of)

    # --- the reader thread ---------------------------------------------------------------------

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            # the root itself gone (deleted, moved, unmounted): look for it again every few seconds
            root_gone = self.root not in self._wd_of
            ready = {fd for fd, _ in poller.poll(_ROOT_RETRY_MS if root_gone else None)}
            if self._wake_r in ready:
                return
            if root_gone and os.path.isdir(self.root):
                paths = self._add_tree(self.root, report=True)
                if self.root in self._wd_of:
                    self.on_lost("the checkpoint root is back")  # what happened meanwhile: the rescan finds it
                    if paths:
                        self.on_paths(paths)
            if self._fd not in ready:
                continue
            try:
                buf = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:
                continue
            except OSError as exc:
                self.on_lost(f"reading inotify events failed: {exc.strerror}")
                return
            try:
                self._dispatch(buf)
            except Exception:  # never let one odd event end watching; the rescan repairs
                log.exception("handling inotify events failed")
                self.on_lost("an inotify event could not be handled")

    def _dispatch(self, buf: bytes) -> None:
        paths: list[str] = []
        unpack, path_of, wanted = _EVENT.unpack_from, self._path_of, self.wanted
        i, end = 0, len(buf)
        while i < end:
            wd, mask, _cookie, length = unpack(buf, i)
            name = buf[i + 16:i + 16 + length].rstrip(b"\0")
            i += 16 + length
            if mask & IN_Q_OVERFLOW:
                self._on_overflow()
                continue
            if mask & IN_IGNORED:
                self._forget_wd(wd)
                continue
            base = path_of.get(wd)
            if base is None:
                continue
            if not name:  # about the watched directory itself
                if mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT) and base == self.root:
                    self.on_lost("the checkpoint root was deleted, moved or unmounted")
                    if mask & IN_MOVE_SELF:  # the watch follows the moved inode: stop it, wait for the root
                        self._forget_tree(self.root)
                continue
            sname = os.fsdecode(name)
            path = base + os.sep + sname
            if mask & IN_ISDIR:
                if mask & (IN_CREATE | IN_MOVED_TO):
                    paths += self._add_tree(path, report=True)
                elif mask & IN_MOVED_FROM:
                    # its files vanished from here without events of their own
                    self._forget_tree(path)
                    self.on_lost(f"directory moved away: {path}")
                continue
            if wanted(sname):
                paths.append(path)
        if paths:
            self.on_paths(paths)

    def _on_overflow(self) -> None:
        # Events were dropped, possibly the creation of directories: watch whatever is not
        # watched yet, then let the rescan find every file that changed meanwhile.
        log.warning("inotify queue overflowed under %s; rescanning", self.root)
        self._add_tree(self.root, report=False)
        self.on_lost("inotify queue overflowed")

    # --- watches -------------------------------------------------------------------------------

    def _watch(self, path: str) -> int | None:
        wd = _libc().inotify_add_watch(self._fd, os.fsencode(path), _MASK)
        if wd < 0:
            err = ctypes.get_errno()
            if err == errno.ENOSPC and not self._full_warned:
                self._full_warned = True
                log.error(
                    "cannot watch %s: the inotify watch limit is reached (%d watched); changes below it are "
                    "found only by the periodic rescan. Raise fs.inotify.max_user_watches.", path, len(self._path_of))
                self.on_lost("inotify watch limit reached")
            elif err not in (errno.ENOENT, errno.ENOTDIR, errno.ENOSPC):
                log.warning("cannot watch %s: %s", path, os.strerror(err))
            return None
        old = self._path_of.get(wd)
        if old is not None and old != path:  # the same directory under a new name (moved)
            self._wd_of.pop(old, None)
        self._path_of[wd] = path
        self._wd_of[path] = wd
        return wd

    def _add_tree(self, top: str, *, report: bool) -> list[str]:
        """Watch ``top`` and every directory below it (symlinks are not followed); with ``report``,
        return the files found (they may have been written before their directory was watched)."""
        found: list[str] = []
        stack = [top]
        while stack:
            path = stack.pop()
            # always ask the kernel: it returns the existing watch for a watched inode, and a new
            # one for a directory re-created under a name whose old watch is not gone yet (its
            # IN_IGNORED comes only once nothing holds the old inode open)
            if self._watch(path) is None:
                continue
            try:
                with os.scandir(path) as it:
                    for entry in it:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        elif report and self.wanted(entry.name):
                            found.append(entry.path)
            except OSError:
                continue  # gone already: its deletion events follow
        return found

    def _forget_tree(self, top: str) -> None:
        prefix = top + os.sep
        for path in [p for p in self._wd_of if p == top or p.startswith(prefix)]:
            wd = self._wd_of.pop(path)
            self._path_of.pop(wd, None)
            _libc().inotify_rm_watch(self._fd, wd)  # its IN_IGNORED then finds nothing to forget

    def _forget_wd(self, wd: int) -> None:
        path = self._path_of.pop(wd, None)
        if path is not None and self._wd_of.get(path) == wd:
            del self._wd_of[path]
