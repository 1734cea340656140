"""The object tier loop's upload query (``objrows.to_upload``) over a large SQLite catalog.

One run with ``--steps`` verified trained steps of ``--ranks`` shards each on node ``n1``; all but
the newest ``--pending`` are whole on the object tier, and ``--retired`` of the oldest were deleted
there by object retention (their copy rows ``deleted``, their files still on disk). Prints the
median time of one ``to_upload`` call (what every 0.5 s pass of the loop pays) with upload_every 1
and 10, and what it selected.

    .venv/bin/python -m bench.objtier_loop --steps 20000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from sqlalchemy import insert
from sqlalchemy.orm import sessionmaker

from ckptd.catalog import objrows
from ckptd.catalog.db import make_engine, upgrade
from ckptd.catalog.models import Checkpoint, Run, Shard, ShardCopy


def build(url: str, steps: int, ranks: int, pending: int, retired: int) -> None:
    engine = make_engine(url)
    upgrade(engine)
    with sessionmaker(engine).begin() as s:
        s.execute(insert(Run), [{"id": 1, "name": "job", "path": "/ck/job", "layout": "native"}])
        s.execute(insert(Checkpoint), [{"id": i, "run_id": 1, "prefix": "net", "epoch": 1, "step": i, "kind": "trained",
                                        "global_step": i, "state": "verified", "expected_ranks": ranks}
                                       for i in range(1, steps + 1)])
        s.execute(insert(Shard), [{"checkpoint_id": i, "rank": r, "path": f"/ck/job/rank_{r}/net-1_{i}.ckpt",
                                   "size": 1 << 20, "mtime_ns": 0, "inode": i * ranks + r, "digest": f"{i:032x}",
                                   "state": "verified", "node": "n1"}
                                  for i in range(1, steps + 1) for r in range(ranks)])
        s.execute(insert(ShardCopy), [{"checkpoint_id": i, "rank": r, "tier": "object",
                                       "location": f"s3://b/p/job/{i}/rank_{r}/net-1_{i}.ckpt",
                                       "state": "deleted" if i <= retired else "verified", "size": 1 << 20,
                                       "error": objrows.RETIRED if i <= retired else None,
                                       "digest": f"{i:032x}", "node": "n1"}
                                      for i in range(1, steps - pending + 1) for r in range(ranks)])
    engine.dispose()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--pending", type=int, default=3)
    ap.add_argument("--retired", type=int, default=15000)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        url = f"sqlite:///{Path(d) / 'cat.db'}"
        build(url, a.steps, a.ranks, a.pending, a.retired)
        engine = make_engine(url)
        sessions = sessionmaker(engine)
        for every in (1, 10):
            times = []
            for _ in range(a.repeat):
                with sessions() as s:
                    t = time.perf_counter()
                    due = objrows.to_upload(s, "n1", every)
                    times.append(time.perf_counter() - t)
            steps = [u.step for u in due]
            print(f"{a.steps} steps x {a.ranks} ranks, upload_every {every}: to_upload median "
                  f"{statistics.median(times) * 1e3:.1f} ms (min {min(times) * 1e3:.1f}); selected {len(due)} steps "
                  f"{steps[:5]}{'...' if len(steps) > 5 else ''}")
        engine.dispose()


if __name__ == "__main__":
    main()
