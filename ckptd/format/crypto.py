"""Encrypted MindSpore ``.ckpt`` files: a :class:`~ckptd.format.source.ByteSource` over the plaintext.

``mindspore.save_checkpoint(..., enc_key=K, enc_mode=M)`` cuts the plaintext ``.ckpt`` stream into
64 MiB pieces and encrypts each as an independent block (layout in :mod:`ckptd.format.crypto_blocks`
and the reference doc, section C). :class:`EncryptedSource` scans the block table from the headers
alone, then decrypts blocks on demand, so readers parse an encrypted file exactly like a plain one.

Wrong key vs. tampering. GCM's tag and CBC's padding only say "this block is not what was
encrypted with this key". To tell the operator *which* problem they have we use the fact that a
.ckpt stream - and so block 0 - starts with a ``Checkpoint`` record header
(``0A <len> 0A <taglen> <printable tag> 12|1A``). Decrypting the first 64 bytes of block 0 WITHOUT
authentication (GCM = AES-CTR from counter nonce||00000002; CBC without unpadding) gives that
shape with the right key and random bytes with a wrong one (false match < 1e-6). So:

* plausible prefix (or any block already authenticated) -> the key is right and the failing block
  was modified: :class:`AuthenticationError` (GCM) / :class:`PaddingError` (CBC);
* implausible -> :class:`WrongKeyError`; for GCM we first try to authenticate block 0 in full, so a
  non-.ckpt plaintext with the right key is never called a wrong key.

Limits: damage inside block 0's first bytes looks like a wrong key; CBC has no integrity at all
(a flipped ciphertext byte away from the padding decrypts silently to wrong plaintext - the
.ckpt parser / CRC layer must catch it); dropping or reordering whole blocks is undetectable.
"""

from __future__ import annotations

import bisect
import collections
import os
import struct
import concurrent.futures
import threading
from concurrent.futures import Future
from typing import Iterator

from ckptd.errors import (
    AuthenticationError,
    CkptdError,
    EncryptionError,
    InvalidKeyError,
    KeyRequiredError,
    NotEncryptedError,
    PaddingError,
    TruncatedError,
    WrongKeyError,
)
from ckptd.format.crypto_blocks import (
    ENCRYPT_BLOCK_SIZE,
    MAGIC,
    MAX_CIPHER_LEN,
    BlockFailure,
    BlockInfo,
    EncMode,
    EncryptingWriter,
    ModeMismatchError,
    RawHeader,
    cbc_plain_len,
    decrypt_into,
    load_key_file,
    looks_like_ckpt_start,
    parse_mode,
    raw_prefix,
    scan_headers,
    sniff_encryption,
    validate_key,
)
from ckptd.format.source import MmapSource
from ckptd.format.workpool import BLOCK_BUFFERS, CPUS, is_exported, shared_pool

__all__ = [
    "ENCRYPT_BLOCK_SIZE",
    "MAX_CIPHER_LEN",
    "BlockInfo",
    "EncMode",
    "EncryptedSource",
    "EncryptingWriter",
    "ModeMismatchError",
    "encrypt_file_bytes",
    "load_key_file",
    "parse_mode",
    "require_key",
    "sniff_encryption",
    "sniff_file",
    "validate_key",
]

_CACHE_BLOCKS = 2  # sequential reads straddling a block boundary stay cheap


def _release(view: memoryview) -> None:
    """Invalidate a handed-out view; if the consumer exported it further, leave it alone."""
    try:
        view.release()
    except BufferError:
        pass


def sniff_file(path: str | os.PathLike[str]) -> EncMode | None:
    """The encryption mode of the file at ``path`` from its magic, or None if it is not encrypted."""
    p = os.fspath(path)
    try:
        with open(p, "rb") as fh:
            return sniff_encryption(fh.read(4))
    except OSError as exc:
        raise CkptdError(f"cannot read the file: {exc.strerror}", path=p) from None


def require_key(path: str | os.PathLike[str], key: bytes | None = None) -> EncMode | None:
    """Raise :class:`KeyRequiredError` if ``path`` is encrypted and ``key`` is None; return its mode."""
    mode = sniff_file(path)
    if mode is not None and key is None:
        raise KeyRequiredError(f"file is {mode.value} encrypted", path=os.fspath(path), offset=0)
    return mode


class EncryptedSource:
    """Random access to the decrypted plaintext of an encrypted ``.ckpt``.

    Memory is bounded: ``view`` keeps at most two decrypted blocks (+``workers`` decrypted ahead, +1 spare);
    ``iter_plaintext`` keeps ``workers + 1``. ``check_key`` (default) detects a wrong key at open
    from block 0's first bytes; pass False when the plaintext is not a .ckpt stream.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        key: bytes,
        mode: EncMode | str | None = None,
        *,
        workers: int | None = None,
        check_key: bool = True,
        raw: MmapSource | None = None,
    ) -> None:
        """``raw``: the file, already open (``open_checkpoint`` sniffed its first bytes from it);
        it carries its own digest, and is closed with this source (also when opening fails)."""
        self.path = os.fspath(path)
        if not isinstance(key, (bytes, bytearray, memoryview)):
            raise InvalidKeyError(f"the key must be raw bytes, not {type(key).__name__}", path=self.path)
        try:
            requested = None if mode is None else parse_mode(mode)
            if requested is not None:  # otherwise checked once the mode is read from the file
                validate_key(key, requested)
        except CkptdError as exc:
            raise exc.with_path(self.path) from None
        self._key = bytes(key)
        self.workers = max(1, workers if workers is not None else min(4, CPUS))
        self._raw = raw if raw is not None else MmapSource(self.path)
        try:
            self._open(requested, check_key)
        except CkptdError as exc:
            self._raw.close()
            raise exc.with_path(self.path) from None
        except BaseException:
            self._raw.close()
            raise

    def _open(self, requested: EncMode | None, check_key: bool) -> None:
        buf = self._raw.view(0, self._raw.size)
        detected = sniff_encryption(buf[:4])
        if detected is None and 0 < len(buf) < 4:  # cut inside the magic: still report truncation
            detected = next((m for m, v in MAGIC.items() if struct.pack("<I", v).startswith(buf)), None)
        if requested is None:
            if detected is None and self._raw.size:
                raise NotEncryptedError("file is not encrypted but a key was given", offset=0)
            requested = detected or EncMode.AES_GCM
            validate_key(self._key, requested)
        self.mode: EncMode = requested
        self._buf = buf
        self._lock = threading.RLock()
        self._cache: collections.OrderedDict[int, bytearray] = collections.OrderedDict()
        self._spare: list[bytearray] = []
        self._key_confirmed = False
        self._closed = False
        self._authentic: set[int] = set()
        self._ahead: collections.deque[tuple[int, Future[None], bytearray]] = collections.deque()  # see _block
        self._last_miss = -2
        headers, self.trailer = scan_headers(buf, self.mode, self.path)
        self._headers = headers
        # update_into wants one cipher block of slack; size buffers to this file's largest block.
        self._buf_size = max((h.cipher_len for h in headers), default=0) + 16
        self.blocks: list[BlockInfo] = self._plain_table(headers)
        self.size: int = sum(b.plain_len for b in self.blocks)
        self._starts = [b.plain_offset for b in self.blocks]
        if check_key:
            self._check_key()

    # --- opening ------------------------------------------------------------------------------

    def _plain_table(self, headers: list[RawHeader]) -> list[BlockInfo]:
        """Plaintext lengths: GCM = cipher_len; CBC needs one 16-byte decryption per block (padding)."""
        blocks: list[BlockInfo] = []
        plain_off = 0
        for i, h in enumerate(headers):
            if self.mode is EncMode.AES_GCM:
                plen: int | None = h.cipher_len
            else:
                plen = cbc_plain_len(self.mode, self._key, self._buf, h)
                if plen is None:
                    raise self._classify(BlockFailure(i, "padding"))
            blocks.append(BlockInfo(i, h.file_offset, h.cipher_offset, h.cipher_len, plain_off, plen, h.iv, h.tag))
            plain_off += plen
        return blocks

    def _prefix_plausible(self) -> bool:
        return looks_like_ckpt_start(raw_prefix(self.mode, self._key, self._buf, self._headers[0]))

    def _block0_authenticates(self) -> bool:
        """GCM only: a full authentication of block 0 (its plaintext lands in the cache)."""
        if self.mode is not EncMode.AES_GCM or len(self.blocks) == 0:
            return False
        with self._lock:
            try:
                self._block(0)
            except BlockFailure:
                return False
        return True

    def _check_key(self) -> None:
        if not self._headers:
            return
        if self._prefix_plausible():
            self._key_confirmed = True
            return
        if self.mode is EncMode.AES_GCM and self._block0_authenticates():
            return  # right key, the plaintext just is not a .ckpt stream
        raise WrongKeyError(
            f"the key does not decrypt this {self.mode.value} file "
            "(block 0 does not start like a .ckpt record)",
            path=self.path,
            offset=0,
        )

    def _classify(self, failure: BlockFailure) -> EncryptionError:
        """Turn a tag/padding failure into WrongKeyError or tampering (see the module docstring)."""
        idx = failure.index
        hdr = self._headers[idx]
        key_ok = self._key_confirmed or self._prefix_plausible()
        if not key_ok and idx != 0:
            key_ok = self._block0_authenticates()
        if not key_ok:
            return WrongKeyError(
                f"the key does not decrypt this {self.mode.value} file "
                f"(block {idx} fails and block 0 does not start like a .ckpt record)",
                path=self.path,
                offset=self._headers[0].file_offset,
            )
        if failure.kind == "tag":
            return AuthenticationError(
                f"block {idx} ({hdr.cipher_len} ciphertext bytes) fails AES-GCM authentication "
                "although the key is right",
                path=self.path,
                offset=hdr.file_offset,
            )
        return PaddingError(
            f"block {idx} has invalid {self.mode.value} padding although the key is right",
            path=self.path,
            offset=hdr.file_offset,
        )

    # --- decryption ---------------------------------------------------------------------------

    def _buffer(self, spare: list[bytearray]) -> bytearray:
        return spare.pop() if spare else BLOCK_BUFFERS.take(self._buf_size)

    def _decrypt(self, idx: int, out: bytearray) -> memoryview:
        if self._closed:  # a read-ahead worker racing close(): fail cleanly, the map may be gone
            raise CkptdError("the encrypted source was closed while reading", path=self.path)
        block = self.blocks[idx]
        view = decrypt_into(self.mode, self._key, self._buf, block, out)
        self._authentic.add(idx)  # decrypted (and for GCM authenticated): verify_all need not redo it
        # unmap the ciphertext just consumed: RSS stays flat however large the file (page cache keeps it)
        self._raw.release(block.file_offset, block.cipher_offset + block.cipher_len - block.file_offset)
        if self.mode is EncMode.AES_GCM:
            self._key_confirmed = True
        return view

    def _decrypt_ahead(self, idx: int, out: bytearray) -> None:
        self._decrypt(idx, out).release()

    def _block(self, idx: int) -> memoryview:
        """Block ``idx``'s plaintext via the small cache; the caller holds ``self._lock``.

        An evicted buffer is recycled only when nothing references it any more, so views handed
        out earlier never change under their holder. A reader walking forward block by block (an
        index pass reads a record header in nearly every 64 MiB block) gets the next blocks
        decrypted on the shared pool meanwhile: decryption on every core, the digest of the
        ciphertext and the parse overlap instead of taking turns on one core.
        """
        hit = self._cache.get(idx)
        if hit is None:
            while len(self._cache) >= _CACHE_BLOCKS:
                _, old = self._cache.popitem(last=False)
                if not self._spare and not is_exported(old):
                    self._spare.append(old)
            self._prefetch(idx + 1)  # readers through view() walk forward: start the next block's read
            hit = self._take_ahead(idx)
            if hit is None:
                hit = self._buffer(self._spare)
                try:
                    self._decrypt(idx, hit).release()
                except BlockFailure:
                    self._spare.append(hit)
                    raise
            self._cache[idx] = hit
            if idx == self._last_miss + 1:
                self._start_ahead(idx + 1)
            self._last_miss = idx
        self._cache.move_to_end(idx)
        return memoryview(hit)[: self.blocks[idx].plain_len]

    def _start_ahead(self, idx: int) -> None:
        """Keep ``workers`` blocks from ``idx`` on decrypting on the shared pool (an index pass
        parses a header in microseconds and asks for the next block at once: one block ahead
        would never have started)."""
        if self.workers == 1:
            return
        nxt = self._ahead[-1][0] + 1 if self._ahead else idx
        while len(self._ahead) < self.workers and nxt < len(self.blocks):
            if nxt not in self._cache:
                buf = self._buffer(self._spare)
                self._ahead.append((nxt, shared_pool().submit(self._decrypt_ahead, nxt, buf), buf))
            nxt += 1
        self._prefetch(nxt)

    def _take_ahead(self, idx: int) -> bytearray | None:
        """The buffer block ``idx`` was decrypted into ahead, or None if it was not."""
        if not self._ahead or self._ahead[0][0] != idx:
            self._drop_ahead()
            return None
        _, fut, buf = self._ahead.popleft()
        try:
            fut.result()
        except BlockFailure:
            self._spare.append(buf)
            raise
        return buf

    def _drop_ahead(self) -> None:
        """Cancel or let finish every decryption ahead and keep the buffers; the caller holds the lock."""
        while self._ahead:
            _, fut, buf = self._ahead.popleft()
            if not fut.cancel():
                concurrent.futures.wait([fut])
            self._spare.append(buf)

    def _check_open(self) -> None:
        if self._closed:
            raise CkptdError("the encrypted source is closed", path=self.path)

    def view(self, offset: int, length: int) -> memoryview:
        """Plaintext ``[offset, offset+length)``, decrypted and authenticated.

        Within one block this is a view of a cached buffer that is never reused while the view (or
        anything made from it) is alive; a range spanning blocks is a fresh copy.
        """
        self._check_open()
        if offset < 0 or length < 0 or offset + length > self.size:
            raise TruncatedError(
                f"needs plaintext bytes {offset}..{offset + length} but the decrypted file has {self.size}",
                path=self.path,
                offset=min(max(offset, 0), self.size),
            )
        if length == 0:
            return memoryview(b"")
        first = self._index_of(offset)
        last = self._index_of(offset + length - 1)
        with self._lock:
            try:
                if first == last:
                    start = offset - self.blocks[first].plain_offset
                    return self._block(first)[start : start + length]
                out = bytearray(length)
                pos = 0
                for idx in range(first, last + 1):
                    blk = self.blocks[idx]
                    lo = max(offset, blk.plain_offset) - blk.plain_offset
                    hi = min(offset + length, blk.plain_offset + blk.plain_len) - blk.plain_offset
                    out[pos : pos + hi - lo] = self._block(idx)[lo:hi]
                    pos += hi - lo
                return memoryview(out)
            except BlockFailure as failure:
                raise self._classify(failure) from None

    def _index_of(self, plain_offset: int) -> int:
        return bisect.bisect_right(self._starts, plain_offset) - 1

    def iter_plaintext(self) -> Iterator[memoryview]:
        """Every block's plaintext in order, decrypted and authenticated, decrypted ahead in threads.

        A yielded view is valid until the next iteration step (its buffer is then recycled unless
        something still references it, in which case a new buffer is used). At most ``workers + 1``
        block buffers exist at once. Stops at the first failing block with its classified error.
        """
        return self._iter_blocks(list(range(len(self.blocks))))

    def _iter_blocks(self, todo: list[int]) -> Iterator[memoryview]:
        self._check_open()
        if self.workers == 1 or len(todo) <= 1:
            yield from self._iter_serial(todo)
            return
        spare: list[bytearray] = []
        pending: collections.deque[tuple[Future[memoryview], bytearray]] = collections.deque()
        pool = shared_pool()
        nxt = 0
        try:
            for _ in range(len(todo)):
                while nxt < len(todo) and len(pending) < self.workers:
                    buf = self._buffer(spare)
                    pending.append((pool.submit(self._decrypt, todo[nxt], buf), buf))
                    nxt += 1
                    if nxt < len(todo):
                        self._prefetch(todo[nxt])
                fut, buf = pending.popleft()
                try:
                    view = fut.result()
                except BlockFailure as failure:
                    raise self._classify(failure) from None
                yield view
                _release(view)
                if not is_exported(buf):
                    spare.append(buf)
        finally:
            for fut, _ in pending:
                fut.cancel()
            concurrent.futures.wait([fut for fut, _ in pending])  # none may write into a buffer later
            for buf in spare + [buf for _, buf in pending]:
                BLOCK_BUFFERS.give(buf)

    def _prefetch(self, idx: int) -> None:
        """Start reading block ``idx``'s ciphertext from the disk (a cold scan keeps the disk busy)."""
        if idx < len(self.blocks):
            b = self.blocks[idx]
            self._raw.prefetch(b.file_offset, b.cipher_offset + b.cipher_len - b.file_offset)

    def _iter_serial(self, todo: list[int]) -> Iterator[memoryview]:
        buf = self._buffer([])
        for pos, idx in enumerate(todo):
            if pos + 1 < len(todo):
                self._prefetch(todo[pos + 1])
            try:
                view = self._decrypt(idx, buf)
            except BlockFailure as failure:
                raise self._classify(failure) from None
            yield view
            _release(view)
            if is_exported(buf):
                buf = self._buffer([])
        BLOCK_BUFFERS.give(buf)

    def verify_all(self) -> None:
        """Decrypt and authenticate every block; raise the first failure, classified.

        Blocks that already decrypted cleanly (indexing a ``.ckpt`` reads its record headers
        through ``view``, which decrypts nearly every block of a file of large tensors) are not
        decrypted again: the result would be the same, and it was half of the CPU time."""
        with self._lock:
            self._drop_ahead()
        todo = self._iter_blocks([i for i in range(len(self.blocks)) if i not in self._authentic])
        for _ in todo:
            pass

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        with self._lock:
            self._drop_ahead()
        self._closed = True
        for buf in (*self._cache.values(), *self._spare):
            BLOCK_BUFFERS.give(buf)  # the next file's decryption starts in warm memory (workpool)
        self._cache.clear()
        self._spare.clear()
        self._buf.release()
        self._raw.close()

    def __enter__(self) -> "EncryptedSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def encrypt_file_bytes(
    plaintext: bytes | bytearray | memoryview, key: bytes, mode: EncMode | str, block_size: int = ENCRYPT_BLOCK_SIZE
) -> bytes:
    """The whole encrypted file for ``plaintext`` (tests and small files; large ones: EncryptingWriter)."""
    import io

    out = io.BytesIO()
    with EncryptingWriter(out, key, parse_mode(mode), block_size=block_size) as w:
        w.write(plaintext)
    return out.getvalue()
