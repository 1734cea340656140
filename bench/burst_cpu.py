"""Where a burst's CPU goes, per shard: ingest and verification of 512-rank steps, in one thread.

``bench/ingest_verify.py`` measures the burst end to end (rename -> ``verified`` p99), but there
the daemon's threads, the writer process and PostgreSQL share 2 cores, so its figures move with
the machine's load by 2x and say nothing about *which* work to cut. This script runs the same
work without the concurrency: the steps' tiny ``.ckpt`` shards (``ingest_verify.shard_bytes``)
are written first, then for each step the daemon's own ``Ingestor.examine_many`` registers them
and ``Verifier.verify_shards`` verifies them in the verifier's batches (128), step check
included, on this thread (the verifier's worker threads are stopped). Reported: CPU
milliseconds per shard (``time.process_time``) for ingest and for verification, and the wall time
of the catalog and file functions on the path, summed over the steps after the first (the first
warms caches and statement plans).

Run it side by side with another checkout of ckptd to compare two versions (alternate, several
times: the machine's speed varies)::

    python bench/burst_cpu.py [--code DIR] [--backend postgresql|sqlite] [--ranks 512] [--steps 4]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path


def _timed(totals: dict, owner: object, name: str) -> None:
    """Replace ``owner.name`` by a wrapper adding its wall time to ``totals`` (this script only)."""
    fn = getattr(owner, name)
    label = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label][0] += 1
            totals[label][1] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--code", default=str(Path(__file__).resolve().parents[1]), help="the ckptd checkout to run")
    ap.add_argument("--backend", default="postgresql", choices=["postgresql", "sqlite"])
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    sys.path[:0] = [args.code, os.path.join(args.code, "bench")]  # that checkout's ckptd and its writer
    from ingest_verify import write_job, write_strategy  # noqa: PLC0415 - after the path is set
    from sqlalchemy import create_engine, event, select, text  # noqa: PLC0415

    from ckptd.catalog import repo, verdicts  # noqa: PLC0415
    from ckptd.catalog.db import make_engine, upgrade  # noqa: PLC0415
    from ckptd.catalog.models import Shard  # noqa: PLC0415
    from ckptd.daemon import Daemon  # noqa: PLC0415
    from ckptd.service import ingest, stepjudge, verifier  # noqa: PLC0415
    from ckptd.settings import Settings  # noqa: PLC0415

    tmp = Path(tempfile.mkdtemp(prefix="ckptd-burst-cpu-", dir="/tmp"))
    admin = db_name = None
    try:
        root = tmp / "root"
        write_strategy(root / "job", args.ranks)
        write_job(str(root), "job", args.ranks, args.steps, 0.0, 0.0, str(tmp / "renames.tsv"), 0.0)
        if args.backend == "postgresql":
            base = os.environ.get("CKPTD_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
            db_name = "ckptd_burst_" + uuid.uuid4().hex[:8]
            admin = create_engine(base, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{db_name}"'))
            url = base.rsplit("/", 1)[0] + "/" + db_name
        else:
            url = f"sqlite:///{tmp / 'catalog.db'}"
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
        daemon = Daemon(Settings(root=root, db=url, require_crc=True, settle_seconds=0))
        daemon.verifier.close()  # its workers would verify the submitted shards concurrently
        totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
        for name in ("lock_checkpoint", "recompute_step_state", "register_shards"):
            _timed(totals, repo, name)
        for name in ("claim_verifications", "record_verifications"):
            _timed(totals, verdicts, name)
        _timed(totals, verifier, "verify_one")
        for name in ("check_step_if_due", "_verify_checkpoint"):
            _timed(totals, verifier.ShardVerifier, name)
        for name in ("ready", "check", "facts_plan"):
            _timed(totals, stepjudge.StepJudge, name)
        _timed(totals, ingest.Ingestor, "_ingest_checkpoint")
        _timed(totals, ingest.shardopen, "parse_error")
        cpu = {"ingest": 0.0, "verify": 0.0}
        # SQL statements per phase: a round trip costs CPU on both sides of the socket, so a count
        # that grows with the ranks (not the batches) is the first thing to cut
        phase = ["warm-up"]
        statements: collections.Counter = collections.Counter()

        def count(conn, cursor, statement, parameters, context, executemany):
            statements[(phase[0], " ".join(statement.split())[:90])] += 1

        event.listen(daemon.engine, "before_cursor_execute", count)
        for step in range(1, args.steps + 1):
            paths = [str(root / "job" / f"rank_{r}" / f"net-1_{step}.ckpt") for r in range(args.ranks)]
            if step == 2:
                for v in totals.values():
                    v[:] = [0, 0.0]
            phase[0] = "ingest" if step > 1 else "warm-up"
            t0 = time.process_time()
            daemon.ingestor.examine_many(paths)
            t1 = time.process_time()
            with daemon.sessions() as s:
                ids = list(s.execute(select(Shard.id).where(Shard.path.in_(paths)).order_by(Shard.id)).scalars())
            phase[0] = "verify" if step > 1 else "warm-up"
            t2 = time.process_time()
            for i in range(0, len(ids), 128):
                daemon.verifier.verify_shards(ids[i : i + 128])
            t3 = time.process_time()
            if step > 1:
                cpu["ingest"] += t1 - t0
                cpu["verify"] += t3 - t2
        n = args.ranks * (args.steps - 1)
        with daemon.sessions() as s:
            states = dict(s.execute(text("SELECT state, count(*) FROM checkpoints GROUP BY state")).all())
        daemon.engine.dispose()
        print(f"ckptd code: {args.code}; {args.backend}; {args.ranks} ranks x {args.steps} steps; steps {states}; "
              f"load {os.getloadavg()[0]:.2f}")
        print(f"CPU per shard: ingest {1e3 * cpu['ingest'] / n:.3f} ms, verification (step check included) "
              f"{1e3 * cpu['verify'] / n:.3f} ms, total {1e3 * sum(cpu.values()) / n:.3f} ms")
        print("| function | calls | wall ms per step |\n|---|---|---|")
        for label, (calls, secs) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
            print(f"| {label} | {calls} | {1e3 * secs / (args.steps - 1):.1f} |")
        for name in ("ingest", "verify"):
            mine = {k[1]: v for k, v in statements.items() if k[0] == name}
            print(f"\nSQL statements per step, {name}: {sum(mine.values()) / (args.steps - 1):.0f}")
            print("| statements per step | statement |\n|---|---|")
            for sql, c in sorted(mine.items(), key=lambda kv: -kv[1])[:12]:
                print(f"| {c / (args.steps - 1):.0f} | `{sql}` |")
    finally:
        if admin is not None:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)'))
            admin.dispose()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
