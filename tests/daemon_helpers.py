"""Helpers for daemon tests: real MindSpore saves into a run layout, catalog queries, waiting."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from ckptd.format.layout import TensorLayout
from ckptd.format.strategy import ParamStrategy, Strategy, save_strategy

TP = 2
FULL_W = (8, 4)  # "w" is split on dim 0 over tp ranks; "b" is replicated


def write_tp_strategy(run_dir: Path, tp: int = TP) -> Path:
    """A tensor-parallel strategy file in MindSpore's protobuf format."""
    entries = (
        ParamStrategy("w", TensorLayout(dev_matrix=(tp,), tensor_map=(0, -1))),
        ParamStrategy("b", TensorLayout(dev_matrix=(tp,), tensor_map=(-1,))),
    )
    path = run_dir / "strategy.ckpt"
    run_dir.mkdir(parents=True, exist_ok=True)
    save_strategy(Strategy.build(entries), path)
    return path


def rank_tensors(rank: int, step: int, tp: int = TP) -> dict[str, np.ndarray]:
    full = np.arange(np.prod(FULL_W), dtype=np.float32).reshape(FULL_W) + step
    rows = FULL_W[0] // tp
    return {"w": full[rank * rows : (rank + 1) * rows], "b": np.full(3, float(step), np.float32)}


def save_shard(ms, root: Path, run: str, rank: int, step: int, *, tensors=None, rank_id: int | None = None, **kwargs) -> Path:
    rank_dir = root / run / f"rank_{rank}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    path = rank_dir / f"net-1_{step}.ckpt"
    tensors = rank_tensors(rank, step) if tensors is None else tensors
    data = [{"name": n, "data": ms.Tensor(a)} for n, a in tensors.items()]
    append = {"step_num": step, "rank_id": rank if rank_id is None else rank_id}
    ms.save_checkpoint(data, str(path), append_dict=append, crc_check=True, **kwargs)
    return path


def save_tp_step(ms, root: Path, run: str, step: int, ranks=range(TP)) -> None:
    """One step of a tensor-parallel run: its strategy file (once) and the ranks' shards."""
    if not (root / run / "strategy.ckpt").exists():
        write_tp_strategy(root / run)
    for rank in ranks:
        save_shard(ms, root, run, rank, step)


def migrated_sqlite(path: Path) -> str:
    """The URL of a new SQLite catalog at ``path``, migrated to the current schema."""
    from ckptd.catalog.db import make_engine, upgrade

    url = f"sqlite:///{path}"
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    return url


def fast_settings(root: Path, url: str, **overrides):
    """A test daemon's settings: settle, rescan and debounce short enough for tests to wait seconds."""
    from ckptd.settings import Settings

    return Settings(root=root, db=url, **({"settle_seconds": 0.2, "rescan_interval": 0.5, "debounce": 0.02} | overrides))


def started_daemon(root: Path, url: str, **overrides):
    """A started in-process daemon with :func:`fast_settings` (stop it)."""
    from ckptd.daemon import Daemon

    d = Daemon(fast_settings(root, url, **overrides))
    d.start()
    return d


def query(url: str, sql: str, **params) -> list[tuple]:
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql), params).all()]
    finally:
        engine.dispose()


@contextlib.contextmanager
def catalog_snapshot(url: str) -> Iterator[Session]:
    """A read-only session in which every read sees the same committed state of the catalog.

    A condition made of several reads (:func:`query` opens a connection per call) can combine
    moments: a count taken before the daemon registered a step and another taken after. Here
    SQLite reads in one explicit transaction (pysqlite begins one only before a write, so without
    it each SELECT sees the latest commit), PostgreSQL in one REPEATABLE READ transaction."""
    from ckptd.catalog.db import make_engine

    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                conn.execution_options(isolation_level="REPEATABLE READ")
            else:
                conn.exec_driver_sql("BEGIN")
            with Session(bind=conn) as s:
                yield s
            conn.rollback()
    finally:
        engine.dispose()


def step_states(url: str) -> dict[int, str]:
    return dict(query(url, "SELECT step, state FROM checkpoints WHERE kind = 'trained'"))


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def wait_for_rescans(source, n: int = 2, timeout: float = 60.0) -> int:
    """Wait until the daemon has completed ``n`` more full rescans of its root; the count then.

    For a test that asserts something did *not* happen: every file a rescan lists was looked at
    (and, in-process, every event poked before the call was examined), so "nothing changed" means
    ckptd saw it and did nothing, not that it had not got round to it yet. ``source`` is an
    in-process daemon (its watcher's counter; also waits for its watcher to be idle: events due
    are examined) or a callable returning the counter (``/healthz``'s ``rescans`` of a server
    process). The counter counts rescans *completed*: one may be running now, begun before the
    call, so ``n`` >= 2 for at least one that began after it."""
    watcher = getattr(source, "watcher", None)
    count = (lambda: watcher.rescans) if watcher is not None else source
    target = count() + n
    done = (lambda: count() >= target and watcher.idle()) if watcher is not None else (lambda: count() >= target)
    wait_for(done, timeout, what=f"{n} more full rescans")
    return count()


def wait_or_stop(daemon, predicate, timeout: float, what: str):
    """:func:`wait_for` on a started in-process daemon, stopping it if the wait fails; the daemon."""
    try:
        wait_for(predicate, timeout, what=what)
    except BaseException:
        daemon.stop()
        raise
    return daemon


def start_daemon_process(root: Path, url: str, *extra: str, log: Path | None = None) -> subprocess.Popen:
    env = dict(os.environ, CKPTD_SETTLE_SECONDS="0.2", CKPTD_RESCAN_INTERVAL="1")
    out = open(log, "ab") if log else subprocess.DEVNULL
    return subprocess.Popen(
        [sys.executable, "-m", "ckptd", "watch", "--root", str(root), "--db", url, *extra],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def resume_answer(url: str, run: str) -> dict:
    """The resume oracle's answer for ``run``, computed in-process (no lease taken)."""
    from sqlalchemy.orm import sessionmaker

    from ckptd.catalog.db import make_engine
    from ckptd.service.resume import ResumeOptions, resume

    engine = make_engine(url)
    try:
        with sessionmaker(engine).begin() as s:
            return resume(s, run, ResumeOptions(lease=False))
    finally:
        engine.dispose()
