"""The xxh3-128 digest of a file, taken from the bytes its verification reads anyway.

The daemon records a digest of every shard (it detects later changes together with the size) and
verifies the shard's structure, CRC and encryption. Done as two passes, a shard larger than the
free page cache is read from the disk twice. A :class:`StreamDigest` handed to
``verify_file(..., digest=)`` rides on the verification's own reads instead: the plain mapping a
file is read through (:class:`~ckptd.format.source.MmapSource`, also under an encrypted source,
whose ciphertext it is) hands every range it is done with to :meth:`StreamDigest.consume` before
unmapping it, and the digest hashes it while it is still mapped. :meth:`StreamDigest.finish` then
hashes whatever the verification did not read in full (record headers only in a plaintext file
without CRC, the CRC trailer, the part after structural damage), so the digest is always of the
whole file, whatever the verification found.

xxh3 is a streaming hash: bytes must arrive in file order. Ranges released ahead of the hashed
prefix (parallel CRC threads finish out of order) stay mapped until the prefix reaches them, up to
``ahead_limit`` bytes; beyond that they are unmapped now and hashed later from the page cache
(memory stays bounded; the bytes were read moments ago, so they are normally still cached).
"""

from __future__ import annotations

import threading

import xxhash

from ckptd.format.source import MmapSource

_CHUNK = 64 << 20
#: a gap this small before a released range is hashed with it (headers read but never released)
_GAP = 1 << 20


class StreamDigest:
    """Call order: ``consume`` from any threads while a file is read → ``finish(path)`` once."""

    def __init__(self, ahead_limit: int = 256 << 20) -> None:
        self._h = xxhash.xxh3_128()
        self.done = 0  # bytes [0, done) are hashed
        self._ahead: dict[int, int] = {}  # released ranges past the prefix, still mapped: offset -> end
        self._ahead_bytes = 0
        self.ahead_limit = ahead_limit
        self._lock = threading.Lock()
        self._hex: str | None = None
        self._whole = False  # a closing source hashed the file to its end

    def consume(self, buf: memoryview, offset: int, length: int) -> list[tuple[int, int]]:
        """``buf[offset:offset+length]`` (``buf`` = the whole file) is read; returns the ranges the
        caller may unmap now (hashed, or too far ahead to keep mapped)."""
        end = min(offset + length, len(buf))
        with self._lock:
            if self._hex is not None or end <= self.done:
                return [(offset, length)]
            if offset - self.done > _GAP:
                if self._ahead_bytes + (end - offset) > self.ahead_limit:
                    return [(offset, length)]  # finish() re-reads it (page cache) rather than pin it
                self._ahead[offset] = max(end, self._ahead.get(offset, 0))
                self._ahead_bytes += end - offset
                return []
            start = min(offset, self.done)
            self._advance(buf, end)
            while True:  # ranges that were waiting for this one
                nxt = [o for o in self._ahead if o - self.done <= _GAP]
                if not nxt:
                    break
                for o in nxt:
                    e = self._ahead.pop(o)
                    self._ahead_bytes -= e - o
                    self._advance(buf, e)
            return [(start, self.done - start)]

    def _advance(self, buf: memoryview, end: int) -> None:
        if end > self.done:
            self._h.update(buf[self.done : end])
            self.done = end

    def closing(self, buf: memoryview) -> None:
        """The source mapping the whole file as ``buf`` closes: a short unhashed rest (the CRC
        trailer, the records after a small file's last released range) is hashed from it now, so
        :meth:`finish` need not open the file again (a small shard's verification opened it a
        second time only for that). A longer rest is left to :meth:`finish`, as before."""
        with self._lock:
            if self._hex is None and len(buf) - self.done <= _GAP:
                self._ahead.clear()
                self._ahead_bytes = 0
                self._advance(buf, len(buf))
                self._whole = True

    def finish(self, path: str) -> str:
        """The hex digest of the whole file at ``path``: hashes what was not consumed yet."""
        with self._lock:
            if self._hex is None:
                if not self._whole:
                    self._hash_rest(path)
                self._hex = self._h.hexdigest()
            return self._hex

    def _hash_rest(self, path: str) -> None:
        self._ahead.clear()
        self._ahead_bytes = 0
        src = MmapSource(path)
        try:
            for off in range(self.done, src.size, _CHUNK):
                n = min(_CHUNK, src.size - off)
                src.prefetch(off + n, _CHUNK)
                self._h.update(src.view(off, n))
                src.release(off, n)
            self.done = max(self.done, src.size)
        finally:
            src.close()
