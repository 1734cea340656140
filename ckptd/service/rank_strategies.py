"""Per-rank strategy files (MindFormers): each node reports the files it sees, the layout is their merge.

MindFormers makes every rank save ``<run>/strategy/<base>_rank_<r>.ckpt``; under pipeline
parallelism each holds only its stage. On node-local disks a node sees only its own ranks' files,
so the merge is computed from the catalog — the newest row of every per-rank path, whichever
node's daemon reported it — not from one directory listing. The merge (equal to
``mindspore.merge_pipeline_strategys``) is catalogued under the directory's path; steps are bound
to it. A rank no node has reported, or stages that disagree, make an invalid merge row whose
error says so (the steps then report it). :func:`current` is the strategy a new step of a run
is bound to.
"""

from __future__ import annotations

import logging
import os

from sqlalchemy.orm import Session

from ckptd import runlayout
from ckptd.catalog import repo, scanrows
from ckptd.catalog.models import Run, StrategyFile
from ckptd.errors import CkptdError
from ckptd.format.strategy import encode_strategy, parse_strategy_bytes
from ckptd.format.strategy_merge import load_rank_strategies, merge_rank_strategies
from ckptd.storage import PosixStorage

log = logging.getLogger("ckptd.ingest")


def ingest(s: Session, store: PosixStorage, run_name: str) -> Run:
    """Record this node's per-rank files of the run and re-merge (caller commits)."""
    run_path = os.path.join(store.root, run_name)
    directory = runlayout.rank_strategies_dir(run_path)
    run = repo.get_or_create_run(s, run_name, run_path)
    local_error = None
    try:
        store.check_dir(directory)  # strategy/ may not lead outside the root
        local = load_rank_strategies(directory)
    except CkptdError as err:  # a damaged or special file here, or a symlinked directory: said on the merge row
        local, local_error = {}, str(err)
    for strategy in local.values():
        path = strategy.source_path or directory
        st = store.stat(path)
        mtime_ns = None if st is None else st.st_mtime_ns
        repo.upsert_strategy(s, run, path, strategy.content_hash(), strategy.format, strategy.world_size,
                             strategy.stages, None, encode_strategy(strategy, strategy.format), mtime_ns)
    per_rank, mtime_ns = {}, 0
    for row in _newest_rank_rows(s, store.root, run):
        try:
            per_rank[_rank_of(store.root, row.path)] = parse_strategy_bytes(row.content or b"", row.path)
        except CkptdError as err:
            local_error = local_error or str(err)
            continue
        mtime_ns = max(mtime_ns, row.mtime_ns or 0)
    try:
        merged = merge_rank_strategies(per_rank, directory) if per_rank else None
        error = local_error if merged is not None else (local_error or "no per-rank strategy file is readable")
    except CkptdError as err:
        merged, error = None, str(err) + (f"; also: {local_error}" if local_error else "")
    if error is not None or merged is None:
        _record_invalid(s, run, directory, error or "unusable")
        return run
    repo.upsert_strategy(s, run, directory, merged.content_hash(), "proto", merged.world_size, merged.stages, None,
                         encode_strategy(merged), mtime_ns or None)
    run.world_size = merged.world_size
    return run


def _newest_rank_rows(s: Session, root: str, run: Run) -> list[StrategyFile]:
    rows = scanrows.valid_strategies(s, run.id)
    newest: dict[str, StrategyFile] = {}
    for row in rows:
        name = runlayout.classify(root, row.path)
        if isinstance(name, runlayout.StrategyName) and name.rank is not None and name.run == run.name:
            newest.setdefault(row.path, row)
    return list(newest.values())


def _rank_of(root: str, path: str) -> int:
    name = runlayout.classify(root, path)
    assert isinstance(name, runlayout.StrategyName) and name.rank is not None
    return name.rank


def _record_invalid(s: Session, run: Run, directory: str, error: str) -> None:
    fresh = not scanrows.strategy_error_recorded(s, run.id, directory, error)
    row = repo.upsert_strategy(s, run, directory, "invalid", "unknown", 0, 0, error, None, None)
    if row.error != error:
        row.error = error  # the latest reason (a rank file may be missing now, another before)
    if fresh:  # once per new reason, not at every rescan
        log.warning("per-rank strategy files of run %s are unusable: %s", run.name, error)


def current(s: Session, store: PosixStorage, run: Run) -> StrategyFile | None:
    """The newest valid strategy of the run's own directory: the merge of its per-rank files
    when it has them (MindFormers), else its strategy file. Conversions register the strategy
    of each copy they write for the run too; a new step is never bound to one."""
    rows = scanrows.valid_strategies(s, run.id, content=False)  # one query; the blobs are not needed here
    merged_at = runlayout.rank_strategies_dir(os.path.join(store.root, run.name))
    for row in rows:
        if row.path == merged_at:
            return row
    for row in rows:
        name = runlayout.classify(store.root, row.path)
        if isinstance(name, runlayout.StrategyName) and name.run == run.name and name.rank is None:
            return row
    return None
