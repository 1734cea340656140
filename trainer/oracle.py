"""The trainer's view of the resume oracle: ckptd's client (:mod:`ckptd.launcher.oracle`, shared with
``ckptd launch``) plus the launcher's own fallback -- a scan of the run directory that reads the
trainer's shards to refuse a save of another layout (only ckptd re-shards)."""

from __future__ import annotations

import os

from ckptd import runlayout
from ckptd.launcher.oracle import (  # noqa: F401 -- re-exported: trainer.* and the tests import them from here
    OracleError,
    OracleUnavailable,
    ResumeAnswer,
    interpret_answer,
    ask_http,
    check_ready,
    wait_settled,
)
from trainer.scan_resume import committed_saves, committed_steps  # noqa: F401 -- the trainer's view of its saves


def ask_local_scan(run_dir: str, tp: int, dp: int) -> ResumeAnswer:
    """The stand-in oracle (:mod:`trainer.scan_resume`): the newest save on disk whose every rank's
    shard is committed and matches its ``.done`` sidecar (size + xxh3) -- the launcher's fallback when
    ckptd stays unreachable and ``--oracle-fallback scan`` says so.

    The scan knows nothing of layouts, so the answer is checked here: every shard must say it is
    that rank's at exactly this job's tp/dp (a save of another layout is never handed to the trainer:
    only ckptd can re-shard it); a shard that cannot be read without a key must at least have no
    rank beyond this world saving the same step."""
    from trainer.scan_resume import scan

    world = tp * dp
    answer = interpret_answer(scan(run_dir, world), world, "local scan")
    if answer.step is None:
        return answer
    for shard in answer.body["shards"]:  # type: ignore[index]
        rank, path = int(shard["rank"]), str(shard["path"])
        saved = _shard_layout(path)
        if saved is None:
            if _saved_by_more_ranks(run_dir, world, os.path.basename(path), rank):
                raise OracleError(f"local scan: step {answer.step} was saved by more than {world} ranks; "
                                  f"only ckptd can re-shard it")
            continue
        if saved != (rank, tp, dp):
            raise OracleError(f"local scan: {path} is rank {saved[0]}'s shard of tp={saved[1]},dp={saved[2]}, "
                              f"this job is rank {rank} of tp={tp},dp={dp}; only ckptd can re-shard it")
    return answer


def _shard_layout(path: str) -> tuple[int, int, int] | None:
    """(rank_id, tp, dp) a trainer shard holds, None when it cannot be read without a key."""
    from ckptd.errors import CkptdError
    from ckptd.format.checkpoint import open_checkpoint

    try:
        with open_checkpoint(path, key=None) as ck:
            return int(ck.value("rank_id")), int(ck.value("tp")), int(ck.value("dp"))
    except (CkptdError, OSError, KeyError, TypeError, ValueError):
        return None


def _saved_by_more_ranks(run_dir: str, world: int, name: str, rank: int) -> bool:
    parsed = runlayout.parse_shard_name(name, rank)
    if parsed is None:
        return False
    for other, d in runlayout.rank_dirs(run_dir).items():
        if other < world:
            continue
        try:
            names = os.listdir(d)
        except OSError:
            continue
        if any((p := runlayout.parse_shard_name(n, other)) is not None and p[:3] == parsed[:3] for n in names):
            return True
    return False
