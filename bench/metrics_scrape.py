"""What one /metrics scrape costs the catalog (issue 24): the catalog collector's reads, timed on a
synthetic catalog (bench/synthetic_catalog.py: runs x steps x ranks shard rows).

The families that existed before prometheus_client (shards by state, per node, node heartbeats,
RPO seconds) and the ones issue 24 added (RPO in steps: each run's newest restorable step and its
newest step, as GET /v1/runs and /steps read them; running conversions) are timed separately, then
the whole text exposition (``DaemonMetrics.render``) as the route produces it. ``list_runs`` (all
of GET /v1/runs) is timed for comparison: its shards per node made a scrape take seconds.

    python bench/metrics_scrape.py [--runs 40] [--steps 50] [--ranks 512] [--backends sqlite,postgresql]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import create_engine, text  # noqa: E402
from sqlalchemy.orm import sessionmaker  # noqa: E402

from bench.synthetic_catalog import fill  # noqa: E402
from ckptd.catalog import jobrows, nodes, reads  # noqa: E402
from ckptd.catalog.db import make_engine, upgrade  # noqa: E402
from ckptd.service import catalog  # noqa: E402
from ckptd.service.metrics import DaemonMetrics, Tallies  # noqa: E402

PG_ADMIN = os.environ.get("CKPTD_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _timed(fn, repeat: int) -> tuple[float, float]:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1000, max(samples) * 1000


def bench(name: str, url: str, args: argparse.Namespace) -> None:
    engine = make_engine(url)
    upgrade(engine)
    rows = fill(engine, runs=args.runs, steps=args.steps, ranks=args.ranks)
    sessions = sessionmaker(engine, expire_on_commit=False)
    metrics = DaemonMetrics(sessions, node="bench", node_timeout=120.0, tallies=lambda: Tallies(0, 0, 0, 0.0, 0, 0, 0, 0.0))

    def reads_of(fn):  # noqa: ANN001, ANN202
        def run():  # noqa: ANN202
            with sessions() as s:
                fn(s)
        return run

    def before(s) -> None:  # noqa: ANN001
        reads.shard_state_counts(s)
        nodes.shard_counts(s)
        nodes.statuses(s, 120.0)
        reads.latest_verified_at(s)

    def rpo_steps(s) -> None:  # noqa: ANN001
        for run in reads.runs(s):
            catalog.latest_restorable(s, run.id)
            catalog.list_steps(s, run.name, limit=1)

    def runs_listing(s) -> None:  # noqa: ANN001
        catalog.list_runs(s)

    cases = [
        ("before issue 24: shards, nodes, RPO seconds", reads_of(before)),
        ("added: RPO steps (latest_restorable, list_steps)", reads_of(rpo_steps)),
        ("(not used) GET /v1/runs' list_runs", reads_of(runs_listing)),
        ("added: running conversions", reads_of(lambda s: jobrows.jobs_in(s, "convert", ("running",)))),
        ("whole /metrics body (render)", metrics.render),
    ]
    print(f"{name}: {rows} shard rows ({args.runs} runs x {args.steps} steps x {args.ranks} ranks)")
    for label, fn in cases:
        fn()  # warm the caches
        p50, worst = _timed(fn, args.repeat)
        print(f"  {label:48s} median {p50:8.1f} ms   max {worst:8.1f} ms")
    engine.dispose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--backends", default="sqlite,postgresql")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}")
    for backend in args.backends.split(","):
        if backend == "sqlite":
            with tempfile.TemporaryDirectory() as tmp:
                bench("sqlite", f"sqlite:///{tmp}/catalog.db", args)
        else:
            db = f"metrics_bench_{uuid.uuid4().hex[:8]}"
            admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
            with admin.connect() as c:
                c.execute(text(f"CREATE DATABASE {db}"))
            try:
                bench("postgresql", PG_ADMIN.rsplit("/", 1)[0] + f"/{db}", args)
            finally:
                with admin.connect() as c:
                    c.execute(text(f"DROP DATABASE {db} WITH (FORCE)"))
                admin.dispose()
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
