"""The .ckpt reader/writer against real MindSpore files, both directions."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ckptd.errors import CkptdError, CorruptError, TruncatedError
from ckptd.format import ckpt_write
from ckptd.format.checkpoint import open_checkpoint, write_checkpoint
from ckptd.format.ckpt_write import TypedArray
from ckptd.format.dtypes import bf16_to_float32
from ckptd.format.verify import verify_file
from tests.conftest import ms_save

NUMPY_DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"]


def _sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 100).astype(dtype)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_every_dtype_saved_by_mindspore_reads_back_equal(ms, tmp_path, dtype):
    tensors = {"mat": _sample(dtype, (3, 5)), "vec": _sample(dtype, (7,), 1), "scalar": _sample(dtype, (), 2)}
    path = ms_save(ms, tmp_path / "a.ckpt", tensors)
    with open_checkpoint(path) as ck:
        assert list(ck.entries) == list(tensors)
        for name, arr in tensors.items():
            got = ck.array(name)
            assert got.dtype == arr.dtype and got.shape == arr.shape
            np.testing.assert_array_equal(got, arr)


def test_bfloat16_raw_bits_match_mindspore(ms, tmp_path):
    values = np.array([[1.5, -2.25, 3.0e38], [0.0, -0.0, 1e-3]], dtype=np.float32)
    path = tmp_path / "bf.ckpt"
    ms.save_checkpoint([{"name": "w", "data": ms.Tensor(values, ms.bfloat16)}], str(path))
    expected = ms.Tensor(values, ms.bfloat16).astype(ms.float32).asnumpy()
    with open_checkpoint(path) as ck:
        assert ck.entries["w"].dtype == "BFloat16"
        np.testing.assert_array_equal(bf16_to_float32(ck.array("w")), expected)
    # and back: ckptd writes raw bf16 that MindSpore loads as the same values
    out = tmp_path / "bf_out.ckpt"
    with open_checkpoint(path) as ck:
        write_checkpoint(out, [("w", TypedArray("BFloat16", ck.array("w")))])
    loaded = ms.load_checkpoint(str(out))
    assert loaded["w"].dtype == ms.bfloat16
    np.testing.assert_array_equal(loaded["w"].astype(ms.float32).asnumpy(), expected)


def test_append_dict_values(ms, tmp_path):
    path = tmp_path / "ad.ckpt"
    append = {"epoch_num": 3, "step_num": 1200, "lr": 0.5, "flag": True, "note": "héllo wörld ✓", "neg": -7}
    ms_save(ms, path, {"w": np.ones((2, 2), np.float32)}, append_dict=append)
    with open_checkpoint(path) as ck:
        for key, val in append.items():
            got = ck.value(key)
            assert got == pytest.approx(val) and type(got) is type(val), key
        assert ck.entries["epoch_num"].dtype == "Int64"
        assert ck.entries["note"].dtype == "str"


def test_writer_is_byte_identical_to_mindspore(ms, tmp_path):
    tensors = {"a": _sample("float32", (4, 3)), "b": np.array(5, np.int32), "c": _sample("float16", (2, 2, 2))}
    append = {"epoch_num": 2, "lr": 0.25, "ok": False, "tag": "run-7"}
    for crc in (False, True):
        ms_path = ms_save(ms, tmp_path / f"ms{crc}.ckpt", tensors, append_dict=append, crc_check=crc)
        buf = io.BytesIO()
        ckpt_write.write_ckpt_stream(buf, [*tensors.items(), *append.items()], crc=crc)
        assert buf.getvalue() == ms_path.read_bytes()


@pytest.mark.parametrize("crc", [False, True])
def test_files_written_by_ckptd_load_in_mindspore(ms, tmp_path, crc):
    tensors = {f"t_{d}": _sample(d, (3, 4), i) for i, d in enumerate(NUMPY_DTYPES)}
    path = tmp_path / "ours.ckpt"
    write_checkpoint(path, [*tensors.items(), ("global_step", np.array([42], np.int32)), ("epoch_num", 9)], crc=crc)
    loaded = ms.load_checkpoint(str(path), crc_check=crc)
    for name, arr in tensors.items():
        np.testing.assert_array_equal(loaded[name].asnumpy(), arr)
    assert int(loaded["global_step"].asnumpy()[0]) == 42
    assert int(loaded["epoch_num"].asnumpy()) == 9
    report = verify_file(path)
    assert report.ok and report.crc == ("valid" if crc else "absent")


def test_crc_detects_a_flipped_payload_byte(ms, tmp_path):
    path = ms_save(ms, tmp_path / "c.ckpt", {"w": _sample("float32", (64, 64))}, crc_check=True)
    assert verify_file(path).crc == "valid"
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01  # inside the tensor payload: structure still parses
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(bytes(data))
    report = verify_file(bad)
    assert report.crc == "invalid"
    assert [p.code for p in report.problems] == ["checksum_mismatch"]
    with pytest.raises(ValueError, match="crc"):
        ms.load_checkpoint(str(bad), crc_check=True)  # MindSpore agrees it is damaged


def test_every_truncation_is_a_clear_error(ms, tmp_path):
    path = ms_save(ms, tmp_path / "t.ckpt", {"w": _sample("float32", (4, 4)), "b": _sample("int8", (3,))},
                   append_dict={"note": "xy"}, crc_check=True)
    data = path.read_bytes()
    with open_checkpoint(path) as ck:
        # ends of records: a cut there leaves a shorter but well-formed file (the format has no count)
        boundaries = {ent.segments[-1][0] + ent.segments[-1][1] for ent in ck.entries.values()}
    cut = tmp_path / "cut.ckpt"
    for n in range(0, len(data)):
        cut.write_bytes(data[:n])
        strict = verify_file(cut, require_crc=True)
        assert not strict.ok, f"truncated to {n} bytes passed verification with require_crc"
        for prob in strict.problems:
            assert prob.message and prob.hint and prob.code
        assert verify_file(cut).ok == (n in boundaries), n


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_bytes_never_escape_as_other_exceptions(ms, tmp_path, data):
    base = (tmp_path / "base.ckpt")
    if not base.exists():
        ms_save(ms, base, {"w": _sample("float32", (3, 3)), "i": _sample("int64", (2,))}, append_dict={"s": "ab"})
    raw = bytearray(base.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    fuzz = tmp_path / "fuzz.ckpt"
    fuzz.write_bytes(bytes(raw))
    report = verify_file(fuzz)  # must not raise
    try:
        with open_checkpoint(fuzz) as ck:
            for name, ent in ck.entries.items():
                if ent.is_string:
                    ck.value(name)
                elif ent.dtype in ("Float32", "Int64"):
                    ck.array(name)
    except CkptdError:
        assert not report.ok


def test_hostile_length_field_fails_fast(tmp_path):
    path = tmp_path / "hostile.ckpt"
    path.write_bytes(b"\x0a" + b"\xff" * 8 + b"\x7f" + b"\x00" * 32)  # record claims ~2**63 bytes
    with pytest.raises(TruncatedError) as info:
        open_checkpoint(path)
    assert info.value.offset == 0 and str(path) in str(info.value)


def test_garbage_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "garbage.ckpt"
    path.write_bytes(b"\x00\x01hello world")
    with pytest.raises(CkptdError) as info:
        open_checkpoint(path)
    assert info.value.code == "unknown_format"
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(TruncatedError):
        open_checkpoint(empty)


def test_size_mismatch_is_reported_not_raised(tmp_path):
    buf = io.BytesIO()
    ckpt_write.write_ckpt_stream(buf, [("w", np.zeros((2, 2), np.float32))])
    raw = bytearray(buf.getvalue())
    # rewrite dims 2x2 -> 2x3 in place (same varint sizes): payload no longer matches the shape
    raw[raw.index(b"\x08\x02\x08\x02") : raw.index(b"\x08\x02\x08\x02") + 4] = b"\x08\x02\x08\x03"
    path = tmp_path / "mismatch.ckpt"
    path.write_bytes(bytes(raw))
    report = verify_file(path)
    assert [p.code for p in report.problems] == ["corrupt"] and "needs 24 bytes but holds 16" in report.problems[0].message
    with open_checkpoint(path) as ck, pytest.raises(CorruptError):
        ck.array("w")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    arrays=st.lists(
        hnp.arrays(
            dtype=st.sampled_from([np.dtype(d) for d in NUMPY_DTYPES]),
            shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=1, max_side=5),
        ),
        min_size=1,
        max_size=5,
    ),
    crc=st.booleans(),
)
def test_property_round_trip_and_mindspore_agrees(ms, tmp_path, arrays, crc):
    items = [(f"p{i}", a) for i, a in enumerate(arrays)]
    path = tmp_path / "prop.ckpt"
    write_checkpoint(path, items, crc=crc, overwrite=True)
    with open_checkpoint(path) as ck:
        for name, arr in items:
            np.testing.assert_array_equal(ck.array(name), arr)
    loaded = ms.load_checkpoint(str(path), crc_check=crc)
    for name, arr in items:
        np.testing.assert_array_equal(loaded[name].asnumpy(), arr)
    ms_path = ms_save(ms, tmp_path / "prop_ms.ckpt", dict(items), crc_check=crc)
    assert ms_path.read_bytes() == path.read_bytes()


def test_read_range_spans_split_records(tmp_path):
    arr = np.arange(40, dtype=np.int32).reshape(10, 4)
    buf = io.BytesIO()
    # three consecutive records with one tag, as MindSpore writes a >512 MiB tensor
    for part in np.array_split(arr, 3):
        body = memoryview(np.ascontiguousarray(part)).cast("B")
        buf.write(ckpt_write.record_header("big", "Int32", arr.shape, len(body)))
        buf.write(body)
    path = tmp_path / "split.ckpt"
    path.write_bytes(buf.getvalue())
    with open_checkpoint(path) as ck:
        ent = ck.entries["big"]
        assert len(ent.segments) == 3 and ent.nbytes == arr.nbytes
        np.testing.assert_array_equal(ck.array("big"), arr)
        assert ck.read_range("big", 10, 50) == arr.tobytes()[10:60]


def test_index_cache_reuses_a_parse_only_while_the_file_is_unchanged(tmp_path):
    import os

    from ckptd.format.ckpt_write import write_ckpt_stream
    from ckptd.format.index_cache import IndexCache

    path = tmp_path / "a.ckpt"
    with open(path, "wb") as fh:
        write_ckpt_stream(fh, [("w", np.arange(8, dtype=np.float32))], crc=True)
    cache = IndexCache()
    for _ in range(2):
        with open_checkpoint(path, index_cache=cache) as ck:
            assert ck.array("w").tolist() == list(range(8))
    assert (cache.hits, cache.misses) == (1, 1)
    # rewritten in place with the same size and the old mtime put back: ctime still moves
    st = os.stat(path)
    with open(path, "r+b") as fh:
        write_ckpt_stream(fh, [("v", np.arange(8, dtype=np.float32) * 2)], crc=True)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size
    with open_checkpoint(path, index_cache=cache) as ck:
        assert list(ck.entries) == ["v"] and ck.array("v").tolist() == [2.0 * i for i in range(8)]
    assert (cache.hits, cache.misses) == (1, 2)


def test_index_cache_is_bounded_by_tensor_entries(tmp_path):
    from ckptd.format.ckpt_write import write_ckpt_stream
    from ckptd.format.index_cache import IndexCache

    cache = IndexCache(max_entries=5)
    for i in range(4):
        path = tmp_path / f"{i}.ckpt"
        with open(path, "wb") as fh:
            write_ckpt_stream(fh, [("a", np.zeros(2, np.float32)), ("b", np.ones(2, np.float32))])
        with open_checkpoint(path, index_cache=cache):
            pass
    assert cache._size <= 5 and len(cache._items) == 2  # two 2-entry indexes fit, older ones evicted
