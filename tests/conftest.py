"""Shared fixtures. MindSpore is imported lazily (it takes ~2 s) and only by tests that compare with it."""

from __future__ import annotations

import os

import pytest

# Deterministic, quiet MindSpore on CPU.
os.environ.setdefault("GLOG_v", "3")
os.environ.setdefault("MS_SUBMODULE_LOG_v", "{ME:3}")


@pytest.fixture(scope="session")
def ms():
    import mindspore

    mindspore.set_context(device_target="CPU")
    return mindspore


def ms_save(ms, path, tensors, **kwargs):
    """``mindspore.save_checkpoint`` of ``{name: np.ndarray}`` through MindSpore Tensors."""
    data = [{"name": name, "data": ms.Tensor(arr)} for name, arr in tensors.items()]
    ms.save_checkpoint(data, str(path), **kwargs)
    return path
