"""Fill a migrated catalog with synthetic rows fast (SQL-side generation), for query benchmarks.

Shard paths live under /synthetic/… so a daemon watching a real root never reconciles them away.
Layout: ``runs`` runs x ``steps`` steps x ``ranks`` ranks; per run the newest step is pending and
the one before it corrupt, everything older verified — the resume oracle has to skip two steps.
"""

from __future__ import annotations

from sqlalchemy import Engine, text


def fill(engine: Engine, *, runs: int, steps: int, ranks: int) -> int:
    pg = engine.dialect.name == "postgresql"
    with engine.begin() as c:
        for r in range(runs):
            c.execute(text("INSERT INTO runs (name, path, world_size, created_at) VALUES (:n, :p, :w, CURRENT_TIMESTAMP)"),
                      {"n": f"run{r:03d}", "p": f"/synthetic/run{r:03d}", "w": ranks})
        series = "generate_series(1, :n)" if pg else "(WITH RECURSIVE g(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM g WHERE x < :n) SELECT x FROM g)"
        col = "x"
        c.execute(text(f"""
            INSERT INTO checkpoints (run_id, prefix, epoch, step, kind, layout, global_step, state, expected_ranks,
                                     step_checks_ok, pinned, marked_bad, created_at, updated_at)
            SELECT runs.id, 'llama', 1, s.{col} * 100, 'trained', '', s.{col} * 100,
                   CASE WHEN s.{col} = :n THEN 'pending' WHEN s.{col} = :n - 1 THEN 'corrupt' ELSE 'verified' END,
                   :ranks, CASE WHEN s.{col} < :n - 1 THEN {'true' if pg else '1'} END,
                   {'false' if pg else '0'}, {'false' if pg else '0'}, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP
            FROM runs CROSS JOIN {series} AS s{'(x)' if pg else ''}"""), {"n": steps, "ranks": ranks})
        rank_series = series.replace(":n", ":ranks")
        c.execute(text(f"""
            INSERT INTO shards (checkpoint_id, rank, path, size, mtime_ns, inode, digest, state, format, crc,
                                global_step, quarantined, seen_at)
            SELECT ck.id, k.{col} - 1, '/synthetic/' || runs.name || '/rank_' || (k.{col} - 1) || '/llama-1_' || ck.step || '.ckpt',
                   1048576, 0, 0, NULL, CASE WHEN ck.state = 'verified' THEN 'verified' ELSE 'complete' END, 'ckpt', 'valid',
                   ck.step, {'false' if pg else '0'}, CURRENT_TIMESTAMP
            FROM checkpoints ck JOIN runs ON runs.id = ck.run_id CROSS JOIN {rank_series} AS k{'(x)' if pg else ''}"""),
                  {"ranks": ranks})
        total = c.execute(text("SELECT count(*) FROM shards")).scalar_one()
    with engine.connect() as c:
        c.execute(text("ANALYZE"))
        c.commit()
    return int(total)
