"""Part 7 of `make demo`: a 4-rank (tp2 x pp2) job in MindFormers' legacy layout, served by `ckptd serve`.

The files are what MindFormers 2.1.0's CheckpointMonitor writes, by the real
``mindspore.save_checkpoint`` (the tests' fixture generator, tests/mf_fixtures.MFJob: names
``checkpoint/rank_<r>/llama_rank_<r>-<epoch>_<step in epoch>.ckpt``, ``meta.json``, per-rank stage
strategy files ``strategy/ckpt_strategy_rank_<r>.ckpt``, MindFormers' appended entries). One shard of
the newest save is torn, the save after it misses a rank; ckptd answers the newest whole step, says
why it skipped the others, then answers a save written while it runs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUN = "llama-mf-pp"
# One epoch spans the whole run here, so the file names' step is the global step: ckptd's resume answer
# names a skipped save that never verified as a whole by its file names' step (in-epoch in MindFormers).


def _generator():
    """tests/mf_fixtures (one generator for the tests and the demo; it imports its sibling mf_stub)."""
    sys.path.insert(0, str(REPO / "tests"))
    import mf_fixtures
    import mindspore

    mindspore.set_device("CPU")  # set_context(device_target=) warns on MindSpore 2.10
    return mf_fixtures


def mindformers_pp_run(url: str, root: Path, env: dict[str, str], *, say: Callable[[str], None],
                       banner: Callable[[str], None], ckptd: Callable[..., int], get: Callable[[str], dict],
                       wait_until: Callable[..., None], fail: Callable[[str], int]) -> int:
    banner("7. A MindFormers-layout job of 4 ranks (tp=2 x pp=2, each rank's strategy file holds only its "
           "stage), served by ckptd serve")
    mf = _generator()
    job = mf.MFJob(root / RUN, tp=2, dp=1, pp=2)
    job.strategy_files()
    for step in (10, 20, 30):
        job.save(step)
    mf.tear(job.path(2, 30))  # a torn write under its final name (MindSpore renames without fsync)
    job.save(40, ranks=[0, 1, 3])  # rank 2 died before its save of step 40
    say("  wrote steps 10, 20, 30, 40 with mindspore.save_checkpoint; rank 2's step 30 torn, "
        "step 40 without rank 2:")
    for r in range(job.world):
        names = sorted(p.name for p in job.rank_dir(r).iterdir())
        say(f"    checkpoint/rank_{r}/  {'  '.join(names)}")
    say(f"    strategy/  {'  '.join(sorted(p.name for p in job.strategy_dir.iterdir()))}")
    resume_url = f"{url}/v1/runs/{RUN}/resume?lease=false"

    def judged() -> bool:  # step 20 answered once the torn and the incomplete step are judged too
        body = get(resume_url)
        done = {s["step"] for s in body.get("skipped", []) if not s["reason"].startswith("pending")}
        return body.get("global_step") == 20 and {30, 40} <= done

    wait_until(judged, f"ckptd to answer step 20 of {RUN}")
    ckptd("resume", "--run", RUN, "--no-lease", env=env, width=200)
    reasons = {s["step"]: s["reason"] for s in get(resume_url)["skipped"]}
    if not (reasons[30].startswith("corrupt") and reasons[40].startswith("incomplete")):
        return fail(f"steps 30 and 40 should be skipped as corrupt and incomplete: {reasons}")

    job.save(50)
    t0 = time.monotonic()
    say("\n  the job saved step 50 on every rank while ckptd runs:")
    wait_until(lambda: get(resume_url).get("global_step") == 50, f"ckptd to answer the live save of {RUN}",
               timeout=30, interval=0.05)
    say(f"  answered {time.monotonic() - t0:.2f} s after the last rank's file was renamed into place "
        f"(file events, not the rescan)")
    ckptd("resume", "--run", RUN, "--no-lease", env=env)
    return 0
