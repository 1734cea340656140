"""End-to-end ingest+verify speed of the real daemon, and the resume query at 1M shard rows.

Each measurement runs on embedded SQLite and on PostgreSQL (a fresh database, dropped after).

1. **Ingest + verify.** ``Daemon(Settings(...))`` runs in this process. A separate *writer
   process* (a trainer is never the daemon's process) writes tiny ``.ckpt`` shards (CRC trailer,
   ``step_num``/``rank_id`` append entries; each run has a strategy file, so a step expects one
   shard per rank) the way MindSpore's ``_exec_save`` does: ``net-1_<step>.tmp`` written (no
   fsync), ``os.rename`` to ``net-1_<step>.ckpt`` (the commit point; its wall time is recorded),
   then ``chmod 0400``. Latency = ``shards.verified_at`` (same machine clock, UTC) - rename time.
     * ``live``, trickle: a small run whose shards arrive one at a time, far below the daemon's
       capacity: the pipeline's own latency (debounce + ingest + verify + step checks). Then one
       later periodic rescan of that unchanged tree is timed (cost per unchanged shard).
     * ``live``, burst: the ``--ranks`` x ``--steps`` job; all ranks of a step rename at once
       (as a data-parallel job saves), a step every ``--step-interval`` s.
     * ``cold``: the whole job tree exists; the daemon starts and its first rescan finds it.
   Runs are cut after ``--budget`` s so a full run stays around 10 minutes: throughput is
   measured over what got done; a shard still unverified at the cut counts as (cut - rename), a
   lower bound, shown as "≥".
2. **Resume query.** runs/checkpoints rows (many runs of 8..512 ranks; most steps verified, the
   newest three incomplete/pending/corrupt, ~1% marked bad, old steps rotated away, some
   breakpoint saves) are inserted, then shard rows server-side (``INSERT ... SELECT`` over a rank
   series) up to ``--rows``; ``ckptd.catalog.repo.latest_restorable(session, run_id)`` is timed on
   random runs, before and after ``ANALYZE``.
3. **Several daemons on one shared root** (``--daemons 2``; issue 13). 1 and N real ``ckptd serve``
   processes, each with its own ``CKPTD_NODE_NAME``, watch ONE root and share ONE PostgreSQL
   catalog (a fresh database); the same writer process writes the ``--ranks`` x ``--steps`` burst
   (``paced``: a step every ``--step-interval`` s; ``flood``: back to back). Reported per run: CPU
   (user+sys, children included, psutil) of every daemon from just before the writer starts to the
   last step ``verified``, per verified shard; the PostgreSQL backends' CPU for that database; wall
   time; each daemon's idle CPU; the duplicate-work figure = shard ``verification_events`` / shards
   (1.00 = every shard verified once) and step checks / steps; how the verifications split between
   the nodes (each daemon's own ``ckptd_shards_verified_total``, and ``shards.node``). Counts
   alternate 1, N, 1, N ... over ``--repeat`` reps; the medians' ratios to 1 daemon are printed.

    python bench/ingest_verify.py [--ranks 512] [--steps 20] [--rows 1000000]
                                  [--backends sqlite,postgresql] [--modes live,cold] [--budget 75]
                                  [--watch auto|inotify|watchdog|inotify,watchdog]
                                  [--daemons 2 [--shared-modes paced,flood] [--repeat 3]]
    # only the shared-root comparison:
    python bench/ingest_verify.py --daemons 2 --modes '' --rows 0 --backends '' --ranks 128 --steps 4 --repeat 3

PostgreSQL: ``CKPTD_TEST_PG`` (default: the tests' ``postgresql+psycopg://postgres@127.0.0.1:5432/test``
admin database). Files go to a temp dir under /tmp, removed at exit. The machine's load average
is printed: other processes on a small machine move these numbers a lot.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import logging
import math
import multiprocessing
import os
import platform
import random
import re
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from ckptd.format.ckpt_write import write_ckpt_stream
from ckptd.format.layout import TensorLayout
from ckptd.format.strategy import ParamStrategy, Strategy, save_strategy

PG_ADMIN_URL = os.environ.get("CKPTD_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
TARGET_P99_S = 1.0
TARGET_QUERY_MS = 10.0
NAN = float("nan")

log = logging.getLogger("bench")


# --- the synthetic trainer -------------------------------------------------------------------


def write_strategy(run_dir: Path, ranks: int) -> None:
    """'w' split on dim 0 over all ranks, 'b' replicated: a step expects ``ranks`` shards."""
    entries = (
        ParamStrategy("w", TensorLayout(dev_matrix=(ranks,), tensor_map=(0, -1))),
        ParamStrategy("b", TensorLayout(dev_matrix=(ranks,), tensor_map=(-1,))),
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    save_strategy(Strategy.build(entries), run_dir / "strategy.ckpt")


def shard_bytes(rank: int, step: int) -> bytes:
    """One rank's ~170-byte shard: its 2x4 slice of 'w', the replicated 'b', the append entries."""
    w = np.arange(8, dtype=np.float32).reshape(2, 4) + rank * 8 + step
    b = np.full(3, float(step), np.float32)
    buf = io.BytesIO()
    write_ckpt_stream(buf, [("w", w), ("b", b), ("step_num", step), ("rank_id", rank)], crc=True)
    return buf.getvalue()


def write_job(
    root: str, run: str, ranks: int, steps: int, step_interval: float, shard_interval: float, out_tsv: str,
    dir_lead: float,
) -> None:
    """Per shard: ``.tmp`` write, ``os.rename`` (time appended to ``out_tsv``), ``chmod 0400``.

    ``step_interval``: seconds between the starts of two steps; ``shard_interval``: a pause after
    every shard (a trickle). Times are flushed as they happen, so a writer cut short still reports.
    """
    rank_dirs = [os.path.join(root, run, f"rank_{r}") for r in range(ranks)]
    for d in rank_dirs:
        os.makedirs(d, exist_ok=True)  # ModelCheckpoint creates its directory at start-up ...
    time.sleep(dir_lead)  # ... well before its first save
    t_next = time.monotonic()
    with open(out_tsv, "a") as times:
        for step in range(1, steps + 1):
            for rank, d in enumerate(rank_dirs):
                data = shard_bytes(rank, step)
                final = os.path.join(d, f"net-1_{step}.ckpt")
                tmp = os.path.join(d, f"net-1_{step}.tmp")  # MindSpore replaces the extension by .tmp
                with open(tmp, "ab") as fh:
                    fh.write(data)
                os.rename(tmp, final)
                t = time.time()
                os.chmod(final, 0o400)
                times.write(f"{final}\t{t!r}\n")
                if shard_interval:
                    times.flush()
                    time.sleep(shard_interval)
            times.flush()
            t_next += step_interval
            time.sleep(max(0.0, t_next - time.monotonic()))


def read_renames(path: str) -> dict[str, float]:
    out: dict[str, float] = {}
    with contextlib.suppress(FileNotFoundError), open(path) as fh:
        for line in fh:
            p, _, t = line.rstrip("\n").partition("\t")
            if t:
                out[p] = float(t)
    return out


# --- catalogs and statistics -----------------------------------------------------------------


def _engine(url: str):
    return create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))


@contextlib.contextmanager
def fresh_catalog(backend: str, tmp: Path, tag: str) -> Iterator[str]:
    """An empty, migrated catalog URL (PostgreSQL: a new database, force-dropped afterwards)."""
    from ckptd.catalog.db import make_engine, upgrade

    admin, name = None, f"ckptd_bench_{tag}_{uuid.uuid4().hex[:8]}"
    if backend == "sqlite":
        url = f"sqlite:///{tmp / f'{name}.db'}"
    else:
        admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        url = make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    try:
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        yield url
    finally:
        if admin is not None:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()


def as_epoch(value: Any) -> float:
    """Catalog timestamps as POSIX seconds (SQLite hands back naive UTC datetimes)."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.timestamp()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))] if s else NAN


def latency_stats(renamed: dict[str, float], verified: dict[str, float], t_cut: float) -> dict[str, Any]:
    """rename->verified p50/p99/max; an unverified shard counts as ``t_cut - rename`` (censored)."""
    samples = sorted((verified[p] - t, False) if p in verified else (t_cut - t, True) for p, t in renamed.items())
    out: dict[str, Any] = {"n": len(samples), "censored": sum(c for _, c in samples)}
    for name, q in (("p50", 50), ("p99", 99), ("max", 100)):
        out[name], out[name + "_censored"] = (
            samples[min(len(samples) - 1, round(q / 100 * (len(samples) - 1)))] if samples else (NAN, False)
        )
    return out


def step_latencies(renamed: dict[str, float], step_rows: list, run_id: int | None) -> tuple[float, float]:
    """Last rename of a step -> the step's last update (its change to ``verified``): p50, max."""
    last: dict[int, float] = {}
    for p, t in renamed.items():
        step = int(p.rsplit("_", 1)[1].split(".")[0])
        last[step] = max(last.get(step, 0.0), t)
    lat = [
        as_epoch(ua) - last[st] for rid, st, state, ua in step_rows if rid == run_id and state == "verified" and st in last
    ]
    return pct(lat, 50), max(lat, default=NAN)


class _Counter(logging.Handler):
    """Collects the daemon's warnings/errors (a failed ingest step is logged, then retried)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        cause = f" [{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}]" if exc else ""
        self.records.append(f"{record.levelname} {record.name}: {record.getMessage()}{cause}")


# --- 1. ingest + verify ----------------------------------------------------------------------


class _Cut(Exception):
    """Raised into the daemon's ingest thread when the bench cuts a run at its budget."""


def _cut_daemon(daemon: Any) -> float:
    """Stop a daemon that still has a backlog (``Daemon.stop()`` cannot); returns seconds taken.

    ``Watcher.stop()`` cannot interrupt a running rescan or event batch (it gives up joining after
    30 s and leaves the ingest thread running on a disposed engine) and ``Verifier.drain(60)``
    raises on a backlog. Bench-only workaround: every later ``Ingestor.examine_many`` call raises (an
    instance attribute shadows the method), which ends the rescan/batch at once; queued
    verifications are dropped. The ingest thread must be gone before the next measurement.
    """
    t0 = time.perf_counter()

    def cut(paths: list[str]) -> dict[str, str]:
        raise _Cut(paths[0] if paths else "")

    watcher_log = logging.getLogger("ckptd.watcher")
    watcher_log.disabled = True  # else one "ingest step failed" line per remaining path
    daemon.ingestor.examine_many = cut
    daemon.watcher.stop()
    daemon.watcher._thread.join(60)
    if daemon.watcher._thread.is_alive():
        raise RuntimeError("the daemon's ingest thread did not stop; later measurements would be disturbed")
    daemon.verifier.close()  # drops the queue, waits only for the batches being verified
    daemon.engine.dispose()
    watcher_log.disabled = False
    return time.perf_counter() - t0


_PROGRESS = text(
    "SELECT (SELECT count(*) FROM shards s JOIN checkpoints c ON s.checkpoint_id = c.id"
    "        WHERE c.run_id = r.id AND s.state = 'verified'),"
    "       (SELECT count(*) FROM checkpoints c WHERE c.run_id = r.id AND c.state = 'verified') "
    "FROM runs r WHERE r.name = :run"
)


def _wait(daemon: Any, eng: Any, run: str, shards: int, steps: int, budget: float, stall: float, writer: Any) -> str:
    """Poll until every shard and step of ``run`` is verified: done | budget | stalled | corrupt."""
    end = time.monotonic() + budget
    last_v, last_change, last_report = -1, time.monotonic(), time.monotonic()
    while True:
        with eng.connect() as conn:
            v, st = conn.execute(_PROGRESS, {"run": run}).first() or (0, 0)
        now = time.monotonic()
        if v >= shards and st >= steps:
            return "done"
        if daemon.verifier.failed_count:
            return "corrupt"
        if now >= end:
            return "budget"
        if v != last_v:
            last_v, last_change = v, now
        elif now - last_change > stall and (writer is None or not writer.is_alive()):
            return "stalled"
        if now - last_report > 15:
            last_report = now
            log.info("    %s: %d/%d shards, %d/%d steps verified", run, v, shards, st, steps)
        time.sleep(0.25)


def _trickle(daemon: Any, eng: Any, root: Path, args: argparse.Namespace, tsv: str, out: dict[str, Any]) -> None:
    n = args.trickle_ranks * args.trickle_steps
    write_strategy(root / "trickle", args.trickle_ranks)
    proc = multiprocessing.get_context("spawn").Process(target=write_job, args=(
        str(root), "trickle", args.trickle_ranks, args.trickle_steps, 0.0, 1.0 / args.trickle_rate, tsv, 1.0))
    proc.start()
    outcome = _wait(daemon, eng, "trickle", n, args.trickle_steps, n / args.trickle_rate + 60, args.stall, proc)
    proc.join(10)
    t_cut = time.time()
    t0 = time.perf_counter()
    report = daemon.ingestor.rescan()  # what a periodic rescan of this unchanged tree costs
    out["rescan_s"], out["rescan_seen"] = time.perf_counter() - t0, report.shards_seen
    with eng.connect() as conn:
        run_id = conn.execute(text("SELECT id FROM runs WHERE name = 'trickle'")).scalar()
        rows = conn.execute(text(
            "SELECT s.path, s.verified_at FROM shards s JOIN checkpoints c ON s.checkpoint_id = c.id "
            "WHERE c.run_id = :r AND s.state = 'verified'"), {"r": run_id}).all()
        steps = conn.execute(text("SELECT run_id, step, state, updated_at FROM checkpoints WHERE run_id = :r"),
                             {"r": run_id}).all()
    renamed = read_renames(tsv)
    out["trickle"] = {"outcome": outcome, **latency_stats(renamed, {p: as_epoch(v) for p, v in rows}, t_cut)}
    out["trickle"]["step_p50"], out["trickle"]["step_max"] = step_latencies(renamed, steps, run_id)


def run_ingest(backend: str, mode: str, args: argparse.Namespace, tmp: Path, watch: str = "auto") -> dict[str, Any]:
    from ckptd.daemon import Daemon
    from ckptd.settings import Settings

    root = tmp / f"root-{backend}-{mode}-{watch}"
    root.mkdir()
    write_strategy(root / "job", args.ranks)
    total = args.ranks * args.steps
    job_tsv = str(tmp / f"job-{backend}-{mode}-{watch}.tsv")
    counter = _Counter()
    label = backend if len(args.watch) == 1 else f"{backend}, {watch} events"
    out: dict[str, Any] = {"backend": label, "mode": mode, "shards": total, "watch": watch}
    writer = None
    with fresh_catalog(backend, tmp, f"ingest_{mode}") as url:
        settings = Settings(
            root=root, db=url, require_crc=True, verify_workers=args.workers, rescan_interval=args.rescan_interval,
            watch_backend=watch,
        )
        if mode == "cold":
            write_job(str(root), "job", args.ranks, args.steps, 0.0, 0.0, job_tsv, 0.0)
        eng = _engine(url)
        logging.getLogger("ckptd").addHandler(counter)
        daemon = Daemon(settings)
        t_start = time.time()
        daemon.start()
        if mode == "live":
            if not daemon.watcher.ready.wait(60):
                raise RuntimeError("the daemon's initial rescan did not finish")
            _trickle(daemon, eng, root, args, str(tmp / f"trickle-{backend}-{watch}.tsv"), out)
            writer = multiprocessing.get_context("spawn").Process(target=write_job, args=(
                str(root), "job", args.ranks, args.steps, args.step_interval, 0.0, job_tsv, 1.0))
            writer.start()
        cpu0 = time.process_time()  # this process = the daemon (+ a progress query every 0.25 s)
        out["outcome"] = _wait(daemon, eng, "job", total, args.steps, args.budget, args.stall, writer)
        t_cut = time.time()
        out["cpu_s"] = time.process_time() - cpu0
        if writer is not None:
            writer.join(timeout=1)
            if writer.is_alive():
                writer.terminate()  # the budget ran out before the job finished writing
                writer.join()
        logging.getLogger("ckptd").removeHandler(counter)
        if out["outcome"] == "done":
            t0 = time.perf_counter()
            daemon.stop()
            out["stop_s"] = time.perf_counter() - t0
        else:
            out["stop_s"] = _cut_daemon(daemon)
        with eng.connect() as conn:
            job_id = conn.execute(text("SELECT id FROM runs WHERE name = 'job'")).scalar()
            shard_rows = conn.execute(text(
                "SELECT s.path, s.state, s.seen_at, s.verified_at FROM shards s "
                "JOIN checkpoints c ON s.checkpoint_id = c.id WHERE c.run_id = :r"), {"r": job_id}).all()
            step_rows = conn.execute(text("SELECT run_id, step, state, updated_at FROM checkpoints")).all()
        eng.dispose()
    out["log_problems"], out["log_sample"] = len(counter.records), counter.records[:3]

    renamed = read_renames(job_tsv)
    verified = {p: as_epoch(va) for p, st, _, va in shard_rows if st == "verified"}
    seen = [as_epoch(sa) for _, _, sa, _ in shard_rows]
    t_first = min(renamed.values(), default=t_start) if mode == "live" else t_start
    out.update(
        written=len(renamed), verified=len(verified), ingested=len(seen),
        steps_verified=sum(1 for rid, _, st, _ in step_rows if rid == job_id and st == "verified"),
    )
    out["e2e_s"] = max(verified.values(), default=NAN) - t_first
    out["shards_per_s"] = len(verified) / out["e2e_s"] if verified else 0.0
    # load-independent cost: CPU seconds the daemon spent per verified shard (ingest, verification,
    # step checks, file events); 1 / this = shards/s one free core sustains
    out["cpu_ms_per_shard"] = 1000 * out["cpu_s"] / len(verified) if verified else NAN
    out["ingest_per_s"] = len(seen) / (max(seen) - t_first) if seen else 0.0
    if mode == "live":
        out["burst"] = latency_stats(renamed, verified, t_cut)
        out["burst"]["step_p50"], out["burst"]["step_max"] = step_latencies(renamed, step_rows, job_id)
    return out


# --- 2. the resume query at 1M shard rows ----------------------------------------------------

WORLDS = (8, 32, 128, 512)

SHARDS_FROM_CHECKPOINTS = """
INSERT INTO shards (checkpoint_id, rank, path, size, mtime_ns, inode, digest, state, format, crc,
                    global_step, quarantined, verified_at, seen_at)
SELECT c.id, r.n,
       '/data/ckpt/run' || c.run_id || '/rank_' || r.n || '/net-' || c.epoch || '_' || c.step
           || CASE WHEN c.kind = 'breakpoint' THEN '_breakpoint' ELSE '' END || '.ckpt',
       1048576 + r.n, 1700000000000000000 + c.id, c.id * 1000 + r.n, 'b6f1a3e0c2d94f87a1b2c3d4e5f60718',
       CASE WHEN c.state = 'deleted' AND r.n = 0 THEN 'deleted'
            WHEN c.state = 'corrupt' AND r.n = 1 THEN 'corrupt'
            WHEN c.state = 'pending' AND r.n % 3 = 0 THEN 'complete'
            ELSE 'verified' END,
       'ckpt', 'valid', c.step, {false}, :now, :now
FROM checkpoints c JOIN {series}
  ON r.n < CASE WHEN c.state = 'incomplete' THEN c.expected_ranks / 2 ELSE c.expected_ranks END
"""


def plan_checkpoints(rows: int, runs: int, rng: random.Random) -> list[dict[str, Any]]:
    """``runs`` runs cycling through WORLDS ranks, ~rows/runs shards each; newest steps unfinished."""
    per_run, now = -(-rows // runs), datetime.now(UTC)
    ckpts: list[dict[str, Any]] = []
    for run_id in range(1, runs + 1):
        world = WORLDS[(run_id - 1) % len(WORLDS)]
        steps = max(4, -(-per_run // world))
        tail = ["incomplete", "pending", rng.choice(["corrupt", "pending"])]  # newest first
        for i in range(1, steps + 1):
            if i > steps - len(tail):
                state = tail[steps - i]
            elif i <= steps // 3 and i % 10:  # keep_checkpoint_max rotated these away (every 10th kept)
                state = "deleted"
            else:
                state = "verified"
            ckpts.append({
                "run_id": run_id, "prefix": "net", "epoch": 1, "step": i * 100, "kind": "trained",
                "global_step": i * 100 if state == "verified" else None, "state": state, "expected_ranks": world,
                "step_checks_ok": True if state == "verified" else None, "pinned": False,
                "marked_bad": state == "verified" and rng.random() < 0.01, "created_at": now, "updated_at": now,
            })
            if i % 25 == 0:  # an exception_save breakpoint beside some steps: never a resume candidate
                ckpts.append({**ckpts[-1], "kind": "breakpoint", "state": "verified", "marked_bad": False})
    return ckpts


def populate(url: str, rows: int, runs: int, seed: int) -> dict[str, Any]:
    from ckptd.catalog.models import Checkpoint, Run

    engine = _engine(url)
    pg = engine.dialect.name == "postgresql"
    now = datetime.now(UTC)
    t0 = time.perf_counter()
    ckpts = plan_checkpoints(rows, runs, random.Random(seed))
    series = (
        "generate_series(0, 511) AS r(n)" if pg
        else "(WITH RECURSIVE s(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM s WHERE n < 511) SELECT n FROM s) AS r"
    )
    with engine.begin() as conn:
        conn.execute(insert(Run), [
            {"id": i, "name": f"run{i}", "path": f"/data/ckpt/run{i}", "world_size": WORLDS[(i - 1) % len(WORLDS)],
             "created_at": now} for i in range(1, runs + 1)
        ])
        conn.execute(insert(Checkpoint), ckpts)
        sql = SHARDS_FROM_CHECKPOINTS.format(false="false" if pg else "0", series=series)
        conn.execute(text(sql), {"now": now if pg else now.strftime("%Y-%m-%d %H:%M:%S.%f")})
        if pg:
            conn.execute(text("SELECT setval(pg_get_serial_sequence('runs', 'id'), :n)"), {"n": runs})
        shards = conn.execute(text("SELECT count(*) FROM shards")).scalar()
    engine.dispose()
    return {"runs": runs, "checkpoints": len(ckpts), "shard_rows": shards, "populate_s": time.perf_counter() - t0}


def time_query(url: str, runs: int, calls: int, seed: int) -> dict[str, Any]:
    from ckptd.catalog.db import make_engine
    from ckptd.catalog.repo import latest_restorable

    rng = random.Random(seed)
    engine = make_engine(url)  # the daemon's own engine setup (SQLite pragmas, PG pool)
    samples: list[float] = []
    found = 0
    with Session(engine) as s:
        for run_id in range(1, min(runs, 20) + 1):  # warm-up: connection, statement cache, page cache
            latest_restorable(s, run_id)
        for _ in range(calls):
            run_id = rng.randint(1, runs)
            s.expunge_all()
            t0 = time.perf_counter()
            found += latest_restorable(s, run_id) is not None
            samples.append((time.perf_counter() - t0) * 1000)
        s.rollback()
    sql = ("SELECT * FROM checkpoints WHERE run_id = 1 AND state = 'verified' AND kind = 'trained' "
           "AND marked_bad = {f} ORDER BY epoch DESC, step DESC LIMIT 1")
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            plan = conn.execute(text("EXPLAIN " + sql.format(f="false"))).scalars().all()
        else:
            plan = [r[-1] for r in conn.execute(text("EXPLAIN QUERY PLAN " + sql.format(f="0"))).all()]
    engine.dispose()
    return {"p50_ms": pct(samples, 50), "p99_ms": pct(samples, 99), "max_ms": max(samples), "found": found,
            "plan": " / ".join(p.strip() for p in plan)}


def run_query_bench(backend: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    with fresh_catalog(backend, tmp, "query") as url:
        out: dict[str, Any] = {"backend": backend, **populate(url, args.rows, args.runs, args.seed)}
        out["fresh"] = time_query(url, args.runs, args.calls, args.seed)
        engine = _engine(url)
        with engine.begin() as conn:
            conn.execute(text("ANALYZE"))
        engine.dispose()
        out["analyzed"] = time_query(url, args.runs, args.calls, args.seed + 1)
    return out


# --- 3. several daemons on one shared root ---------------------------------------------------

CODE_ROOT = Path(__file__).resolve().parents[1]  # the daemons run this tree's ckptd, like the bench
_READ_TOKEN = "bench-read-token"
_IDLE_S = 3.0  # an idle window before the writer starts
_HOLD_S = 3.0  # after the last step is verified: longer than settle_seconds, so a late duplicate shows


def _free_port() -> int:
    from ckptd.launcher.supervise import free_port

    return free_port()


def _cpu_s(proc: Any) -> float:
    """user + system CPU seconds of a psutil process, its reaped children and its live ones."""
    import psutil

    t = proc.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            c = child.cpu_times()
            total += c.user + c.system
    return total


class _DaemonProc:
    """One ``ckptd serve`` process (its own node name) on the shared root and catalog."""

    def __init__(self, name: str, root: Path, url: str, args: argparse.Namespace, log_path: Path) -> None:
        import psutil

        self.name, self.port, self.log_path = name, _free_port(), log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}  # nothing from the caller's config
        env.update(
            CKPTD_NODE_NAME=name, CKPTD_REQUIRE_CRC="true", CKPTD_VERIFY_WORKERS=str(args.workers),
            CKPTD_RESCAN_INTERVAL=str(args.rescan_interval), CKPTD_TOKENS=json.dumps({_READ_TOKEN: "read"}),
            PYTHONPATH=os.pathsep.join([str(CODE_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        )
        cmd = [sys.executable, "-m", "ckptd", "serve", "--root", str(root), "--db", url, "--port", str(self.port)]
        self.log = open(log_path, "ab")  # noqa: SIM115 - the child's stdout until stop()
        self.popen = subprocess.Popen(cmd, env=env, cwd=CODE_ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.ps = psutil.Process(self.popen.pid)

    def get(self, path: str) -> str:
        import urllib.request

        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     headers={"Authorization": f"Bearer {_READ_TOKEN}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.read().decode()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def ready(self) -> bool:
        if not self.alive():
            raise RuntimeError(f"daemon {self.name} exited {self.popen.returncode}: {self.log_text()[-2000:]}")
        try:
            return bool(json.loads(self.get("/healthz")).get("first_rescan_done"))
        except OSError:
            return False

    def verified_total(self) -> int | None:
        """This process's own count of verdicts it stored (``ckptd_shards_verified_total``)."""
        with contextlib.suppress(OSError):
            m = re.search(r"^ckptd_shards_verified_total (\S+)$", self.get("/metrics"), re.MULTILINE)
            return int(float(m.group(1))) if m else None  # prometheus_client writes every value as a float
        return None

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(30)
        self.log.close()


class _PgBackendCpu:
    """CPU of the PostgreSQL backends serving the bench database (same machine; root may read
    their /proc), sampled at every poll: a backend that exits between two polls loses its last
    quarter second, one that lives and exits between two polls is missed."""

    def __init__(self, conn: Any, database: str) -> None:
        self.conn, self.database = conn, database
        self.base: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.ok = True
        self.sample(baseline=True)

    def sample(self, baseline: bool = False) -> None:
        import psutil

        pids = self.conn.execute(text(
            "SELECT pid FROM pg_stat_activity WHERE datname = :d AND pid <> pg_backend_pid()"), {"d": self.database}
        ).scalars().all()
        for pid in pids:
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.AccessDenied:
                self.ok = False
                continue
            except psutil.Error:
                continue
            cpu = t.user + t.system
            if baseline:
                self.base[pid] = cpu
            self.last[pid] = cpu

    def seconds(self) -> float:
        return sum(cpu - self.base.get(pid, 0.0) for pid, cpu in self.last.items()) if self.ok else NAN


def run_shared(n: int, mode: str, rep: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """``n`` ``ckptd serve`` processes on one root and one PostgreSQL catalog; the burst written once."""
    tag = f"shared-{n}-{mode}-{rep}"
    root = tmp / f"root-{tag}"
    root.mkdir()
    write_strategy(root / "job", args.ranks)
    total = args.ranks * args.steps
    tsv = str(tmp / f"job-{tag}.tsv")
    interval = args.step_interval if mode == "paced" else 0.0
    out: dict[str, Any] = {"daemons": n, "mode": mode, "rep": rep, "shards": total}
    with fresh_catalog("postgresql", tmp, f"shared{n}") as url:
        eng = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1), isolation_level="AUTOCOMMIT")
        procs = [_DaemonProc(f"bench-node-{i + 1}", root, url, args, tmp / f"{tag}-node{i + 1}.log") for i in range(n)]
        writer = None
        try:
            t_ready = time.monotonic() + 90
            while not all(p.ready() for p in procs):
                if time.monotonic() > t_ready:
                    raise RuntimeError("the daemons' initial rescans did not finish within 90 s")
                time.sleep(0.2)
            with eng.connect() as conn:
                nodes = conn.execute(text("SELECT name FROM nodes ORDER BY name")).scalars().all()
                if len(nodes) != n:
                    raise RuntimeError(f"{len(nodes)} nodes registered, expected {n}: {nodes}")
                idle0, t_idle = [_cpu_s(p.ps) for p in procs], time.monotonic()
                time.sleep(_IDLE_S)  # what a daemon costs with nothing to do (heartbeats, event loop)
                out["idle_cpu_per_s"] = [(_cpu_s(p.ps) - c) / (time.monotonic() - t_idle) for p, c in zip(procs, idle0)]
                pg_cpu = _PgBackendCpu(conn, make_url(url).database)
                cpu0 = [_cpu_s(p.ps) for p in procs]
                t_cpu0 = time.monotonic()
                writer = multiprocessing.get_context("spawn").Process(
                    target=write_job, args=(str(root), "job", args.ranks, args.steps, interval, 0.0, tsv, 1.0))
                writer.start()
                end = time.monotonic() + args.budget
                last_v, last_change, last_report = -1, time.monotonic(), time.monotonic()
                while True:
                    v, st = conn.execute(_PROGRESS, {"run": "job"}).first() or (0, 0)
                    pg_cpu.sample()
                    now = time.monotonic()
                    if v >= total and st >= args.steps:
                        outcome = "done"
                        break
                    if not all(p.alive() for p in procs):
                        outcome = "daemon exited"
                        break
                    if now >= end:
                        outcome = "budget"
                        break
                    if v != last_v:
                        last_v, last_change = v, now
                    elif now - last_change > args.stall and not writer.is_alive():
                        outcome = "stalled"
                        break
                    if now - last_report > 15:
                        last_report = now
                        log.info("    %d/%d shards, %d/%d steps verified", v, total, st, args.steps)
                    time.sleep(0.25)
                t_cut = time.time()
                cpu1 = [_cpu_s(p.ps) if p.alive() else NAN for p in procs]
                out["cpu_window_s"] = time.monotonic() - t_cpu0
                out["pg_cpu_s"] = pg_cpu.seconds()
                writer.join(timeout=1)
                if writer.is_alive():
                    writer.terminate()
                    writer.join()
                time.sleep(_HOLD_S)  # a duplicate verification arriving late is still counted
                job_id = conn.execute(text("SELECT id FROM runs WHERE name = 'job'")).scalar()
                shard_rows = conn.execute(text(
                    "SELECT s.path, s.state, s.verified_at, s.node FROM shards s "
                    "JOIN checkpoints c ON s.checkpoint_id = c.id WHERE c.run_id = :r"), {"r": job_id}).all()
                step_rows = conn.execute(text("SELECT run_id, step, state, updated_at FROM checkpoints")).all()
                per_shard = conn.execute(text(
                    "SELECT e.shard_id, count(*) FROM verification_events e JOIN shards s ON s.id = e.shard_id "
                    "JOIN checkpoints c ON c.id = s.checkpoint_id WHERE c.run_id = :r AND e.kind = 'shard' "
                    "GROUP BY e.shard_id"), {"r": job_id}).all()
                twice = [sid for sid, c in per_shard if c > 1]
                dup_rows = conn.execute(text(
                    "SELECT s.path, s.node, e.kind, e.outcome, e.at, e.seconds, e.detail FROM verification_events e "
                    "JOIN shards s ON s.id = e.shard_id WHERE e.shard_id = ANY(:ids) ORDER BY s.path, e.at"),
                    {"ids": twice[:10]}).all() if twice else []
                step_events = conn.execute(text(
                    "SELECT count(*) FROM verification_events e JOIN checkpoints c ON c.id = e.checkpoint_id "
                    "WHERE c.run_id = :r AND e.kind = 'step'"), {"r": job_id}).scalar()
            out["verified_by"] = {p.name: p.verified_total() for p in procs}
        finally:
            if writer is not None and writer.is_alive():
                writer.terminate()
            for p in procs:
                p.stop()
            eng.dispose()
    problems = [ln for p in procs for ln in p.log_text().splitlines()
                if " WARNING " in ln or " ERROR " in ln or ln.startswith("Traceback")]
    out["log_problems"], out["log_sample"] = len(problems), problems[:3]
    renamed = read_renames(tsv)
    verified = {p: as_epoch(va) for p, st, va, _ in shard_rows if st == "verified"}
    owned: dict[str, int] = {}
    for _, _, _, node in shard_rows:
        owned[node or "(none)"] = owned.get(node or "(none)", 0) + 1
    out.update(
        outcome=outcome, written=len(renamed), verified=len(verified), rows=len(shard_rows),
        distinct_paths=len({p for p, _, _, _ in shard_rows}), owned_by=owned,
        steps_verified=sum(1 for rid, _, st, _ in step_rows if rid == job_id and st == "verified"),
        cpu_per_daemon_s=[b - a for a, b in zip(cpu0, cpu1)],
        shard_events=sum(c for _, c in per_shard), max_events_per_shard=max((c for _, c in per_shard), default=0),
        step_events=step_events,
    )
    # the evidence for any shard verified more than once (events do not name the verifying node)
    out["duplicates"] = [
        {"path": p, "owner": node, "kind": kind, "outcome": oc, "at": as_epoch(at), "seconds": sec, "detail": det}
        for p, node, kind, oc, at, sec, det in dup_rows
    ]
    out["cpu_s"] = sum(out["cpu_per_daemon_s"])
    out["cpu_ms_per_shard"] = 1000 * out["cpu_s"] / len(verified) if verified else NAN
    out["dup_ratio"] = out["shard_events"] / total if total else NAN
    out["wall_s"] = max(verified.values(), default=NAN) - min(renamed.values(), default=NAN)
    out["burst"] = latency_stats(renamed, verified, t_cut)
    return out


# --- report ----------------------------------------------------------------------------------


def _busy_loop() -> None:
    """A stand-in for a trainer sharing the node: one core, pure CPU, until terminated."""
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def _code_version() -> str:
    """The commit of the ckptd tree measured, and whether ckptd/ differs from it."""
    try:
        head = subprocess.run(["git", "-C", str(CODE_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(CODE_ROOT), "status", "--porcelain", "--", "ckptd"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"{CODE_ROOT} (not a git checkout)"
    return f"{head}" + (" + uncommitted changes in ckptd/" if dirty else "")


def machine_facts(backends: list[str]) -> dict[str, str]:
    import sqlalchemy
    import watchdog.version

    with open("/proc/cpuinfo") as fh:
        model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "?")
    facts = {
        "cpus": f"{os.cpu_count()} ({model})", "python": platform.python_version(), "sqlite": sqlite3.sqlite_version,
        "sqlalchemy": sqlalchemy.__version__, "watchdog": watchdog.version.VERSION_STRING, "os": platform.platform(),
    }
    if "postgresql" in backends:
        engine = create_engine(PG_ADMIN_URL)
        with engine.connect() as conn:
            facts["postgresql"] = conn.execute(text("SHOW server_version")).scalar()
        engine.dispose()
    facts["ckptd code"] = _code_version()
    facts["load average at start (1/5/15 min)"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return facts


def _f(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}"


def _lat(st: dict[str, Any]) -> str:
    return " / ".join(("≥ " if st[k + "_censored"] else "") + _f(st[k]) for k in ("p50", "p99", "max"))


def _ok(good: bool) -> str:
    return "✅" if good else "❌"


def render_ingest(args: argparse.Namespace, ingest: list[dict]) -> list[str]:
    total = args.ranks * args.steps
    live = [r for r in ingest if r["mode"] == "live"]
    lines: list[str] = []
    if live:
        lines += [
            "", "## Latency: rename → `verified`", "",
            (f"Daemon in-process, verify_workers={args.workers}, debounce 0.05 s, settle 2 s, rescan every "
            f"{args.rescan_interval:g} s, require_crc, replica_check=sample."),
            (f"- trickle: a {args.trickle_ranks}-rank run, {args.trickle_ranks * args.trickle_steps} shards one at a "
            f"time at {args.trickle_rate:g}/s (an idle daemon: the pipeline's own latency)"),
            (f"- burst: the {args.ranks}-rank job, all ranks of a step renamed at once, a step every "
            f"{args.step_interval:g} s, cut after {args.budget:g} s (≥: lower bound, shard unverified at the cut)"),
            "",
            ("| backend | case | verified / written | rename→verified p50 / p99 / max (s) | p99 < 1 s "
            "| step's last rename → step restorable p50 / max (s) |"),
            "|---|---|---|---|---|---|",
        ]
        for r in live:
            for case in ("trickle", "burst"):
                st = r[case]
                ok = st["p99"] < TARGET_P99_S and not st["p99_censored"]
                lines.append(
                    f"| {r['backend']} | {case} | {st['n'] - st['censored']}/{st['n']} | {_lat(st)} | {_ok(ok)} "
                    f"| {_f(st['step_p50'])} / {_f(st['step_max'])} |"
                )
    lines += [
        "",
        f"## Throughput: {args.ranks} ranks x {args.steps} steps = {total} shards, each run cut after {args.budget:g} s",
        "", "live: first rename → last `verified`; cold: daemon start → last `verified` (the tree existed before). "
        "Daemon CPU = this process's CPU time over the run / verified shards: a load-independent cost "
        "(1000 / it = shards/s one free core sustains).", "",
        ("| backend | mode | outcome | ingested / verified / written | steps restorable | ingest rows/s "
        "| verified shards/s | whole job at that rate (s) | daemon CPU ms/shard | daemon warnings |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ingest:
        est = total / r["shards_per_s"] if r["shards_per_s"] else NAN
        lines.append(
            f"| {r['backend']} | {r['mode']} | {r['outcome']} | {r['ingested']} / {r['verified']} / {r['written']} "
            f"| {r['steps_verified']}/{args.steps} | {r['ingest_per_s']:.1f} | {r['shards_per_s']:.1f} | {est:.0f} "
            f"| {r['cpu_ms_per_shard']:.2f} | {r['log_problems']} |"
        )
    for r in live:
        if r.get("rescan_seen"):
            per = r["rescan_s"] / r["rescan_seen"]
            lines.append(
                f"\nPeriodic rescan, {r['backend']}: {r['rescan_seen']} unchanged shards took {r['rescan_s']:.2f} s "
                f"= {per * 1000:.1f} ms/shard → ≈ {per * total:.0f} s for the {total}-shard job tree (extrapolated), "
                f"every {args.rescan_interval:g} s, on the single ingest thread."
            )
    return lines


def render_query(args: argparse.Namespace, query: list[dict]) -> list[str]:
    q0 = query[0]
    lines = [
        "", f"## latest_restorable at {q0['shard_rows']:,} shard rows", "",
        f"{q0['runs']} runs of 8-512 ranks, {q0['checkpoints']:,} checkpoints; {args.calls} ORM calls on random runs.",
        "",
        "| backend | populate (s) | fresh p50 / p99 / max (ms) | after ANALYZE p50 / p99 / max (ms) | p99 < 10 ms | plan |",
        "|---|---|---|---|---|---|",
    ]
    for q in query:
        fr, an = q["fresh"], q["analyzed"]
        same = re.sub(r" *\(cost=[^)]*\)", "", fr["plan"]) == re.sub(r" *\(cost=[^)]*\)", "", an["plan"])
        plan = an["plan"] if same else f"fresh: {fr['plan']}; analyzed: {an['plan']}"
        lines.append(
            f"| {q['backend']} | {q['populate_s']:.1f} | {_f(fr['p50_ms'])} / {_f(fr['p99_ms'])} / {_f(fr['max_ms'])} "
            f"| {_f(an['p50_ms'])} / {_f(an['p99_ms'])} / {_f(an['max_ms'])} "
            f"| {_ok(max(fr['p99_ms'], an['p99_ms']) < TARGET_QUERY_MS)} | `{plan}` |"
        )
    return lines


def _med(values: list[float]) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return NAN
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def render_shared(args: argparse.Namespace, shared: list[dict]) -> list[str]:
    total = args.ranks * args.steps
    lines = [
        "", f"## Several daemons on one shared root: {args.ranks} ranks x {args.steps} steps = {total} shards", "",
        ("Each daemon is a `ckptd serve` process with its own `CKPTD_NODE_NAME`, all on one root and one "
         f"fresh PostgreSQL database; verify_workers={args.workers}, require_crc, rescan every "
         f"{args.rescan_interval:g} s. paced: all ranks of a step renamed at once, a step every "
         f"{args.step_interval:g} s; flood: every step written back to back. Daemon CPU = user+sys of every daemon "
         "process (and children) from just before the writer starts to the last step `verified`; PostgreSQL CPU = "
         "its backends for the bench database over the same window. Verifications / shards = `verification_events` "
         f"of kind 'shard' over the job's shards, counted {_HOLD_S:g} s after the last step was verified (1.00 = "
         "no duplicate work); step checks / steps the same for step events. Idle daemon CPU: each daemon over "
         f"{_IDLE_S:g} s with nothing to do, just before the writer starts. verified by = each daemon's own "
         "`ckptd_shards_verified_total`; owned by = `shards.node` (the node that registered the row)."), "",
        ("| daemons | mode | rep | outcome | verified / written | steps | wall: first rename → last verified (s) "
         "| rename→verified p50 / p99 (s) | daemon CPU s (per daemon) | daemon CPU ms / verified shard "
         "| PostgreSQL CPU s | idle daemon CPU (ms/s) | shard verifications / shards (max per shard) "
         "| step checks / steps | verified by | owned by | warnings |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in shared:
        per = ", ".join(f"{c:.2f}" for c in r["cpu_per_daemon_s"])
        idle = ", ".join(f"{1000 * c:.0f}" for c in r["idle_cpu_per_s"])
        by = ", ".join(f"{k.removeprefix('bench-')}: {v}" for k, v in r["verified_by"].items())
        owned = ", ".join(f"{k.removeprefix('bench-')}: {v}" for k, v in sorted(r["owned_by"].items()))
        lines.append(
            f"| {r['daemons']} | {r['mode']} | {r['rep']} | {r['outcome']} | {r['verified']} / {r['written']} "
            f"| {r['steps_verified']}/{args.steps} | {_f(r['wall_s'])} | {_f(r['burst']['p50'])} / {_f(r['burst']['p99'])} "
            f"| {r['cpu_s']:.2f} ({per}) | {r['cpu_ms_per_shard']:.2f} | {_f(r['pg_cpu_s'])} | {idle} "
            f"| {r['shard_events']} / {r['shards']} = {r['dup_ratio']:.3f} ({r['max_events_per_shard']}) "
            f"| {r['step_events']} / {args.steps} | {by} | {owned} "
            f"| {r['log_problems']} |"
        )
    for r in shared:
        if not r["duplicates"]:
            continue
        by_path: dict[str, list[dict]] = {}
        for ev in r["duplicates"]:
            by_path.setdefault(ev["path"], []).append(ev)
        path, evs = next(iter(by_path.items()))
        gaps = [b["at"] - a["at"] for a, b in itertools.pairwise(evs)]
        lines.append(
            f"\n{r['daemons']} daemons, {r['mode']}, rep {r['rep']}: {r['shard_events'] - r['shards']} verification(s) "
            f"more than one per shard; e.g. `{os.path.relpath(path, str(Path(path).parents[2]))}` (owner "
            f"{evs[0]['owner']}): " + ", ".join(f"{e['kind']} {e['outcome']}" for e in evs)
            + f", {', '.join(f'{g * 1000:.0f} ms' for g in gaps)} apart."
        )
    base = min(r["daemons"] for r in shared)
    lines += ["", f"Medians over reps, each count against {base} daemon(s):", "",
              ("| mode | daemons | daemon CPU ms / shard | ratio | daemon + PostgreSQL CPU ms / shard | ratio "
               "| wall (s) | ratio | shard verifications / shards, each rep |"),
              "|---|---|---|---|---|---|---|---|---|"]

    def both(r: dict) -> float:
        return 1000 * (r["cpu_s"] + r["pg_cpu_s"]) / r["verified"] if r["verified"] else NAN

    def ms(r: dict) -> float:
        return r["cpu_ms_per_shard"]

    def wall(r: dict) -> float:
        return r["wall_s"]

    for mode in dict.fromkeys(r["mode"] for r in shared):
        rows = [r for r in shared if r["mode"] == mode and r["outcome"] == "done"]

        def med(n: int, key: Any, rows: list[dict] = rows) -> float:
            return _med([key(r) for r in rows if r["daemons"] == n])

        for n in sorted({r["daemons"] for r in rows}):
            dups = [f"{r['dup_ratio']:.3f}" for r in rows if r["daemons"] == n]
            lines.append(
                f"| {mode} | {n} | {_f(med(n, ms))} | {med(n, ms) / med(base, ms):.2f}x | {_f(med(n, both))} "
                f"| {med(n, both) / med(base, both):.2f}x | {_f(med(n, wall))} | {med(n, wall) / med(base, wall):.2f}x "
                f"| {', '.join(dups)} |"
            )
    return lines


def render(facts: dict[str, str], args: argparse.Namespace, ingest: list[dict], query: list[dict], wall: float,
           shared: list[dict] | None = None) -> str:
    lines = ["## Machine", "", *(f"- {k}: {v}" for k, v in facts.items())]
    if ingest:
        lines += render_ingest(args, ingest)
    if query:
        lines += render_query(args, query)
    if shared:
        lines += render_shared(args, shared)
    lines += ["", f"Total wall time: {wall:.0f} s. `python bench/ingest_verify.py {shlex.join(sys.argv[1:])}`"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=1_000_000, help="shard rows for the query benchmark (0 = skip it)")
    ap.add_argument("--runs", type=int, default=200, help="runs in the query catalog")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--modes", default="live,cold", help="ingest modes (empty: skip the ingest benchmark)")
    ap.add_argument("--budget", type=float, default=75.0, help="seconds a live burst / cold run may take")
    ap.add_argument("--step-interval", type=float, default=5.0, help="live burst: seconds between two steps")
    ap.add_argument("--trickle-ranks", type=int, default=4)
    ap.add_argument("--trickle-steps", type=int, default=25)
    ap.add_argument("--trickle-rate", type=float, default=5.0, help="trickle shards per second")
    ap.add_argument("--watch", default="auto",
                    help="Settings.watch_backend(s) to compare, e.g. inotify,watchdog (each gets its own run)")
    ap.add_argument("--cpu-hog", type=int, default=0, metavar="N",
                    help="run N busy-loop processes throughout (CPU taken by a trainer on the same node)")
    ap.add_argument("--workers", type=int, default=2, help="Settings.verify_workers")
    ap.add_argument("--rescan-interval", type=float, default=30.0)
    ap.add_argument("--stall", type=float, default=45.0, help="give up when nothing gets verified this long")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--log", help="write the daemon's warnings/errors with tracebacks to this file")
    ap.add_argument("--daemons", default="", metavar="N[,M...]",
                    help=("several daemons on one shared root: run these numbers of `ckptd serve` processes "
                          "(PostgreSQL), each against 1 daemon in the same run (`--daemons 2` = 1 and 2); "
                          "empty: skip"))
    ap.add_argument("--shared-modes", default="paced,flood", help="with --daemons: paced (--step-interval), flood")
    ap.add_argument("--repeat", type=int, default=1, help="with --daemons: alternating repetitions of each count")
    args = ap.parse_args(argv)
    counts = sorted({int(c) for c in args.daemons.split(",") if c.strip()})
    args.daemon_counts = sorted({1, *counts}) if counts else []
    args.shared_modes = [m for m in args.shared_modes.split(",") if m]
    if not set(args.shared_modes) <= {"paced", "flood"}:
        ap.error("--shared-modes: paced and/or flood")
    args.modes = [m for m in args.modes.split(",") if m]
    args.watch = [w for w in args.watch.split(",") if w]
    backends = [b for b in args.backends.split(",") if b]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    logging.getLogger("ckptd").setLevel(logging.DEBUG if os.environ.get("CKPTD_BENCH_DEBUG") else logging.WARNING)
    if args.log:
        handler = logging.FileHandler(args.log)
        handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger("ckptd").addHandler(handler)
        logging.getLogger("ckptd").propagate = False
    t_all = time.perf_counter()
    facts = machine_facts(backends + (["postgresql"] if args.daemon_counts and "postgresql" not in backends else []))
    hogs = [multiprocessing.get_context("spawn").Process(target=_busy_loop, daemon=True) for _ in range(args.cpu_hog)]
    for hog in hogs:
        hog.start()
    if hogs:
        facts["competing load"] = f"{len(hogs)} busy-loop process(es) for the whole run (a trainer on the same cores)"
    ingest: list[dict] = []
    query: list[dict] = []
    shared: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-bench-", dir="/tmp"))
    try:
        for backend in backends:
            for watch in args.watch:
                for mode in args.modes:
                    log.info("ingest %s %s (%s events) ...", backend, mode, watch)
                    ingest.append(run_ingest(backend, mode, args, tmp, watch))
                    log.info("  %s", {k: v for k, v in ingest[-1].items() if k != "log_sample"})
            if args.rows:
                log.info("query %s: populating %d shard rows ...", backend, args.rows)
                query.append(run_query_bench(backend, args, tmp))
                log.info("  %s", query[-1])
        for rep in range(1, args.repeat + 1 if args.daemon_counts else 1):
            for mode in args.shared_modes:
                for n in args.daemon_counts:  # alternating, so slow drift of the machine hits every count
                    log.info("shared root: %d daemon(s), %s, rep %d ...", n, mode, rep)
                    shared.append(run_shared(n, mode, rep, args, tmp))
                    log.info("  %s", {k: v for k, v in shared[-1].items() if k not in ("log_sample", "burst")})
    finally:
        for hog in hogs:
            hog.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    facts["load average at end (1/5/15 min)"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    print(render(facts, args, ingest, query, time.perf_counter() - t_all, shared))
    for r in ingest:
        for line in r["log_sample"]:
            print(f"{r['backend']}/{r['mode']} daemon log: {line}", file=sys.stderr)
    for r in shared:
        for line in r["log_sample"]:
            print(f"{r['daemons']} daemons/{r['mode']}/{r['rep']} daemon log: {line}", file=sys.stderr)
    if args.json:
        raw = {"facts": facts, "ingest": ingest, "query": query, "shared": shared}
        Path(args.json).write_text(json.dumps(raw, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
