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


@pytest.fixture(scope="session")
def uninterrupted_tp2(tmp_path_factory):
    """The uninterrupted tp=2 run of ``trainer_helpers.SAVES_3_6_8`` (its run directory), which
    resumed runs of the same job are compared with bitwise; one per session, shared by modules."""
    from tests import trainer_helpers as th

    return th.reference_run(tmp_path_factory, 2, 1, *th.SAVES_3_6_8)


@pytest.fixture(scope="session")
def s3():
    """A real S3 server (SeaweedFS, tests/seaweed.py) with the bucket ``ckptd``, for the session;
    each test uses its own key prefix."""
    from seaweed import SeaweedServer

    server = SeaweedServer(buckets=("ckptd",)).start()
    yield server
    server.close()


@pytest.fixture
def s3env(s3, monkeypatch):
    """:func:`s3` in this test's environment (``AWS_*``), with no shared credentials file to fall back on."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    return s3


@pytest.fixture
def root(tmp_path):
    """An empty checkpoint root (what ``ckptd serve --root`` watches)."""
    r = tmp_path / "root"
    r.mkdir()
    return r


@pytest.fixture
def outside(tmp_path):
    """A directory outside the root: where a planted link points."""
    o = tmp_path / "outside"
    o.mkdir()
    return o


# --- catalog fixtures: every catalog test runs on embedded SQLite and on the real PostgreSQL ---

PG_ADMIN_URL = os.environ.get("CKPTD_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def fresh_pg_database() -> tuple[str, callable]:
    """A new empty database on the test server (dropped afterwards), so tests never share state."""
    import uuid

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"ckptd_t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False), drop


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog_url(request, tmp_path):
    """An empty, migrated catalog URL."""
    from ckptd.catalog.db import make_engine, upgrade

    if request.param == "sqlite":
        url, drop = f"sqlite:///{tmp_path / 'catalog.db'}", (lambda: None)
    else:
        url, drop = fresh_pg_database()
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    yield url
    drop()
