"""Tensors above MindSpore's 512 MiB record limit are split across records; both split styles."""

from __future__ import annotations

import numpy as np
import pytest

from ckptd.format import ckpt as ckpt_fmt
from ckptd.format.checkpoint import open_checkpoint, write_checkpoint

pytestmark = pytest.mark.slow

# 3 x 179 x 1 MiB uint8 = 537 MiB: above the limit, and rows of 179 MiB do not align with 512 MiB chunks.
SHAPE = (3, 179, 1 << 20)


@pytest.fixture(scope="module")
def big():
    arr = np.empty(SHAPE, np.uint8)
    arr.reshape(-1)[:] = np.arange(arr.size, dtype=np.uint64).astype(np.uint8) ^ 0x5A
    arr[1, 7, 9] = 1  # make the sequence non-periodic across chunks
    return arr


def test_mindspore_split_records_read_back_exactly(ms, tmp_path, big):
    # Tensor path: raw 512 MiB byte chunks. async_save: numpy path, np.array_split along axis 0.
    for name, kwargs in (("sync", {}), ("async", {"async_save": True})):
        path = tmp_path / f"{name}.ckpt"
        ms.save_checkpoint([{"name": "big", "data": ms.Tensor(big)}, {"name": "small", "data": ms.Tensor(np.ones(3))}],
                           str(path), crc_check=True, **kwargs)
        if kwargs:
            from mindspore.train.serialization import _wait_async_thread_save_ckpt  # wait for the writer thread

            _wait_async_thread_save_ckpt()
        with open_checkpoint(path) as ck:
            ent = ck.entries["big"]
            assert len(ent.segments) >= 2 and ent.shape == SHAPE
            np.testing.assert_array_equal(ck.array("big"), big)
            assert ck.compute_crc() == ck.crc.stored
            assert ck.read_range("big", ckpt_fmt.SLICE_BYTES - 5, 10) == big.tobytes()[ckpt_fmt.SLICE_BYTES - 5 : ckpt_fmt.SLICE_BYTES + 5]


def test_ckptd_split_matches_mindspore_async_bytes_and_loads(ms, tmp_path, big):
    ours = tmp_path / "ours.ckpt"
    write_checkpoint(ours, [("big", big)], crc=True)
    theirs = tmp_path / "theirs.ckpt"
    ms.save_checkpoint([{"name": "big", "data": ms.Tensor(big)}], str(theirs), crc_check=True, async_save=True)
    from mindspore.train.serialization import _wait_async_thread_save_ckpt

    _wait_async_thread_save_ckpt()
    assert ours.stat().st_size == theirs.stat().st_size
    assert ours.read_bytes() == theirs.read_bytes()
    loaded = ms.load_checkpoint(str(ours), crc_check=True)
    np.testing.assert_array_equal(loaded["big"].asnumpy(), big)
