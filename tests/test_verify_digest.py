"""One pass per shard: the digest taken from the verification's own reads (ckptd.format.digest)
equals xxh3-128 of the file, and verification reports exactly what it reports without it.
Files come from ``mindspore.save_checkpoint`` (plain, CRC, encrypted, safetensors)."""

from __future__ import annotations

import random

import mindspore as ms
import numpy as np
import pytest
import xxhash

from ckptd.format.crc import crc32_combine, parallel_crc32
from ckptd.format.crypto import encrypt_file_bytes, EncMode
from ckptd.format.digest import StreamDigest
from ckptd.format.source import MmapSource
from ckptd.format.verify import verify_file

KEY = bytes(range(16))


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {f"layer{i}.weight": rng.standard_normal((64, 48 + i)).astype(np.float32) for i in range(6)} | {
        "global_step": np.array([7], np.int32)}


def _save(path, fmt: str = "ckpt", **kw) -> str:
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in _tensors().items()], str(path), format=fmt, **kw)
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[str, bytes | None]]:
    d = tmp_path_factory.mktemp("onepass")
    plain = _save(d / "plain.ckpt")
    with open(plain, "rb") as fh:
        plain_bytes = fh.read()
    multi = d / "multi.ckpt"  # many encrypted blocks: ranges released block by block
    multi.write_bytes(encrypt_file_bytes(plain_bytes, KEY, EncMode.AES_GCM, 4096))
    return {
        "plain": (plain, None),
        "crc": (_save(d / "crc.ckpt", crc_check=True), None),
        "gcm": (_save(d / "gcm.ckpt", enc_key=KEY, enc_mode="AES-GCM"), KEY),
        "cbc": (_save(d / "cbc.ckpt", enc_key=KEY, enc_mode="AES-CBC"), KEY),
        "multi": (str(multi), KEY),
        "safetensors": (_save(d / "st.safetensors", "safetensors", crc_check=True), None),
    }


def _xxh3(path: str) -> str:
    with open(path, "rb") as fh:
        return xxhash.xxh3_128(fh.read()).hexdigest()


def _damaged(src: str, dst, mutate) -> str:
    with open(src, "rb") as fh:
        data = bytearray(fh.read())
    dst.write_bytes(bytes(mutate(data)))
    return str(dst)


def _flip(at: float):
    def mutate(data: bytearray) -> bytearray:
        data[int(len(data) * at)] ^= 0x40
        return data
    return mutate


def _same_report(path: str, key: bytes | None, **kw) -> None:
    digest = StreamDigest()
    with_digest = verify_file(path, key, digest=digest, **kw)
    alone = verify_file(path, key, **kw)
    assert digest.finish(path) == _xxh3(path)
    assert with_digest.to_dict() == alone.to_dict()  # same codes, messages and byte offsets


@pytest.mark.parametrize("kind", ["plain", "crc", "gcm", "cbc", "multi", "safetensors"])
def test_digest_of_a_sound_file_is_its_xxh3(files, kind):
    path, key = files[kind]
    digest = StreamDigest()
    report = verify_file(path, key, require_crc=kind == "crc", digest=digest)
    assert report.ok, report.problems
    if kind in ("crc", "gcm", "cbc", "multi"):
        assert digest.done > 0  # the verification's reads fed the digest, not only finish()
    assert digest.finish(path) == _xxh3(path)


@pytest.mark.parametrize("kind,mutate", [
    ("crc", _flip(0.5)),  # CRC mismatch, with the CRC's offset
    ("crc", lambda d: d[: len(d) * 2 // 3]),  # truncated mid-record
    ("crc", lambda d: d + b"\x0a\x05junk"),  # garbage after the trailer
    ("plain", _flip(0.02)),  # structural damage in a header
    ("gcm", _flip(0.6)),  # authentication failure
    ("multi", _flip(0.7)),  # a later block fails
    ("multi", lambda d: d[: len(d) - 100]),  # truncated ciphertext
    ("cbc", _flip(0.99)),  # padding
    ("safetensors", _flip(0.8)),
    ("safetensors", lambda d: d[:-10]),
])
def test_damaged_files_report_the_same_problems(files, tmp_path, kind, mutate):
    src, key = files[kind]
    _same_report(_damaged(src, tmp_path / f"bad-{kind}", mutate), key, require_crc=kind == "crc")


def test_wrong_key_and_missing_key_report_the_same(files):
    path, _ = files["gcm"]
    _same_report(path, bytes(16))
    _same_report(path, None)
    _same_report(files["plain"][0], KEY)


def test_ranges_released_out_of_order_are_hashed_in_order(tmp_path):
    data = random.Random(5).randbytes(300_000)
    path = tmp_path / "blob"
    path.write_bytes(data)
    for limit in (1 << 30, 10_000, 0):  # ahead ranges kept mapped, or unmapped and re-read by finish()
        digest = StreamDigest(ahead_limit=limit)
        src = MmapSource(path, digest)
        pieces = [(off, min(7_000, len(data) - off)) for off in range(0, len(data), 7_000)]
        order = pieces[:]
        random.Random(limit).shuffle(order)
        for off, n in order[: len(order) * 3 // 4]:
            src.release(off, n)
        src.close()
        assert digest.finish(str(path)) == xxhash.xxh3_128(data).hexdigest()


def test_parallel_crc_feeds_the_digest_and_combines(tmp_path):
    data = random.Random(9).randbytes((64 << 20) + 12345)  # above the parallel threshold
    path = tmp_path / "big"
    path.write_bytes(data)
    digest = StreamDigest()
    src = MmapSource(path, digest)
    import zlib
    assert parallel_crc32(src.view(0, src.size), 2, chunk=1 << 20, release=src.release) == zlib.crc32(data)
    src.close()
    assert digest.done == len(data)
    assert digest.finish(str(path)) == xxhash.xxh3_128(data).hexdigest()
    for a, b in [(b"", b"x"), (data[:1000], data[1000:3000]), (b"abc", b"")]:
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
