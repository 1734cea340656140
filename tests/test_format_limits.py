"""Hostile file contents cannot make the readers build unbounded memory (docs/FORMATS.md section 6).

Every limit of :mod:`ckptd.format.limits` is refused with a ``limit_exceeded`` error naming the
file, the byte offset and the limit; memory per index entry stays small; and the fast paths the
limits rely on (the compact safetensors scanner, the fast ``.ckpt`` record parser) give exactly
what the general parsers give.
"""

from __future__ import annotations

import json
import pickle
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd.errors import CkptdError, StrategyError
from ckptd.format import ckpt as ckpt_fmt
from ckptd.format import limits
from ckptd.format import protowire as pw
from ckptd.format import safetensors_format as sf
from ckptd.format import safetensors_write as sw
from ckptd.format.checkpoint import open_checkpoint, write_checkpoint
from ckptd.format.entry import TensorEntry
from ckptd.format.index_cache import IndexCache
from ckptd.format.layout import TensorLayout
from ckptd.format.limits import FormatLimits, LimitExceededError, StrategyLimitError, StrategyLimits
from ckptd.format.source import MmapSource
from ckptd.format.strategy import (
    OpItem,
    ParamStrategy,
    Strategy,
    encode_strategy,
    load_strategy,
    parse_strategy_bytes,
    save_strategy,
)
from ckptd.format.strategy_merge import load_rank_strategies
from ckptd.format.verify import verify_file

# --- builders ----------------------------------------------------------------------------------


def tiny_records(n: int, *, name_len: int = 8, same_name: bool = False) -> bytes:
    """``n`` records of one Float32 each, in MindSpore's exact encoding (what the fast parser reads)."""
    out = []
    for i in range(n):
        name = ("p" if same_name else f"p{i:0{name_len - 1}d}").encode()
        tensor = pw.varint_field(1, 1) + pw.len_field(2, b"Float32") + pw.len_field(3, b"\0\0\0\0")
        out.append(pw.len_field(1, pw.len_field(1, name) + pw.len_field(2, tensor)))
    return b"".join(out)


def st_file(n: int, *, compact: bool = True) -> bytes:
    header = {f"p{i:07d}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(n)}
    text = json.dumps(header, separators=(",", ":") if compact else None).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(4 * n)


def write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def strategy_bytes(n: int = 2) -> bytes:
    return encode_strategy(Strategy.build([ParamStrategy(f"w{i}", TensorLayout((2,), (0, -1))) for i in range(n)]))


# --- the limits are documented module constants -----------------------------------------------


def test_limits_are_module_constants_and_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "FORMATS.md").read_text()
    for name in ("MAX_ENTRIES", "MAX_NAME_BYTES", "MAX_SHAPE_DIMS", "MAX_HEADER_BYTES", "MAX_JSON_HEADER_BYTES", "MAX_PROBLEMS",
                 "MAX_STRATEGY_BYTES", "MAX_STRATEGY_ITEMS", "MAX_STRATEGY_VALUES", "MAX_STRATEGY_UNKNOWN_BYTES"):
        assert isinstance(getattr(limits, name), int), name
        assert f"`{name}`" in doc, f"{name} is not documented in docs/FORMATS.md"
    assert limits.MAX_STRATEGY_BYTES <= 64 << 20  # far below the old 1 GiB
    assert limits.MAX_HEADER_BYTES < sf.FORMAT_MAX_HEADER_BYTES
    from ckptd.format import strategy, strategy_types

    assert strategy.MAX_STRATEGY_BYTES == strategy_types.MAX_STRATEGY_BYTES == limits.MAX_STRATEGY_BYTES
    assert sf.MAX_HEADER_BYTES == limits.MAX_HEADER_BYTES
    assert LimitExceededError.code == StrategyLimitError.code == "limit_exceeded"
    assert issubclass(StrategyLimitError, StrategyError)  # callers that catch StrategyError still do


# --- .ckpt ------------------------------------------------------------------------------------


def test_ckpt_with_more_records_than_the_default_limit_is_refused_early(tmp_path):
    """The reproducer, at the default limit: one record past MAX_ENTRIES is refused where it starts."""
    n = limits.MAX_ENTRIES
    path = write(tmp_path, "many.ckpt", tiny_records(n + 1))
    record_len = len(tiny_records(1))
    with pytest.raises(LimitExceededError) as info:
        open_checkpoint(path)
    err = info.value
    assert err.path == str(path) and err.offset == n * record_len
    assert f"more than {n} records" in err.message and "raise the limit" in err.hint
    report = verify_file(path)
    assert [p.code for p in report.problems] == ["limit_exceeded"]


def test_ckpt_limits_are_keyword_arguments(tmp_path):
    path = write(tmp_path, "a.ckpt", tiny_records(50))
    with open_checkpoint(path, limits=FormatLimits(max_entries=50)) as ck:
        assert len(ck.entries) == 50
    with pytest.raises(LimitExceededError, match="more than 49 records"):
        open_checkpoint(path, limits=FormatLimits(max_entries=49))
    # a split tensor's records count one each: memory follows records, not entries
    split = write(tmp_path, "split.ckpt", tiny_records(30, same_name=True))
    with pytest.raises(LimitExceededError, match="more than 29 records"):
        open_checkpoint(split, limits=FormatLimits(max_entries=29))
    with open_checkpoint(split, limits=FormatLimits(max_entries=30)) as ck:
        assert len(ck.entries) == 1 and len(ck.entries["p"].segments) == 30
    assert not verify_file(path, limits=FormatLimits(max_entries=49)).ok


def test_ckpt_name_bytes_are_bounded(tmp_path):
    data = tiny_records(20, name_len=100)
    path = write(tmp_path, "names.ckpt", data)
    with pytest.raises(LimitExceededError, match="names take more than 1000 bytes") as info:
        open_checkpoint(path, limits=FormatLimits(max_name_bytes=1000))
    assert info.value.offset == 10 * len(tiny_records(1, name_len=100))  # entry 11 starts here
    with open_checkpoint(path, limits=FormatLimits(max_name_bytes=2000)) as ck:
        assert len(ck.entries) == 20


def test_distinct_shapes_are_bounded(tmp_path):
    """Shapes are shared between entries; distinct ones cost their dims, so those are counted."""
    def rec(name: str, dims: list[int]) -> bytes:
        tensor = b"".join(pw.varint_field(1, d) for d in dims) + pw.len_field(2, b"UInt8") + pw.len_field(3, b"")
        return pw.len_field(1, pw.len_field(1, name.encode()) + pw.len_field(2, tensor))

    same = write(tmp_path, "same.ckpt", b"".join(rec(f"t{i}", [0] + [7] * 40) for i in range(100)))
    with open_checkpoint(same, limits=FormatLimits(max_shape_dims=41)) as ck:  # one shape, shared
        shapes = {id(e.shape) for e in ck.entries.values()}
        assert len(ck.entries) == 100 and len(shapes) == 1
    distinct = write(tmp_path, "distinct.ckpt", b"".join(rec(f"t{i}", [0] + [i] * 40) for i in range(100)))
    with pytest.raises(LimitExceededError, match="more than 400 dims") as info:
        open_checkpoint(distinct, limits=FormatLimits(max_shape_dims=400))
    assert info.value.offset == 9 * len(rec("t0", [0] + [0] * 40))  # the 10th distinct shape
    header = {f"t{i}": {"dtype": "U8", "shape": [0] + [i + 1] * 20, "data_offsets": [0, 0]} for i in range(50)}
    for sep in ((",", ":"), None):  # compact scanner and JSON parser
        text = json.dumps(header, separators=sep).encode()
        path = write(tmp_path, "d.safetensors", struct.pack("<Q", len(text)) + text)
        with pytest.raises(LimitExceededError, match="more than 100 dims"):
            open_checkpoint(path, limits=FormatLimits(max_shape_dims=100))
        with open_checkpoint(path, limits=FormatLimits(max_shape_dims=50 * 21)) as ck:
            assert len(ck.entries) == 50


def test_cached_index_is_refused_under_smaller_limits(tmp_path):
    path = write(tmp_path, "a.ckpt", tiny_records(20))
    cache = IndexCache()
    with open_checkpoint(path, index_cache=cache):
        pass
    with pytest.raises(LimitExceededError):
        open_checkpoint(path, index_cache=cache, limits=FormatLimits(max_entries=10))
    assert cache.hits == 1


def test_problems_are_capped(tmp_path):
    """A problem per entry must not become a million error objects (and a megabyte-long reason)."""
    items = []
    for i in range(300):
        tensor = pw.varint_field(1, 2) + pw.len_field(2, b"Float32") + pw.len_field(3, b"\0\0\0\0")  # needs 8 bytes
        items.append(pw.len_field(1, pw.len_field(1, f"t{i}".encode()) + pw.len_field(2, tensor)))
    path = write(tmp_path, "bad.ckpt", b"".join(items))
    with open_checkpoint(path) as ck:
        assert len(ck.entries) == 300
        assert len(ck.problems) == limits.MAX_PROBLEMS + 1
        assert "200 more problems not listed" in ck.problems[-1].message
    report = verify_file(path)
    assert len(report.problems) == limits.MAX_PROBLEMS + 1 and not report.ok
    small = verify_file(path, limits=FormatLimits(max_problems=5))
    assert len(small.problems) == 6 and "295 more problems" in small.problems[-1].message


def _retained_per_entry(path) -> float:
    tracemalloc.start()
    try:
        ck = open_checkpoint(path)
        current, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    n = len(ck.entries)
    ck.close()
    return current / n


@pytest.mark.parametrize("kind", ["ckpt", "safetensors"])
def test_memory_per_index_entry_is_small(tmp_path, kind):
    """~210 bytes per entry with an 8-byte name (it was ~430): entry, name, dict slot, shared dtype/shape."""
    data = tiny_records(20_000) if kind == "ckpt" else st_file(20_000)
    path = write(tmp_path, f"m.{kind}", data)
    assert _retained_per_entry(path) < 280


def test_tensor_entry_is_an_immutable_value():
    one = TensorEntry("w", "Float32", (2, 3), ((100, 24),), 80)
    two = TensorEntry("w", "Float32", (2, 3), ((100, 10), (200, 14)), 80)
    assert one.segments == ((100, 24),) and one.record_offset == 80 and one.nbytes == 24
    assert two.segments == ((100, 10), (200, 14)) and two.nbytes == 24 and two.to_dict()["records"] == 2
    assert one == TensorEntry("w", "Float32", (2, 3), ((100, 24),), 80) and one != two
    assert hash(one) == hash(TensorEntry("w", "Float32", (2, 3), ((100, 24),), 80))
    assert pickle.loads(pickle.dumps(two)) == two
    assert "segments=((100, 10), (200, 14))" in repr(two)
    with pytest.raises(AttributeError):
        one.name = "v"  # type: ignore[misc]
    far = TensorEntry("x" * 1000, "str", (0,), ((10**12, 5),), 10**12 - 1100)
    assert far.record_offset == 10**12 - 1100


def _general_only(monkeypatch):
    monkeypatch.setattr(ckpt_fmt, "_fast_record", lambda *a: None)


def _index_or_error(path):
    try:
        with MmapSource(path) as src:
            idx = ckpt_fmt.index_ckpt(src)
            return ("ok", [(e.name, e.dtype, e.shape, e.segments, e.record_offset) for e in idx.entries.values()],
                    [(type(p), p.message, p.offset) for p in idx.problems], idx.data_end, idx.records)
    except CkptdError as err:
        return ("error", type(err), err.message, err.offset)


def test_real_files_take_the_fast_record_parser(tmp_path, monkeypatch):
    path = tmp_path / "w.ckpt"
    big = np.arange(300, dtype=np.float32).reshape(10, 30)
    write_checkpoint(path, [("w", big), ("s", 3), ("note", "héllo"), ("x" * 300, np.ones(2, np.int8))], crc=True)
    calls = []
    real = ckpt_fmt._fast_record

    def spy(*args):
        got = real(*args)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(ckpt_fmt, "_fast_record", spy)
    with open_checkpoint(path) as ck:
        assert ck.array("w").tolist() == big.tolist() and ck.value("note") == "héllo"
    assert calls == [True] * 4


_VARIANTS = st.sampled_from(["canonical", "packed_dims", "type_first", "extra_field", "map", "no_tag", "negative_dim",
                             "long_tag", "bad_utf8", "trailing", "many_dims", "big_varint"])


def _record(variant: str, name: bytes, dims: list[int], payload: bytes, dtype: bytes = b"Float32") -> bytes:
    dims_enc = b"".join(pw.varint_field(1, d) for d in dims)
    typ, content = pw.len_field(2, dtype), pw.len_field(3, payload)
    tensor = dims_enc + typ + content
    tag = pw.len_field(1, name)
    if variant == "packed_dims":
        tensor = pw.len_field(1, b"".join(pw.encode_varint(d) for d in dims)) + typ + content
    elif variant == "type_first":
        tensor = typ + dims_enc + content
    elif variant == "extra_field":
        tensor = tensor + pw.varint_field(9, 7)
    elif variant == "negative_dim":
        tensor = pw.varint_field(1, -1) + typ + content
    elif variant == "many_dims":
        tensor = pw.varint_field(1, 1) * 65 + typ + content
    elif variant == "big_varint":  # a 10-byte non-minimal length
        tensor = dims_enc + typ + pw.key(3, pw.LEN) + bytes([0x80 | len(payload)] + [0x80] * 8 + [0]) + payload
    elif variant == "map":
        return pw.len_field(1, tag + pw.len_field(3, payload))
    elif variant == "no_tag":
        return pw.len_field(1, pw.len_field(2, tensor))
    elif variant == "long_tag":
        tag = pw.len_field(1, b"n" * 700)
    elif variant == "bad_utf8":
        tag = pw.len_field(1, b"\xff\xfe")
    value = tag + pw.len_field(2, tensor)
    if variant == "trailing":
        value += pw.varint_field(5, 1)
    return pw.len_field(1, value)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    records=st.lists(st.tuples(_VARIANTS, st.binary(min_size=0, max_size=12), st.lists(st.integers(0, 300), max_size=4),
                               st.binary(max_size=40)), min_size=1, max_size=6),
    cut=st.integers(0, 40),
    crc=st.booleans(),
)
def test_fast_and_general_record_parsers_agree(tmp_path_factory, records, cut, crc):
    data = b"".join(_record(v, n, d, p) for v, n, d, p in records)
    if cut:
        data = data[: max(1, len(data) - cut)]
    if crc:
        data += ckpt_fmt.CRC_MAGIC + bytes(10)
    path = tmp_path_factory.mktemp("agree") / "r.ckpt"
    path.write_bytes(data)
    fast = _index_or_error(path)
    with pytest.MonkeyPatch.context() as mp:
        _general_only(mp)
        general = _index_or_error(path)
    assert fast == general


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_parsers_agree_on_damaged_real_records(tmp_path_factory, data):
    """Byte flips in a file ckptd's writer made (MindSpore's encoding): same index or same error."""
    path = tmp_path_factory.mktemp("flip") / "f.ckpt"
    write_checkpoint(path, [("w", np.arange(6, dtype=np.float32).reshape(2, 3)), ("step", 7), ("note", "ab"),
                            ("b", np.zeros((2, 1, 2), np.int8))], crc=data.draw(st.booleans()))
    raw = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    path.write_bytes(bytes(raw))
    fast = _index_or_error(path)
    with pytest.MonkeyPatch.context() as mp:
        _general_only(mp)
        assert fast == _index_or_error(path)


def test_fast_parser_window_edges(tmp_path):
    """Records straddling the fast parser's window, after large payloads and near the end of the file."""
    parts = []
    for i in range(400):
        payload = bytes((i * 37) % 5000)
        parts.append(_record("canonical", f"t{i}".encode(), [len(payload)], payload, b"UInt8"))
    path = write(tmp_path, "edges.ckpt", b"".join(parts))
    fast = _index_or_error(path)
    with pytest.MonkeyPatch.context() as mp:
        _general_only(mp)
        assert fast == _index_or_error(path)
    assert fast[0] == "ok" and len(fast[1]) == 400


# --- safetensors -------------------------------------------------------------------------------


def test_safetensors_header_beyond_the_limit_is_refused(tmp_path):
    n = limits.MAX_HEADER_BYTES + 8  # within the format's 100 MB: a safetensors file, but too big for us
    path = write(tmp_path, "big.safetensors", struct.pack("<Q", n) + b'{"a":')
    with pytest.raises(LimitExceededError, match=f"{n} bytes, more than ckptd's limit") as info:
        open_checkpoint(path)
    assert info.value.offset == 0 and info.value.path == str(path)
    with pytest.raises(CkptdError):  # beyond the format's own ceiling it is not a header at all
        open_checkpoint(write(tmp_path, "absurd.safetensors", struct.pack("<Q", sf.FORMAT_MAX_HEADER_BYTES + 1) + b"{"))


def test_safetensors_with_more_tensors_than_the_default_limit_is_refused(tmp_path):
    n = limits.MAX_ENTRIES
    data = st_file(n + 1)
    path = write(tmp_path, "many.safetensors", data)
    with pytest.raises(LimitExceededError, match=f"more than {n} tensors") as info:
        open_checkpoint(path)
    assert data[info.value.offset :].startswith(f'"p{n:07d}":'.encode())


def test_safetensors_limits_are_keyword_arguments(tmp_path):
    for compact in (True, False):
        path = write(tmp_path, f"a{compact}.safetensors", st_file(40, compact=compact))
        with open_checkpoint(path, limits=FormatLimits(max_entries=40)) as ck:
            assert len(ck.entries) == 40
        with pytest.raises(LimitExceededError, match="40 tensors|more than 39 tensors"):
            open_checkpoint(path, limits=FormatLimits(max_entries=39))


def test_non_compact_headers_go_through_json_only_up_to_their_limit(tmp_path):
    spaced = write(tmp_path, "spaced.safetensors", st_file(100, compact=False))
    n = struct.unpack_from("<Q", spaced.read_bytes())[0]
    with open_checkpoint(spaced, limits=FormatLimits(max_json_header_bytes=n)) as ck:
        assert len(ck.entries) == 100
    with pytest.raises(LimitExceededError, match="not in the compact form") as info:
        open_checkpoint(spaced, limits=FormatLimits(max_json_header_bytes=n - 1))
    assert info.value.offset == 9  # where the compact form stops: the space after the first '{'
    compact = write(tmp_path, "compact.safetensors", st_file(100))  # the same tensors, compact: no JSON parser
    with open_checkpoint(compact, limits=FormatLimits(max_json_header_bytes=16)) as ck:
        assert len(ck.entries) == 100


def test_writers_of_the_safetensors_library_emit_the_compact_form(tmp_path):
    import safetensors.numpy

    arrays = {"w": np.ones((2, 3), np.float32), "b": np.arange(4, dtype=np.int64), "s": np.array(3, np.int8),
              'odd "näme"\t/€': np.zeros(0, np.float16)}
    safetensors.numpy.save_file(arrays, str(tmp_path / "ref.safetensors"), metadata={"format": "ms", "k": 'v"\\'})
    sw.write_safetensors(tmp_path / "ours.safetensors", arrays, crc=True, dtypes={"s": "Int4"})
    for name in ("ref.safetensors", "ours.safetensors"):
        blob = (tmp_path / name).read_bytes()
        (n,) = struct.unpack_from("<Q", blob)
        scanned = sf._scan_compact(blob[8 : 8 + n], 8 + n, limits.MAX_ENTRIES, limits.MAX_SHAPE_DIMS)
        assert isinstance(scanned, tuple), (name, scanned)
        assert {e.name for e in scanned[0]} == set(arrays)


def _st_index_or_error(path, general: bool):
    with pytest.MonkeyPatch.context() as mp:
        if general:
            mp.setattr(sf, "_scan_compact", lambda raw, *a: 0)
        try:
            with MmapSource(path) as src:
                idx = sf.index_safetensors(src)
                return ("ok", [(e.name, e.dtype, e.shape, e.segments, e.record_offset) for e in idx.entries],
                        idx.metadata, idx.data_start, idx.crc_stored)
        except CkptdError as err:
            return ("error", type(err), err.message, err.offset)


_NAMES = st.one_of(st.text(max_size=6), st.sampled_from(["a", "a", "b", "__metadata__", "\ud800", 'q"\\', "\x01"]))
_DTYPES = st.sampled_from(["F32", "F32", "I8", "U8", "BF16", "BOOL", "F8_E4M3", "XYZ"])


@st.composite
def _headers(draw):
    pairs = []
    if draw(st.booleans()):
        meta = draw(st.dictionaries(st.sampled_from(["format", "crc_num", "a", "b"]),
                                    st.sampled_from(["ms", "Int4", "12", "x"]), max_size=3))
        pairs.append(("__metadata__", meta))
    pos = 0
    for _ in range(draw(st.integers(0, 5))):
        dtype = draw(_DTYPES)
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        size = int(np.prod(shape)) * {"F32": 4, "BF16": 2}.get(dtype, 1)
        begin = draw(st.sampled_from([pos, pos, pos + 1, max(pos - 1, 0)]))
        end = draw(st.sampled_from([begin + size, begin + size, begin + size + 1]))
        pos = end
        pairs.append((draw(_NAMES), {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}))
    body = ",".join(f"{json.dumps(k)}:{json.dumps(v, separators=(',', ':'))}" for k, v in pairs)
    text = ("{" + body + "}").encode()
    return text, pos


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=_headers(), pad=st.sampled_from([b"", b" ", b"    ", b"\n", b"x"]), extra=st.integers(0, 2))
def test_compact_scanner_and_json_parser_agree(tmp_path_factory, header, pad, extra):
    text, data_len = header
    text += pad
    path = tmp_path_factory.mktemp("st") / "h.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data_len + extra))
    assert _st_index_or_error(path, general=False) == _st_index_or_error(path, general=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_compact_scanner_and_json_parser_agree_on_damaged_headers(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("stflip") / "f.safetensors"
    sw.write_safetensors(path, {"w": np.ones((2, 3), np.float32), "b": np.arange(3, dtype=np.int8), 'q"\\': np.zeros(1)},
                         crc=True, dtypes={"b": "Int4"})
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", raw)
    for _ in range(data.draw(st.integers(1, 3))):
        raw[data.draw(st.integers(8, 8 + n - 1))] = data.draw(st.sampled_from(list(b'{}[],:"\\ 0123456789aAF_\xff\x00')))
    path.write_bytes(bytes(raw))
    assert _st_index_or_error(path, general=False) == _st_index_or_error(path, general=True)


# --- strategy files ----------------------------------------------------------------------------


def test_strategy_file_beyond_the_size_limit_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "strategy.ckpt"
    with open(path, "wb") as fh:
        fh.write(strategy_bytes())
        fh.truncate(limits.MAX_STRATEGY_BYTES + 1)  # sparse: no disk, but os.path.getsize says 64 MiB + 1
    with pytest.raises(StrategyLimitError, match="too large for a strategy file") as info:
        load_strategy(path)
    assert info.value.path == str(path) and str(limits.MAX_STRATEGY_BYTES) in info.value.message
    with pytest.raises(StrategyLimitError, match="too large"):  # what the daemon's ingest calls on bytes it read
        parse_strategy_bytes(path.read_bytes()[: limits.MAX_STRATEGY_BYTES + 1], path)


def test_unknown_field_padding_is_refused(tmp_path):
    """The reproducer: a valid strategy padded with a field mindspore.straspb does not define."""
    base = strategy_bytes()
    padded = base + pw.len_field(15, bytes(limits.MAX_STRATEGY_UNKNOWN_BYTES + 1))
    with pytest.raises(StrategyLimitError, match="protobuf fields mindspore.straspb does not define") as info:
        parse_strategy_bytes(padded, "s.ckpt")
    assert info.value.offset == len(base) and "padded" in info.value.hint
    # a little of it (a field a later MindSpore might add) is still read, as protobuf does
    assert parse_strategy_bytes(base + pw.len_field(15, bytes(1000)), "s.ckpt").content_hash() == \
        parse_strategy_bytes(base, "s.ckpt").content_hash()
    # padding hidden deep inside items counts too, summed over the file
    layout = pw.len_field(1, pw.varint_field(1, 2)) + pw.len_field(2, pw.varint_field(1, 0))
    items = [pw.len_field(3, pw.len_field(1, f"w{i}".encode()) + pw.len_field(2, layout + pw.len_field(9, bytes(400))))
             for i in range(30)]
    deep = pw.varint_field(1, 1) + b"".join(items)
    assert len(parse_strategy_bytes(deep, "d.ckpt").entries) == 30
    with pytest.raises(StrategyLimitError, match="field 9 of parallel_layouts"):
        parse_strategy_bytes(deep, "d.ckpt", limits=StrategyLimits(max_unknown_bytes=5000))
    varints = base + pw.varint_field(20, 5) * 400
    with pytest.raises(StrategyLimitError, match="field 20 of ParallelStrategyMap"):
        parse_strategy_bytes(varints, "v.ckpt", limits=StrategyLimits(max_unknown_bytes=1000))


def test_strategy_items_and_values_are_bounded():
    ops = [OpItem(f"op{i}", 0, ((1, 2),)) for i in range(6)]
    s = Strategy.build([ParamStrategy(f"w{i}", TensorLayout((2,), (0, -1))) for i in range(5)], op_items=ops)
    for fmt in ("proto", "json"):
        data = encode_strategy(s, fmt)
        assert len(parse_strategy_bytes(data, "s", limits=StrategyLimits(max_items=11)).entries) == 5
        with pytest.raises(StrategyLimitError, match="operator and parameter items"):
            parse_strategy_bytes(data, "s", limits=StrategyLimits(max_items=10))
        with pytest.raises(StrategyLimitError, match="values|integers"):
            parse_strategy_bytes(data, "s", limits=StrategyLimits(max_values=20))
    # a device matrix of a million ones is a million integers: refused where the limit is crossed
    huge = pw.len_field(3, pw.len_field(1, b"w") + pw.len_field(2, pw.len_field(1, pw.varint_field(1, 1) * 1000)
                                                              + pw.len_field(2, pw.varint_field(1, 0))))
    with pytest.raises(StrategyLimitError, match="more than 100 integers") as info:
        parse_strategy_bytes(huge, "h", limits=StrategyLimits(max_values=100))
    assert info.value.offset is not None


def test_strategy_limits_reach_every_reader(tmp_path):
    s = Strategy.build([ParamStrategy(f"w{i}", TensorLayout((2,), (0, -1))) for i in range(5)])
    save_strategy(s, tmp_path / "a.ckpt")
    with pytest.raises(StrategyLimitError, match="too large"):
        load_strategy(tmp_path / "a.ckpt", limits=StrategyLimits(max_bytes=10))
    d = tmp_path / "strategy"
    d.mkdir()
    for r in range(2):
        save_strategy(s, d / f"ckpt_strategy_rank_{r}.ckpt")
    assert sorted(load_rank_strategies(d)) == [0, 1]
    with pytest.raises(StrategyError, match="operator and parameter items"):
        load_rank_strategies(d, limits=StrategyLimits(max_items=4))
    with pytest.raises(StrategyError, match="too large"):
        load_rank_strategies(d, limits=StrategyLimits(max_bytes=10))
