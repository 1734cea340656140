"""ckptd.format.crypto against real MindSpore 2.10 encrypted checkpoints (no mocks)."""

from __future__ import annotations

import os
import struct

import mindspore as ms
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd.errors import (
    AuthenticationError,
    CkptdError,
    CorruptError,
    EncryptionError,
    InvalidKeyError,
    KeyRequiredError,
    NotEncryptedError,
    PaddingError,
    TruncatedError,
    WrongKeyError,
)
from ckptd.atomic import atomic_write
from ckptd.format.workpool import BufferPool, is_exported
from ckptd.format.crypto import (
    ENCRYPT_BLOCK_SIZE,
    EncMode,
    EncryptedSource,
    EncryptingWriter,
    ModeMismatchError,
    encrypt_file_bytes,
    load_key_file,
    require_key,
    sniff_encryption,
    validate_key,
)
from ckptd.format.crypto_blocks import header_len

GCM, CBC, SM4 = EncMode.AES_GCM, EncMode.AES_CBC, EncMode.SM4_CBC
MODE_KEYS = [(GCM, 16), (GCM, 24), (GCM, 32), (CBC, 16), (CBC, 24), (CBC, 32), (SM4, 16)]
ALL_MODES = [GCM, CBC, SM4]


def key_for(n: int, salt: int = 0) -> bytes:
    return bytes((i * 37 + 11 + salt) % 256 for i in range(n))


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "net.layer1.weight": rng.standard_normal((16, 24)).astype(np.float32),
        "net.layer1.bias": np.arange(24, dtype=np.int64),
        "net.emb": rng.standard_normal((40, 8)).astype(np.float16),
        "global_step": np.array([5], dtype=np.int32),
    }


def ms_save(path, arrays: dict[str, np.ndarray], **kw) -> str:
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in arrays.items()], str(path), **kw)
    return str(path)


def read(path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def write(path, data: bytes) -> str:
    with open(path, "wb") as fh:
        fh.write(data)
    return str(path)


@pytest.fixture(scope="module")
def plain_bytes(tmp_path_factory) -> bytes:
    return read(ms_save(tmp_path_factory.mktemp("plain") / "p.ckpt", tensors()))


@pytest.fixture(scope="module")
def ms_files(tmp_path_factory) -> dict[EncMode, tuple[str, bytes]]:
    """One MindSpore-encrypted file per mode (16-byte keys)."""
    d = tmp_path_factory.mktemp("enc")
    return {m: (ms_save(d / f"{m.value}.ckpt", tensors(), enc_key=key_for(16), enc_mode=m.value), key_for(16)) for m in ALL_MODES}


def multiblock(tmp_path, plain: bytes, mode: EncMode, block_size: int = 1000) -> tuple[str, bytes]:
    key = key_for(16, 3)
    return write(tmp_path / f"mb-{mode.value}.ckpt", encrypt_file_bytes(plain, key, mode, block_size)), key


# --- MindSpore writes, ckptd reads -----------------------------------------------------------


@pytest.mark.parametrize("mode,klen", MODE_KEYS, ids=[f"{m.value}-{k}" for m, k in MODE_KEYS])
def test_mindspore_encrypted_file_decrypts_to_the_plain_save(tmp_path, plain_bytes, mode, klen):
    key = key_for(klen)
    path = ms_save(tmp_path / "e.ckpt", tensors(), enc_key=key, enc_mode=mode.value)
    raw = read(path)
    assert sniff_encryption(raw[:4]) is mode
    for requested in (mode, mode.value, None):  # explicit, MindSpore string, auto-detected
        with EncryptedSource(path, key, requested) as src:
            assert src.mode is mode and src.trailer == b""
            assert src.size == len(plain_bytes)
            assert bytes(src.view(0, src.size)) == plain_bytes
            assert b"".join(bytes(b) for b in src.iter_plaintext()) == plain_bytes
            src.verify_all()
            (blk,) = src.blocks
            assert (blk.index, blk.file_offset, blk.plain_offset, blk.plain_len) == (0, 0, 0, len(plain_bytes))
            assert blk.cipher_offset == header_len(mode)
            assert blk.cipher_offset + blk.cipher_len == len(raw)
            assert (blk.tag is not None) == (mode is GCM) and len(blk.iv) == 16


@pytest.mark.parametrize("mode,klen", MODE_KEYS, ids=[f"{m.value}-{k}" for m, k in MODE_KEYS])
@pytest.mark.parametrize("block_size", [ENCRYPT_BLOCK_SIZE, 333])
def test_ckptd_encrypted_file_loads_in_mindspore(tmp_path, plain_bytes, mode, klen, block_size):
    key = key_for(klen, 1)
    out = tmp_path / "ckptd-enc.ckpt"
    with atomic_write(out) as fh:
        with EncryptingWriter(fh, key, mode, block_size=block_size) as w:
            for i in range(0, len(plain_bytes), 100):  # many small writes across block boundaries
                w.write(plain_bytes[i : i + 100])
    n_blocks = -(-len(plain_bytes) // block_size)
    with EncryptedSource(out, key) as src:
        assert len(src.blocks) == n_blocks and bytes(src.view(0, src.size)) == plain_bytes
    loaded = ms.load_checkpoint(str(out), dec_key=key, dec_mode=mode.value)
    for name, arr in tensors().items():
        np.testing.assert_array_equal(loaded[name].asnumpy(), arr)


def test_real_two_block_aes_gcm_save(tmp_path):
    big = {"big": np.random.default_rng(1).integers(0, 255, size=70_000_000, dtype=np.uint8), "small": np.ones(3, np.float32)}
    key = key_for(32)
    plain = read(ms_save(tmp_path / "p.ckpt", big))
    path = ms_save(tmp_path / "e.ckpt", big, enc_key=key, enc_mode="AES-GCM")
    with EncryptedSource(path, key, workers=2) as src:
        assert [b.plain_len for b in src.blocks] == [ENCRYPT_BLOCK_SIZE, len(plain) - ENCRYPT_BLOCK_SIZE]
        assert src.blocks[1].file_offset == header_len(GCM) + ENCRYPT_BLOCK_SIZE
        assert bytes(src.view(ENCRYPT_BLOCK_SIZE - 50, 100)) == plain[ENCRYPT_BLOCK_SIZE - 50 : ENCRYPT_BLOCK_SIZE + 50]
        assert src.view(0, src.size) == plain
        done = 0
        for chunk in src.iter_plaintext():
            assert chunk == plain[done : done + len(chunk)]
            done += len(chunk)
        assert done == len(plain)
    # tamper in the middle of block 1 of MindSpore's own file: block 0 still reads, block 1 is named
    raw = bytearray(read(path))
    raw[src.blocks[1].cipher_offset + src.blocks[1].cipher_len // 2] ^= 0x01
    with EncryptedSource(write(tmp_path / "t.ckpt", bytes(raw)), key) as bad:
        assert bytes(bad.view(0, 10)) == plain[:10]
        with pytest.raises(AuthenticationError) as ei:
            bad.verify_all()
        assert ei.value.offset == bad.blocks[1].file_offset


# --- multi-block round trips through ckptd's reader ------------------------------------------


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_small_block_round_trip(tmp_path, plain_bytes, mode, workers):
    path, key = multiblock(tmp_path, plain_bytes, mode, block_size=256)
    with EncryptedSource(path, key, mode, workers=workers) as src:
        assert len(src.blocks) == -(-len(plain_bytes) // 256)
        assert all(b.plain_len == 256 for b in src.blocks[:-1])
        assert [b.plain_offset for b in src.blocks] == list(range(0, len(plain_bytes), 256))
        assert b"".join(bytes(b) for b in src.iter_plaintext()) == plain_bytes
        rng = np.random.default_rng(0)
        for _ in range(50):
            off = int(rng.integers(0, src.size))
            n = int(rng.integers(0, min(900, src.size - off) + 1))
            assert bytes(src.view(off, n)) == plain_bytes[off : off + n]
        with pytest.raises(TruncatedError):
            src.view(src.size - 1, 2)


def test_views_stay_valid_while_the_cache_moves_on(tmp_path, plain_bytes):
    path, key = multiblock(tmp_path, plain_bytes, GCM, block_size=128)
    with EncryptedSource(path, key) as src:
        first = src.view(0, 64)
        as_array = np.frombuffer(src.view(128, 64), dtype=np.uint8)
        for off in range(0, src.size - 10, 97):  # forces many evictions
            src.view(off, 10)
        assert bytes(first) == plain_bytes[:64]
        assert as_array.tobytes() == plain_bytes[128:192]
        kept = [np.frombuffer(b, dtype=np.uint8) for b in src.iter_plaintext()]  # consumer keeps arrays
        assert b"".join(a.tobytes() for a in kept) == plain_bytes
        it = src.iter_plaintext()
        next(it)
        it.close()  # early stop shuts the read-ahead down


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_a_forward_walk_reads_blocks_decrypted_ahead(tmp_path, plain_bytes, workers):
    """An index pass walks forward block by block; blocks decrypted ahead on the shared pool are
    the same bytes, views of them stay valid, and a damaged block still fails where it is."""
    path, key = multiblock(tmp_path, plain_bytes, GCM, block_size=200)
    with EncryptedSource(path, key, workers=workers) as src:
        kept = [src.view(off, 16) for off in range(0, src.size - 16, 150)]
        assert [bytes(v) for v in kept] == [plain_bytes[o : o + 16] for o in range(0, src.size - 16, 150)]
        src.verify_all()
    with EncryptedSource(path, key, workers=workers) as good:
        b5 = good.blocks[5]
    raw = bytearray(read(path))
    raw[b5.cipher_offset + 7] ^= 0x01
    with EncryptedSource(write(tmp_path / "x.ckpt", bytes(raw)), key, workers=workers) as src:
        for off in range(0, 5 * 200, 100):  # blocks 0-4 read fine while block 5 fails ahead
            assert bytes(src.view(off, 10)) == plain_bytes[off : off + 10]
        with pytest.raises(AuthenticationError) as ei:
            src.view(5 * 200 + 3, 10)
        assert ei.value.offset == b5.file_offset
        with pytest.raises(AuthenticationError):
            src.verify_all()


def test_block_buffers_are_reused_only_when_nothing_views_them():
    pool = BufferPool(max_buffers=2)
    a = pool.take(100)
    assert len(a) == 100
    pool.give(a)
    assert pool.take(50) is a  # a larger free buffer serves a smaller block
    viewed = bytearray(100)
    view = memoryview(viewed)
    pool.give(viewed)
    assert pool.take(100) is not viewed  # a live view may still read it: never handed out again
    view.release()
    given = [bytearray(10), bytearray(10), bytearray(10)]
    for buf in given:
        pool.give(buf)
    taken = [pool.take(10) for _ in range(3)]
    assert sum(any(t is g for g in given) for t in taken) == 2  # at most two were kept
    assert not is_exported(viewed)


# --- fault injection -------------------------------------------------------------------------


def test_flip_last_byte_gcm_is_authentication_error(tmp_path, ms_files):
    path, key = ms_files[GCM]
    raw = bytearray(read(path))
    raw[-1] ^= 0x80
    with EncryptedSource(write(tmp_path / "x.ckpt", bytes(raw)), key) as src:
        with pytest.raises(AuthenticationError) as ei:
            src.view(src.size - 4, 4)
        assert ei.value.offset == 0 and ei.value.path.endswith("x.ckpt") and ei.value.hint


@pytest.mark.parametrize("mode", [CBC, SM4], ids=lambda m: m.value)
def test_flip_padding_byte_cbc_is_padding_error(tmp_path, ms_files, mode):
    # the last plaintext byte is C[n-1][15] XOR D(C[n]); flipping C[n-1][15] with 0xFF turns the
    # pad byte p (1..16) into p^0xFF >= 0xEF: deterministically invalid padding.
    path, key = ms_files[mode]
    raw = bytearray(read(path))
    raw[-17] ^= 0xFF
    with pytest.raises(PaddingError) as ei:
        EncryptedSource(write(tmp_path / "x.ckpt", bytes(raw)), key)
    assert ei.value.offset == 0


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.value)
def test_flip_middle_of_block_1(tmp_path, plain_bytes, mode):
    path, key = multiblock(tmp_path, plain_bytes, mode, block_size=1024)
    with EncryptedSource(path, key) as good:
        b1 = good.blocks[1]
    raw = bytearray(read(path))
    raw[b1.cipher_offset + 500] ^= 0x04
    with EncryptedSource(write(tmp_path / "x.ckpt", bytes(raw)), key) as src:
        chunks = src.iter_plaintext()
        assert bytes(next(chunks)) == plain_bytes[:1024]  # block 0 is independent and fine
        if mode is GCM:
            with pytest.raises(AuthenticationError) as ei:
                next(chunks)
            assert ei.value.offset == b1.file_offset
        else:
            # CBC has no integrity: the damage decrypts silently (the .ckpt/CRC layer must catch it)
            src.verify_all()
            assert bytes(src.view(0, src.size)) != plain_bytes


def test_flip_tag_byte(tmp_path, ms_files):
    path, key = ms_files[GCM]
    raw = bytearray(read(path))
    raw[4 + 7] ^= 0x10  # inside the 16-byte tag after the magic
    with EncryptedSource(write(tmp_path / "x.ckpt", bytes(raw)), key) as src:
        with pytest.raises(AuthenticationError):
            src.verify_all()
        with pytest.raises(AuthenticationError):
            src.view(0, 1)


# CBC with check_key=False is not listed: a wrong key yields valid padding by chance (~1/256) and
# CBC has nothing else to check, so only the .ckpt-prefix check (check_key=True) is deterministic.
@pytest.mark.parametrize(
    "mode,check_key", [(GCM, True), (GCM, False), (CBC, True), (SM4, True)], ids=["gcm", "gcm-nocheck", "cbc", "sm4"]
)
def test_wrong_key(ms_files, mode, check_key):
    path, _ = ms_files[mode]
    wrong = key_for(16, 99)
    with pytest.raises(WrongKeyError) as ei:
        with EncryptedSource(path, wrong, mode, check_key=check_key) as src:
            src.verify_all()
    assert ei.value.offset == 0 and ei.value.path == path


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.value)
def test_wrong_key_vs_tampered_later_block(tmp_path, plain_bytes, mode):
    """Same damaged block 1: the right key says 'tampered', a wrong key says 'wrong key'."""
    path, key = multiblock(tmp_path, plain_bytes, mode, block_size=512)
    with EncryptedSource(path, key) as good:
        b1 = good.blocks[1]
    raw = bytearray(read(path))
    raw[b1.cipher_offset + b1.cipher_len - 17] ^= 0xFF  # GCM: any byte; CBC: breaks the padding
    bad = write(tmp_path / "x.ckpt", bytes(raw))
    expected = AuthenticationError if mode is GCM else PaddingError
    with pytest.raises(expected) as ei:
        with EncryptedSource(bad, key, check_key=False) as src:
            src.verify_all()
    assert ei.value.offset == b1.file_offset
    with pytest.raises(WrongKeyError):
        with EncryptedSource(bad, key_for(16, 5)) as src:
            src.verify_all()


def test_wrong_mode(ms_files):
    path, key = ms_files[CBC]
    with pytest.raises(ModeMismatchError, match="file is AES-CBC encrypted but AES-GCM was requested") as ei:
        EncryptedSource(path, key, GCM)
    assert isinstance(ei.value, EncryptionError)
    with pytest.raises(ModeMismatchError, match="SM4-CBC encrypted but AES-CBC"):
        EncryptedSource(ms_files[SM4][0], key, "AES-CBC")
    with pytest.raises(EncryptionError, match="unknown encryption mode"):
        EncryptedSource(path, key, "AES-XTS")


def test_truncation(tmp_path, plain_bytes, ms_files):
    path, key = ms_files[GCM]
    raw = read(path)
    with pytest.raises(TruncatedError) as ei:
        EncryptedSource(write(tmp_path / "mid.ckpt", raw[:-5]), key)
    assert ei.value.offset == 0
    for cut in (2, 20):  # inside the magic, inside the header
        with pytest.raises(TruncatedError):
            EncryptedSource(write(tmp_path / f"h{cut}.ckpt", raw[:cut]), key)
    mb, mkey = multiblock(tmp_path, plain_bytes, SM4, block_size=700)
    mraw = read(mb)
    with EncryptedSource(mb, mkey) as src:
        b1, b2 = src.blocks[1], src.blocks[2]
    with pytest.raises(TruncatedError) as ei:
        EncryptedSource(write(tmp_path / "m1.ckpt", mraw[: b1.cipher_offset + 100]), mkey)
    assert ei.value.offset == b1.file_offset
    with pytest.raises(TruncatedError) as ei:
        EncryptedSource(write(tmp_path / "m2.ckpt", mraw[: b1.file_offset + 10]), mkey)
    assert ei.value.offset == b1.file_offset
    # a cut exactly at a block boundary is cryptographically invisible (documented limitation)
    with EncryptedSource(write(tmp_path / "b.ckpt", mraw[: b2.file_offset]), mkey) as short:
        assert short.size == 1400 and bytes(short.view(0, 1400)) == plain_bytes[:1400]


def test_plaintext_file_with_key(tmp_path, plain_bytes):
    path = write(tmp_path / "p.ckpt", plain_bytes)
    for mode in (None, GCM, SM4):
        with pytest.raises(NotEncryptedError) as ei:
            EncryptedSource(path, key_for(16), mode)
        assert ei.value.offset == 0 and ei.value.path == path
    assert require_key(path) is None


def test_encrypted_file_without_key(ms_files):
    path, _ = ms_files[SM4]
    with pytest.raises(KeyRequiredError, match="SM4-CBC"):
        require_key(path)
    assert require_key(path, b"k" * 16) is SM4


def test_mindspore_enc_plus_crc_trailer(tmp_path, plain_bytes):
    key = key_for(16)
    path = ms_save(tmp_path / "ec.ckpt", tensors(), enc_key=key, enc_mode="AES-GCM", crc_check=True)
    assert read(path)[-17:] == b"crc_num" + bytes(10)
    with EncryptedSource(path, key) as src:
        assert src.trailer == b"crc_num" + bytes(10)
        assert len(src.blocks) == 1 and bytes(src.view(0, src.size)) == plain_bytes
        src.verify_all()
    with pytest.raises(ValueError):  # MindSpore's defect: it cannot load its own file
        ms.load_checkpoint(path, dec_key=key, dec_mode="AES-GCM")
    raw = read(path)
    with pytest.raises(TruncatedError, match="crc_num"):
        EncryptedSource(write(tmp_path / "cut.ckpt", raw[:-3]), key)


def test_empty_file(tmp_path):
    path = write(tmp_path / "e.ckpt", b"")
    for mode in (None, CBC):
        with pytest.raises(TruncatedError, match="empty") as ei:
            EncryptedSource(path, key_for(16), mode)
        assert ei.value.offset == 0
    # what MindSpore writes for an encrypted save of nothing
    ms.save_checkpoint([], str(tmp_path / "none.ckpt"), enc_key=key_for(16), enc_mode="AES-GCM")
    assert read(tmp_path / "none.ckpt") == b""
    assert encrypt_file_bytes(b"", key_for(16), GCM) == b""


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.value)
def test_hostile_header_fields(tmp_path, ms_files, mode):
    path, key = ms_files[mode]
    raw = read(path)
    base = 4 + (16 if mode is GCM else 0)  # offset of block_len
    cl_at = base + 8 + 16

    def patched(block_len=None, iv_len=None, cipher_len=None) -> str:
        b = bytearray(raw)
        if block_len is not None:
            struct.pack_into("<i", b, base, block_len)
        if iv_len is not None:
            struct.pack_into("<i", b, base + 4, iv_len)
        if cipher_len is not None:
            struct.pack_into("<i", b, cl_at, cipher_len)
        return write(tmp_path / "h.ckpt", bytes(b))

    cases = [
        (dict(cipher_len=2**31 - 1), CorruptError),  # block_len disagrees
        (dict(cipher_len=2**31 - 25, block_len=2**31 - 1), CorruptError),  # consistent but absurd
        (dict(cipher_len=-16, block_len=8), CorruptError),
        (dict(cipher_len=0, block_len=24), CorruptError),
        (dict(iv_len=12), CorruptError),
        (dict(cipher_len=1 << 20, block_len=(1 << 20) + 24), TruncatedError),  # plausible, past EOF
        (dict(cipher_len=1 << 20), CorruptError),
    ]
    if mode is not GCM:
        cases.append((dict(cipher_len=8, block_len=32), CorruptError))  # not a multiple of 16
    for fields, err in cases:
        with pytest.raises(err) as ei:
            EncryptedSource(patched(**fields), key)
        assert ei.value.offset == 0, fields


def test_foreign_magic_in_later_block_and_garbage_tail(tmp_path, plain_bytes):
    path, key = multiblock(tmp_path, plain_bytes, GCM, block_size=600)
    raw = bytearray(read(path))
    with EncryptedSource(path, key) as src:
        b1 = src.blocks[1]
    raw2 = bytearray(raw)
    raw2[b1.file_offset] = 0xD9  # AES-CBC magic in a GCM file
    with pytest.raises(CorruptError, match="AES-CBC block magic") as ei:
        EncryptedSource(write(tmp_path / "m.ckpt", bytes(raw2)), key)
    assert ei.value.offset == b1.file_offset
    with pytest.raises(CorruptError) as ei:
        EncryptedSource(write(tmp_path / "g.ckpt", bytes(raw) + b"\x01\x02\x03\x04\x05"), key)
    assert ei.value.offset == len(raw)


def test_gcm_ignores_iv_bytes_12_to_15(tmp_path, ms_files, plain_bytes):
    path, key = ms_files[GCM]
    raw = bytearray(read(path))
    iv_at = 4 + 16 + 8
    raw[iv_at + 12 : iv_at + 16] = bytes(4)
    zeroed = write(tmp_path / "z.ckpt", bytes(raw))
    with EncryptedSource(zeroed, key) as src:
        src.verify_all()
        assert bytes(src.view(0, src.size)) == plain_bytes
    loaded = ms.load_checkpoint(zeroed, dec_key=key, dec_mode="AES-GCM")
    np.testing.assert_array_equal(loaded["net.emb"].asnumpy(), tensors()["net.emb"])


# --- keys -------------------------------------------------------------------------------------


def test_validate_key():
    for mode, n in MODE_KEYS:
        validate_key(bytes(n), mode)
    for mode, n in [(GCM, 15), (GCM, 0), (CBC, 64), (SM4, 24), (SM4, 32)]:
        with pytest.raises(InvalidKeyError):
            validate_key(bytes(n), mode)
    with pytest.raises(InvalidKeyError, match="raw bytes"):
        validate_key("0123456789abcdef", GCM)  # type: ignore[arg-type]
    with pytest.raises(InvalidKeyError) as ei:
        validate_key(b"k" * 16 + b"\n", SM4)
    assert "newline" in ei.value.hint
    with pytest.raises(InvalidKeyError) as ei:
        validate_key(b"00" * 16, SM4)
    assert "hex" in ei.value.hint


def test_load_key_file(tmp_path, ms_files):
    key = bytes(range(250, 256)) + b"\n" + bytes(9)
    kf = write(tmp_path / "k.bin", key)
    assert load_key_file(kf) == key  # raw bytes, nothing stripped
    with pytest.raises(CkptdError, match="not found"):
        load_key_file(tmp_path / "missing.key")
    with pytest.raises(InvalidKeyError, match="empty"):
        load_key_file(write(tmp_path / "empty.key", b""))
    with pytest.raises(InvalidKeyError, match="larger"):
        load_key_file(write(tmp_path / "big.key", bytes(5000)))
    path, real = ms_files[CBC]
    with EncryptedSource(path, load_key_file(write(tmp_path / "real.key", real))) as src:
        assert src.size > 0


def test_writer_argument_checks():
    import io

    with pytest.raises(InvalidKeyError):
        EncryptingWriter(io.BytesIO(), bytes(20), GCM)
    with pytest.raises(ValueError):
        EncryptingWriter(io.BytesIO(), bytes(16), GCM, block_size=0)
    w = EncryptingWriter(io.BytesIO(), bytes(16), SM4)
    w.close()
    with pytest.raises(ValueError):
        w.write(b"x")
    assert sniff_encryption(b"\xd8\x5e\x3a") is None and sniff_encryption(b"\x0a\x44\x0a\x01") is None


# --- properties -------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    length=st.integers(1, 3000),
    block_size=st.integers(1, 700),
    mode=st.sampled_from(ALL_MODES),
)
def test_round_trip_random_offsets(tmp_path, data, length, block_size, mode):
    plain = os.urandom(length)
    key = key_for(16 if mode is SM4 else data.draw(st.sampled_from([16, 24, 32])))
    path = write(tmp_path / "r.ckpt", encrypt_file_bytes(plain, key, mode, block_size))
    with EncryptedSource(path, key, workers=data.draw(st.integers(1, 3)), check_key=False) as src:
        assert src.size == length and len(src.blocks) == -(-length // block_size)
        for _ in range(5):
            off = data.draw(st.integers(0, length))
            n = data.draw(st.integers(0, length - off))
            assert bytes(src.view(off, n)) == plain[off : off + n]
        assert b"".join(bytes(b) for b in src.iter_plaintext()) == plain


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), mode=st.sampled_from(ALL_MODES))
def test_mutated_files_only_raise_ckptd_errors(tmp_path, plain_bytes, data, mode):
    key = key_for(16, 4)
    raw = bytearray(encrypt_file_bytes(plain_bytes, key, mode, 400))
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if kind == "flip" and raw:
            raw[pos] ^= data.draw(st.integers(1, 255))
        elif kind == "cut":
            del raw[pos : pos + data.draw(st.integers(1, 64))]
        else:
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=32))
    path = write(tmp_path / "f.ckpt", bytes(raw))
    try:
        with EncryptedSource(path, key, data.draw(st.sampled_from([None, mode]))) as src:
            src.verify_all()
            src.view(0, src.size)
    except CkptdError as exc:
        assert exc.path == path and exc.message


def test_closed_source_and_bad_key_types(tmp_path, ms_files):
    path, key = ms_files[GCM]
    src = EncryptedSource(path, key)
    src.close()
    src.close()  # idempotent
    with pytest.raises(CkptdError, match="closed"):
        src.view(0, 1)
    with pytest.raises(CkptdError, match="closed"):
        list(src.iter_plaintext())
    for bad in (16, "k" * 16, None):
        with pytest.raises(InvalidKeyError):
            EncryptedSource(path, bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidKeyError) as ei:
        EncryptedSource(path, bytes(20))  # length checked against the detected mode
    assert ei.value.path == path
    with pytest.raises(CkptdError, match="no such file"):
        EncryptedSource(tmp_path / "missing.ckpt", key)
    with pytest.raises(CkptdError):
        require_key(tmp_path / "missing.ckpt")
