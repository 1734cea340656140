"""Low-level pieces of MindSpore's encrypted ``.ckpt`` block format (reference doc, section C).

A file is a concatenation of independent blocks, one per 64 MiB of plaintext::

    magic(4 LE) [tag(16), AES-GCM only] block_len(4 LE) iv_len(4 LE) iv(16) cipher_len(4 LE) ciphertext

This module holds the pure parts: constants, key checks, the header scan (no decryption), the
per-block cipher calls into caller-owned buffers, the "does this look like a .ckpt record"
heuristic and the writer. :mod:`ckptd.format.crypto` builds the random-access reader on top.

Performance: ``update_into`` a pre-allocated buffer runs ~6 GB/s for AES; APIs that allocate their
output (``AESGCM.decrypt``, ``update``) run ~0.6-1.7 GB/s, so everything here decrypts into buffers
the caller owns and recycles. ``update_into`` releases the GIL (measured), so threads parallelise.
"""

from __future__ import annotations

import codecs
import enum
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO, NoReturn

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from ckptd.errors import (
    CkptdError,
    CorruptError,
    EncryptionError,
    InvalidKeyError,
    NotEncryptedError,
    TruncatedError,
)


class EncMode(str, enum.Enum):
    """Encryption modes; the values are MindSpore's ``enc_mode`` strings."""

    AES_GCM = "AES-GCM"
    AES_CBC = "AES-CBC"
    SM4_CBC = "SM4-CBC"


ENCRYPT_BLOCK_SIZE = 64 * 1024 * 1024  # MindSpore: ENCRYPT_BLOCK_SIZE (KiB) * 1024
#: Largest ciphertext MindSpore writes per block (CBC adds 1..16 padding bytes). Larger values
#: are treated as corruption so a hostile length field can never make us allocate gigabytes.
MAX_CIPHER_LEN = ENCRYPT_BLOCK_SIZE + 16
IV_LEN = 16
GCM_NONCE_LEN = 12  # MindSpore 2.10 uses the first 12 bytes of the iv field; 12..15 are ignored
TAG_LEN = 16
MAX_KEY_FILE = 4096

MAGIC: dict[EncMode, int] = {EncMode.AES_GCM: 0x7F3A5ED8, EncMode.AES_CBC: 0x7F3A5ED9, EncMode.SM4_CBC: 0x7F3A5EDA}
_MODE_BY_MAGIC = {v: k for k, v in MAGIC.items()}
KEY_LENGTHS: dict[EncMode, tuple[int, ...]] = {
    EncMode.AES_GCM: (16, 24, 32),
    EncMode.AES_CBC: (16, 24, 32),
    EncMode.SM4_CBC: (16,),
}
#: The plaintext CRC trailer MindSpore appends *after* the ciphertext when both ``enc_key`` and
#: ``crc_check=True`` are given (a MindSpore defect: it cannot load such files itself).
CRC_TRAILER_MAGIC = b"crc_num"
CRC_TRAILER_LEN = 17


class ModeMismatchError(EncryptionError):
    """The file's block magic names another mode than the one requested."""

    code = "mode_mismatch"
    default_hint = "pass the enc_mode the file was saved with (or let ckptd detect it)"


def parse_mode(mode: EncMode | str) -> EncMode:
    """``EncMode`` from a MindSpore ``enc_mode`` string, as a ckptd error when unknown."""
    try:
        return EncMode(mode)
    except ValueError:
        names = ", ".join(m.value for m in EncMode)
        raise EncryptionError(f"unknown encryption mode {mode!r}", hint=f"use one of {names}") from None


def header_len(mode: EncMode) -> int:
    """Bytes before the ciphertext: magic, [tag], block_len, iv_len, iv, cipher_len."""
    return 4 + (TAG_LEN if mode is EncMode.AES_GCM else 0) + 4 + 4 + IV_LEN + 4


def sniff_encryption(head: bytes | memoryview) -> EncMode | None:
    """The mode named by a file's first 4 bytes, or None when they are not a block magic."""
    if len(head) < 4:
        return None
    return _MODE_BY_MAGIC.get(struct.unpack_from("<I", head, 0)[0])


def validate_key(key: bytes, mode: EncMode) -> None:
    """Raise :class:`InvalidKeyError` unless ``key`` is raw key bytes of a length ``mode`` accepts."""
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidKeyError(f"the key must be raw bytes, not {type(key).__name__}")
    mode = parse_mode(mode)
    n = len(key)
    if n in KEY_LENGTHS[mode]:
        return
    allowed = "/".join(str(x) for x in KEY_LENGTHS[mode])
    hint = None
    if n - 1 in KEY_LENGTHS[mode] and bytes(key[-1:]) == b"\n":
        hint = "the key ends with a newline: write the raw key bytes without one (e.g. printf, not echo)"
    elif n // 2 in KEY_LENGTHS[mode] and _is_hex(bytes(key)):
        hint = "the key looks hex-encoded: the key file must hold the raw bytes (xxd -r -p)"
    raise InvalidKeyError(f"{mode.value} needs a {allowed}-byte key, got {n} bytes", hint=hint)


def _is_hex(data: bytes) -> bool:
    try:
        bytes.fromhex(data.decode("ascii"))
    except ValueError:
        return False
    return True


def load_key_file(path: str | os.PathLike[str]) -> bytes:
    """Read raw key bytes from ``path`` (not hex, not stripped: a key may contain any byte)."""
    p = os.fspath(path)
    try:
        with open(p, "rb") as fh:
            data = fh.read(MAX_KEY_FILE + 1)
    except FileNotFoundError:
        raise CkptdError("key file not found", path=p, hint="pass the file holding the raw enc_key bytes") from None
    except IsADirectoryError:
        raise CkptdError("key file is a directory", path=p, hint="pass the file holding the raw enc_key bytes") from None
    except PermissionError:
        raise CkptdError("permission denied reading the key file", path=p, hint="run as a user that can read it") from None
    if not data:
        raise InvalidKeyError("key file is empty", path=p)
    if len(data) > MAX_KEY_FILE:
        raise InvalidKeyError(f"key file is larger than {MAX_KEY_FILE} bytes: not a key", path=p)
    return data


def algorithm(mode: EncMode, key: bytes) -> algorithms.AES | algorithms.SM4:
    return algorithms.SM4(key) if mode is EncMode.SM4_CBC else algorithms.AES(key)


@dataclass(frozen=True)
class BlockInfo:
    """One block: where its header/ciphertext sit in the file and which plaintext bytes it yields."""

    index: int
    file_offset: int
    cipher_offset: int
    cipher_len: int
    plain_offset: int
    plain_len: int
    iv: bytes
    tag: bytes | None


@dataclass(frozen=True)
class RawHeader:
    """A block header as scanned (CBC plaintext length still unknown)."""

    file_offset: int
    cipher_offset: int
    cipher_len: int
    iv: bytes
    tag: bytes | None


def scan_headers(buf: memoryview, mode: EncMode, path: str) -> tuple[list[RawHeader], bytes]:
    """Walk the block headers of a whole file without decrypting; returns (headers, trailer).

    Every length is checked before it is used. ``trailer`` is MindSpore's 17-byte plaintext
    ``crc_num`` trailer when present after the last block, else ``b""``.
    """
    size = len(buf)
    if size == 0:
        raise TruncatedError(
            "the file is empty",
            path=path,
            offset=0,
            hint="an interrupted save, or a MindSpore save of nothing (which writes 0 bytes); use another checkpoint",
        )
    hlen = header_len(mode)
    gcm = mode is EncMode.AES_GCM
    headers: list[RawHeader] = []
    off = 0
    trailer = b""
    while off < size:
        rest = size - off
        head = bytes(buf[off : off + min(rest, 7)])
        if headers and rest <= CRC_TRAILER_LEN and head == CRC_TRAILER_MAGIC[: len(head)]:
            if rest == CRC_TRAILER_LEN:
                trailer = bytes(buf[off:])
                break
            raise TruncatedError(f"the plaintext crc_num trailer is cut short ({rest} of 17 bytes)", path=path, offset=off)
        idx = len(headers)
        if rest < 4 and head == struct.pack("<I", MAGIC[mode])[:rest]:
            raise TruncatedError(f"block {idx}: file ends inside the block header ({rest} of {hlen} bytes)", path=path, offset=off)
        magic = struct.unpack_from("<I", head.ljust(4, b"\x00"), 0)[0]
        if magic != MAGIC[mode]:
            _bad_magic(magic, mode, idx, off, path)
        if rest < hlen:
            raise TruncatedError(f"block {idx}: file ends inside the block header ({rest} of {hlen} bytes)", path=path, offset=off)
        pos = off + 4
        tag = None
        if gcm:
            tag = bytes(buf[pos : pos + TAG_LEN])
            pos += TAG_LEN
        block_len, iv_len = struct.unpack_from("<ii", buf, pos)
        iv = bytes(buf[pos + 8 : pos + 8 + IV_LEN])
        (cipher_len,) = struct.unpack_from("<i", buf, pos + 8 + IV_LEN)
        where = f"block {idx}"
        if iv_len != IV_LEN:
            raise CorruptError(f"{where}: iv_len is {iv_len}, MindSpore always writes {IV_LEN}", path=path, offset=off)
        if cipher_len <= 0 or cipher_len > MAX_CIPHER_LEN:
            raise CorruptError(
                f"{where}: cipher_len {cipher_len} is outside 1..{MAX_CIPHER_LEN} (MindSpore's largest block)",
                path=path,
                offset=off,
            )
        if block_len != 4 + IV_LEN + 4 + cipher_len:
            raise CorruptError(f"{where}: block_len {block_len} disagrees with cipher_len {cipher_len}", path=path, offset=off)
        if not gcm and cipher_len % 16:
            raise CorruptError(f"{where}: CBC cipher_len {cipher_len} is not a multiple of 16", path=path, offset=off)
        if cipher_len > size - off - hlen:
            raise TruncatedError(
                f"{where}: needs {hlen + cipher_len} bytes but the file ends after {size - off}",
                path=path,
                offset=off,
            )
        headers.append(RawHeader(off, off + hlen, cipher_len, iv, tag))
        off += hlen + cipher_len
    return headers, trailer


def _bad_magic(magic: int, mode: EncMode, idx: int, off: int, path: str) -> NoReturn:
    other = _MODE_BY_MAGIC.get(magic)
    if idx == 0 and other is not None:
        raise ModeMismatchError(f"file is {other.value} encrypted but {mode.value} was requested", path=path, offset=off)
    # what was expected, never the file's bytes (they may be another file's content: no echo)
    if idx == 0:
        raise NotEncryptedError(f"file is not encrypted: expected a {mode.value} block magic at the start", path=path,
                                offset=0)
    got = other.value + " block magic" if other else "no block magic"
    raise CorruptError(f"block {idx}: expected a {mode.value} block header, found {got}", path=path, offset=off)


# --- per-block cipher calls -------------------------------------------------------------------


class BlockFailure(Exception):
    """Internal: a block failed to authenticate (``kind='tag'``) or unpad (``kind='padding'``)."""

    def __init__(self, index: int, kind: str) -> None:
        super().__init__(index, kind)
        self.index = index
        self.kind = kind


def pkcs7_len(last16: bytes | memoryview) -> int | None:
    """Padding length of a final CBC plaintext block, or None when the padding is invalid."""
    p = last16[-1]
    if not 1 <= p <= 16 or any(b != p for b in last16[16 - p :]):
        return None
    return p


def cbc_plain_len(mode: EncMode, key: bytes, buf: memoryview, hdr: RawHeader) -> int | None:
    """Plaintext length of a CBC block from its last cipher block only (None = bad padding)."""
    end = hdr.cipher_offset + hdr.cipher_len
    prev = hdr.iv if hdr.cipher_len == 16 else bytes(buf[end - 32 : end - 16])
    dec = Cipher(algorithm(mode, key), modes.CBC(prev)).decryptor()
    last = dec.update(bytes(buf[end - 16 : end])) + dec.finalize()
    pad = pkcs7_len(last)
    return None if pad is None else hdr.cipher_len - pad


def decrypt_into(mode: EncMode, key: bytes, buf: memoryview, blk: BlockInfo, out: bytearray) -> memoryview:
    """Decrypt (and for GCM authenticate) one block into ``out``; returns the plaintext view.

    ``out`` must hold ``cipher_len + 16`` bytes (``update_into`` wants a block of slack).
    Raises :class:`BlockFailure` on a tag or padding failure.
    """
    src = buf[blk.cipher_offset : blk.cipher_offset + blk.cipher_len]
    if mode is EncMode.AES_GCM:
        assert blk.tag is not None
        dec = Cipher(algorithms.AES(key), modes.GCM(blk.iv[:GCM_NONCE_LEN], blk.tag)).decryptor()
        n = dec.update_into(src, out)
        try:
            dec.finalize()
        except InvalidTag:
            raise BlockFailure(blk.index, "tag") from None
        return memoryview(out)[:n]
    dec = Cipher(algorithm(mode, key), modes.CBC(blk.iv)).decryptor()
    n = dec.update_into(src, out)
    dec.finalize()
    view = memoryview(out)
    pad = pkcs7_len(view[n - 16 : n])
    if pad is None or n - pad != blk.plain_len:
        raise BlockFailure(blk.index, "padding")
    return view[: blk.plain_len]


def raw_prefix(mode: EncMode, key: bytes, buf: memoryview, hdr: RawHeader, limit: int = 64) -> bytes:
    """The first plaintext bytes of a block WITHOUT authentication or unpadding.

    GCM is CTR mode underneath: the first plaintext block uses counter block nonce || 00000002.
    CBC decrypts any prefix of whole cipher blocks with the block's iv.
    """
    n = min(limit, hdr.cipher_len)
    src = bytes(buf[hdr.cipher_offset : hdr.cipher_offset + n])
    if mode is EncMode.AES_GCM:
        ctr = hdr.iv[:GCM_NONCE_LEN] + b"\x00\x00\x00\x02"
        dec = Cipher(algorithms.AES(key), modes.CTR(ctr)).decryptor()
        return dec.update(src) + dec.finalize()
    n -= n % 16
    dec = Cipher(algorithm(mode, key), modes.CBC(hdr.iv)).decryptor()
    return dec.update(src[:n]) + dec.finalize()


def _varint(data: bytes, pos: int) -> tuple[int, int] | None:
    value = 0
    for shift in range(0, 70, 7):
        if pos >= len(data):
            return None
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
    return None


def looks_like_ckpt_start(prefix: bytes) -> bool:
    """Heuristic: does decrypted data start like a MindSpore ``Checkpoint`` record?

    A .ckpt stream starts ``0A <len> 0A <taglen> <tag utf-8> (12|1A)``: ``Checkpoint.value`` holding
    ``Value.tag`` then a tensor / map tensor. Random bytes (a wrong key) pass with probability far
    below 1e-6. Bytes cut off by the end of ``prefix`` are given the benefit of the doubt, and the
    record length is not checked against the file size (a file cut at a block boundary must still
    be recognised as decrypted with the right key).
    """
    if len(prefix) < 4 or prefix[0] != 0x0A:
        return False
    got = _varint(prefix, 1)
    if got is None:
        return False
    rec_len, pos = got
    rec_end = pos + rec_len
    if rec_len < 2 or pos >= len(prefix) or prefix[pos] != 0x0A:
        return False
    got = _varint(prefix, pos + 1)
    if got is None:
        return False
    tag_len, pos = got
    if tag_len < 1 or pos + tag_len > rec_end:
        return False
    raw = prefix[pos : pos + tag_len]
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(raw, final=len(raw) == tag_len)
    except UnicodeDecodeError:
        return False
    if not text.isprintable() or (len(raw) == tag_len and not text):
        return False
    nxt = pos + tag_len
    return nxt >= len(prefix) or prefix[nxt] in (0x12, 0x1A)


# --- writer -----------------------------------------------------------------------------------


def _grow(buf: bytearray, need: int, cap: int) -> None:
    """Enlarge ``buf`` to at least ``need`` bytes, doubling (amortised O(1)), never beyond ``cap``."""
    if len(buf) < need:
        buf.extend(bytes(max(need, min(cap, 2 * len(buf))) - len(buf)))


class EncryptingWriter:
    """File-like sink: buffers plaintext and writes one MindSpore block per ``block_size`` bytes.

    ``close()`` emits the final (shorter) block and does not close ``fileobj`` (the caller owns it,
    typically an :func:`~ckptd.atomic.atomic_write` handle). Writing nothing writes nothing,
    exactly like MindSpore's own save of an empty plaintext.
    """

    def __init__(self, fileobj: BinaryIO, key: bytes, mode: EncMode, *, block_size: int = ENCRYPT_BLOCK_SIZE) -> None:
        mode = parse_mode(mode)
        validate_key(key, mode)
        if not 1 <= block_size <= ENCRYPT_BLOCK_SIZE:
            raise ValueError(f"block_size must be in 1..{ENCRYPT_BLOCK_SIZE}")
        self._fh = fileobj
        self._key = bytes(key)
        self._mode = mode
        self._block_size = block_size
        # Grown on demand (a small checkpoint must not cost 2 x 64 MiB), then reused for every
        # block: update_into a reused buffer is what makes encryption fast.
        self._plain = bytearray()  # block_size + 16 at most: room for CBC padding in place
        self._fill = 0
        self._out = bytearray()
        self._closed = False
        self.bytes_in = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._closed:
            raise ValueError("write to a closed EncryptingWriter")
        mv = memoryview(data).cast("B")
        n = len(mv)
        pos = 0
        while pos < n:
            take = min(n - pos, self._block_size - self._fill)
            _grow(self._plain, self._fill + take + 16, self._block_size + 16)
            self._plain[self._fill : self._fill + take] = mv[pos : pos + take]
            self._fill += take
            pos += take
            if self._fill == self._block_size:
                self._emit()
        self.bytes_in += n
        return n

    def _emit(self) -> None:
        n = self._fill
        _grow(self._plain, n + 16, n + 16)
        _grow(self._out, n + 32, self._block_size + 32)
        iv = os.urandom(IV_LEN)
        plain = memoryview(self._plain)
        if self._mode is EncMode.AES_GCM:
            enc = Cipher(algorithms.AES(self._key), modes.GCM(iv[:GCM_NONCE_LEN])).encryptor()
            clen = enc.update_into(plain[:n], self._out)
            enc.finalize()
            head = struct.pack("<I", MAGIC[self._mode]) + enc.tag
        else:
            pad = 16 - n % 16
            self._plain[n : n + pad] = bytes([pad]) * pad
            enc = Cipher(algorithm(self._mode, self._key), modes.CBC(iv)).encryptor()
            clen = enc.update_into(plain[: n + pad], self._out)
            enc.finalize()
            head = struct.pack("<I", MAGIC[self._mode])
        head += struct.pack("<ii", 4 + IV_LEN + 4 + clen, IV_LEN) + iv + struct.pack("<i", clen)
        self._fh.write(head)
        self._fh.write(memoryview(self._out)[:clen])
        self._fill = 0

    def flush(self) -> None:
        """Blocks are only written whole; this flushes the underlying file, not a partial block."""
        self._fh.flush()

    def close(self) -> None:
        if self._closed:
            return
        if self._fill:
            self._emit()
        self._closed = True

    def __enter__(self) -> "EncryptingWriter":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._closed = True
