"""MindFormers Checkpoint 2.0 (iteration directories) end to end: catalog, judge, resume, repair.

Directories come from MindFormers' own code: the committed samples its ``CheckpointMonitor`` and
``checkpoint.save_checkpoint`` wrote (tests/fixtures/mindformers/), live ``save_checkpoint`` runs, and
multi-rank iterations whose ``metadata.json``/``common.json`` MindFormers' functions wrote with the
safetensors files MindSpore wrote (tests/mf2_fixtures.py). Every daemon case runs on embedded SQLite
and on the real PostgreSQL.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ckptd.split import parse_split
from ckptd import runlayout
from ckptd.daemon import Daemon
from ckptd.errors import CorruptError
from ckptd.format import mf2
from ckptd.service import iteration, tracker
from ckptd.storage import PosixStorage
from tests.daemon_helpers import query, resume_answer, started_daemon, wait_for, wait_or_stop
from tests.mf2_fixtures import PREFIX, make_records, mindformers_checkpoint_path, mindformers_save, write_files, write_tracker
from tests.mf_fixtures import tear

FIXTURES = Path(__file__).parent / "fixtures" / "mindformers"


# --- pure rules -----------------------------------------------------------------------------------


@pytest.mark.parametrize("rel, want", [
    ("j/checkpoint/iteration_00000004/toy-model-0000000-0000001.safetensors", ("model", 2, 4)),
    ("j/checkpoint/iteration_00000004/toy-opt-0000000-0000001.safetensors", ("opt", 3, 4)),
    ("j/checkpoint/iteration_00000100/a-b-opt-0000003-0000004.safetensors", ("opt", 9, 100)),
    ("j/checkpoint/iteration_00000100/model-0000001-0000002.safetensors", ("model", 4, 100)),  # no user prefix
    ("j/checkpoint/iteration_00000006/common.json", ("common", 1, 6)),
    ("j/checkpoint/iteration_00000006/metadata.json", ("metadata", 0, 6)),
    ("j/checkpoint/iteration_123456789/common.json", ("common", 1, 123456789)),  # past 8 digits
    ("j/checkpoint/iteration_00000006/toy-model-0000002-0000002.safetensors", None),  # file number >= count
    ("j/checkpoint/iteration_00000006/toy-model-0000000-0000001.tmp", None),  # MindSpore's in-flight name
    ("j/checkpoint/iteration_6/common.json", None),  # not MindFormers' directory name
    ("j/checkpoint/iteration_00000006/other.json", None),
])
def test_iteration_paths_are_classified(rel, want):
    got = runlayout.classify("/R", "/R/" + rel)
    assert (None if got is None else (got.role, got.rank, got.step)) == want
    if got is not None:
        assert (got.layout, got.prefix, got.epoch) == (runlayout.CKPT2, runlayout.ITERATION_PREFIX, 0)
        assert runlayout.slot_role(got.rank)[0] == got.role


def test_tracker_path_and_layout_detection(tmp_path):
    assert runlayout.classify("/R", "/R/j/checkpoint/latest_checkpointed_iteration.txt") == runlayout.TrackerName("j")
    (tmp_path / "j" / "checkpoint" / "iteration_00000002").mkdir(parents=True)
    assert runlayout.detect_layout(str(tmp_path / "j")) == runlayout.CKPT2
    assert runlayout.rank_dirs(str(tmp_path / "j")) == {}


@pytest.mark.parametrize("names, need", [
    # a single-rank save is a model + optimizer pair (MindFormers' own check passes without the optimizer)
    ({"common.json", "toy-model-0000000-0000001.safetensors"},
     {"common.json", "toy-model-0000000-0000001.safetensors", "toy-opt-0000000-0000001.safetensors"}),
    ({"toy-opt-0000000-0000001.safetensors"},
     {"common.json", "toy-model-0000000-0000001.safetensors", "toy-opt-0000000-0000001.safetensors"}),
    # several files: every number up to the count on each side, and a metadata.json
    ({"x-model-0000001-0000002.safetensors", "x-opt-0000000-0000001.safetensors"},
     {"common.json", "metadata.json", "x-model-0000000-0000002.safetensors", "x-model-0000001-0000002.safetensors",
      "x-opt-0000000-0000001.safetensors"}),
    ({"metadata.json", "model-0000000-0000001.safetensors"},  # no optimizer side named yet: metadata.json decides
     {"common.json", "metadata.json", "model-0000000-0000001.safetensors"}),
])
def test_required_files_from_names(names, need):
    assert iteration.required_by_names(names) == need


@pytest.mark.parametrize("raw, want", [
    (b"6", 6), (b"20\n", 20), (b"", "empty"), (b"  ", "empty"), (b"2\x00", "not an iteration"),
    (b"-1", "not an iteration"), (b"12345678901234567890", "not an iteration"),
])
def test_tracker_text(raw, want):
    got = mf2.parse_tracker(raw)
    assert got == want if isinstance(want, int) else got.startswith(want)


@pytest.mark.parametrize("raw, message", [
    (b'{"state_dict_metadata": {}, "storage_data": {"(\'w\', (0,))": [{"file_name": "a-model-0000000-0000001.'
     b'safetensors", "storage_rank": 0}]}}', "places tensor 'w', which state_dict_metadata does not describe"),
    (b'{"state_dict_metadata": {"w": {"properties": {"dtype": "Float32"}}}, "storage_data": {"(\'w\', (0,))": '
     b'[{"file_name": "../x", "storage_rank": 0}]}}', "a record without a plain file_name"),
    (b'{"state_dict_metadata": {}, "storage_data": {"w": []}}', "the key is not"),
    (b'{"state_dict_metadata": [], "storage_data": {}}', "no state_dict_metadata"),
    (b'{"state_dict_metadata": {}, "storage_data": {}', "not valid JSON"),
])
def test_lying_or_torn_metadata_is_named(raw, message):
    with pytest.raises(CorruptError, match=message):
        mf2.parse_metadata(raw, "/r/metadata.json")


def test_common_json_fields():
    info = mf2.parse_common((FIXTURES / "ckpt2" / "iteration_00000006" / "common.json").read_bytes(), "c")
    assert (info.step_num, info.global_step, info.ckpt_status, info.names_iteration(6)) == (6, 6, None, True)
    with pytest.raises(CorruptError, match="step_num is 'x'"):
        mf2.parse_common(b'{"step_num": "x"}', "c")


# --- the daemon on real trees --------------------------------------------------------------------


def _states(url: str, run: str) -> dict[int, tuple[str, str | None]]:
    rows = query(url, "SELECT c.step, c.state, c.reason FROM checkpoints c JOIN runs r ON r.id = c.run_id "
                      "WHERE r.name = :run AND c.kind = 'trained'", run=run)
    return {step: (state, reason) for step, state, reason in rows}


def _settle(root: Path, url: str, want: dict[str, dict[int, str]], timeout: float = 60) -> Daemon:
    d = started_daemon(root, url)

    on_disk = {str(p) for p in root.rglob("*") if isinstance(runlayout.classify(str(root), str(p)), runlayout.ShardName)}

    def check():  # every file catalogued (a file just written waits settle_seconds) and the states reached
        d.verifier.drain(timeout=10)
        got = {run: {k: v[0] for k, v in _states(url, run).items()} for run in want}
        seen = {p for (p,) in query(url, "SELECT path FROM shards WHERE state <> 'deleted'")}
        return got if got == want and seen == on_disk else None

    return wait_or_stop(d, check, timeout, f"states {want}")


def _copy_sample(name: str, root: Path, run: str) -> Path:
    dest = root / run / "checkpoint"
    shutil.copytree(FIXTURES / name, dest)
    return dest


def test_single_rank_runs_written_by_mindformers(root, catalog_url):
    """The committed samples (CheckpointMonitor; async save whose optimizer file is gone; keep 1) and
    a live MindFormers save_checkpoint run with rotation: the newest whole iteration, and why not others."""
    _copy_sample("ckpt2", root, "monitor")
    _copy_sample("ckpt2_async", root, "async")  # iteration 20 lost its optimizer file: MindFormers still takes it
    mindformers_save(root / "live" / "checkpoint", [2, 4, 6, 8], keep_max=3)
    d = _settle(root, catalog_url, {"monitor": {4: "verified", 6: "verified"}, "async": {10: "verified", 20: "incomplete"},
                                    "live": {4: "verified", 6: "verified", 8: "verified"}})
    d.stop()
    monitor = resume_answer(catalog_url, "monitor")
    assert (monitor["step"], monitor["global_step"], monitor["layout"], monitor["world_size"]) == (6, 6, "mindformers2", None)
    assert {s["role"] for s in monitor["shards"]} == {"model", "opt", "common"}
    assert monitor["mindformers"]["load_checkpoint"] == str(root / "monitor" / "checkpoint" / "iteration_00000006")
    assert monitor["mindformers"]["tracker"]["agrees"] is True
    answer = resume_answer(catalog_url, "async")
    assert answer["step"] == 10
    assert answer["skipped"] == [{"step": 20, "reason": "incomplete: missing toy-opt-0000000-0000001.safetensors"}]
    assert answer["mindformers"]["tracker"]["iteration"] == 20 and not answer["mindformers"]["tracker"]["agrees"]
    assert resume_answer(catalog_url, "live")["step"] == 8
    # MindFormers' own answer for the async run: the iteration without its optimizer state
    got = mindformers_checkpoint_path([root / "async" / "checkpoint"])[0]
    assert got["path"] == str(root / "async" / "checkpoint" / "iteration_00000020")


def test_sharded_iterations_with_every_defect(ms, root, catalog_url):
    """A dp2 x tp2 job: plain and balanced (remove_redundancy) saves are whole; a missing optimizer
    file, a torn file, metadata.json naming a file that is not there, a file lacking a tensor
    metadata.json places in it, a common.json of another save and a save in flight are not; an
    abnormal ckpt_status is skipped as unhealthy. The tracker names the newest, unfinished one."""
    ckpt = root / "job" / "checkpoint"
    its = {"plain": 100, "balanced": 200, "abnormal": 250, "no_opt": 300, "torn": 400, "ghost": 500, "lacks": 600,
           "other_common": 700, "in_flight": 800}
    make_records(ckpt, plain=[v for k, v in its.items() if k != "balanced"], balanced=[its["balanced"]],
                 common={its["abnormal"]: {"ckpt_status": 1}, its["other_common"]: {"step_num": 699, "global_step": 699}})
    files = {}
    for name, it in its.items():
        skip = {f"{PREFIX}-model-0000001-0000004.safetensors": {"fc2.bias"}} if name == "lacks" else None
        files[name] = write_files(ms, ckpt / f"iteration_{it:08d}", it, skip=skip)
    (files["no_opt"][f"{PREFIX}-opt-0000003-0000004.safetensors"]).unlink()
    tear(files["torn"][f"{PREFIX}-model-0000002-0000004.safetensors"])
    meta = ckpt / f"iteration_{its['ghost']:08d}" / "metadata.json"
    meta.write_text(meta.read_text().replace(f"{PREFIX}-model-0000003-0000004", f"{PREFIX}-model-0000003-0000005"))
    flying = files["in_flight"][f"{PREFIX}-opt-0000001-0000004.safetensors"]
    flying.rename(flying.with_suffix(".tmp"))  # MindSpore's <stem>.tmp before its rename
    write_tracker(ckpt, str(its["in_flight"]))
    d = _settle(root, catalog_url, {"job": {100: "verified", 200: "verified", 250: "verified", 300: "incomplete",
                                            400: "corrupt", 500: "incomplete", 600: "corrupt", 700: "corrupt",
                                            800: "incomplete"}})
    d.stop()
    reasons = {k: v[1] for k, v in _states(catalog_url, "job").items()}
    assert reasons[300] == f"missing {PREFIX}-opt-0000003-0000004.safetensors"
    assert f"missing {PREFIX}-model-0000003-0000005.safetensors" in reasons[500]
    assert f"{PREFIX}-model-0000001-0000004.safetensors lacks 'fc2.bias'" in reasons[600]
    assert "not iteration 700" in reasons[700]
    assert "a save is still being written" in reasons[800] and f"{PREFIX}-opt-0000001-0000004.tmp" in reasons[800]
    answer = resume_answer(catalog_url, "job")
    assert answer["step"] == 200  # balanced: each slice once, files numbered by MindFormers' plan
    assert {os.path.basename(s["path"]) for s in answer["shards"] if s["role"] in ("model", "opt")} == set(files["balanced"])
    skipped = {s["step"]: s["reason"] for s in answer["skipped"]}
    assert skipped[250].startswith("unhealthy: common.json: ckpt_status=1")
    assert skipped[400].startswith("corrupt: rank 6: ") and f"{PREFIX}-model-0000002-0000004.safetensors" in skipped[400]
    assert answer["mindformers"]["tracker"]["iteration"] == 800
    assert "incomplete" in answer["mindformers"]["tracker"]["note"]


def test_tracker_repair_is_atomic_refuses_the_unverified_and_satisfies_mindformers(root, catalog_url):
    """Empty, torn, dangling trackers: the answer says so; --repair-tracker (dry run first) leaves one
    that MindFormers' own get_checkpoint_path resolves to the answered iteration."""
    for run, text in (("empty", ""), ("torn", "1\x00"), ("dangling", "10")):
        _copy_sample("ckpt2_async_keep1", root, run)
        write_tracker(root / run / "checkpoint", text)
    d = _settle(root, catalog_url, {run: {20: "verified"} for run in ("empty", "torn", "dangling")})
    d.stop()
    notes = {run: resume_answer(catalog_url, run)["mindformers"]["tracker"]["note"] for run in ("empty", "torn", "dangling")}
    assert notes["empty"].startswith("unusable: empty") and notes["torn"].startswith("unusable: not an iteration")
    assert "names iteration 10, which does not exist" in notes["dangling"]
    before = mindformers_checkpoint_path([root / run / "checkpoint" for run in ("empty", "dangling")])
    assert all(r["error"] for r in before)  # MindFormers' launch fails on both
    run_path = str(root / "dangling")
    dry = tracker.repair(PosixStorage(str(root)), run_path, 20, verified=True, dry_run=True)
    assert (dry["before"], dry["after"], dry["written"]) == (10, 20, False)
    assert (root / "dangling" / "checkpoint" / "latest_checkpointed_iteration.txt").read_text() == "10"
    with pytest.raises(Exception, match="not verified"):
        tracker.repair(PosixStorage(str(root)), run_path, 20, verified=False)
    with pytest.raises(Exception, match="not a real directory"):
        tracker.repair(PosixStorage(str(root)), run_path, 30, verified=True)
    import subprocess
    import sys

    cli = subprocess.run([sys.executable, "-m", "ckptd", "resume", "--run", "empty", "--db", catalog_url, "--no-lease",
                          "--repair-tracker"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert "rewrote empty (a torn write" in cli.stdout and "-> 20 (temp file, fsync, rename, fsync dir)" in cli.stdout
    for run in ("torn", "dangling"):
        assert tracker.repair(PosixStorage(str(root)), str(root / run), 20, verified=True)["written"]
    for run in ("empty", "torn", "dangling"):
        path = root / run / "checkpoint" / "latest_checkpointed_iteration.txt"
        assert path.read_text() == "20" and oct(path.stat().st_mode & 0o777) == "0o640"
        assert not [p for p in path.parent.iterdir() if p.name.endswith(".ckptd-tmp")]
    after = mindformers_checkpoint_path([root / run / "checkpoint" for run in ("empty", "torn", "dangling")])
    assert [r["path"] for r in after] == [str(root / run / "checkpoint" / "iteration_00000020")
                                         for run in ("empty", "torn", "dangling")]
    os.unlink(root / "torn" / "checkpoint" / "latest_checkpointed_iteration.txt")
    os.symlink("/etc/hostname", root / "torn" / "checkpoint" / "latest_checkpointed_iteration.txt")
    with pytest.raises(Exception, match="not a regular file"):
        tracker.repair(PosixStorage(str(root)), str(root / "torn"), 20, verified=True)
    assert os.path.islink(root / "torn" / "checkpoint" / "latest_checkpointed_iteration.txt")


def test_retention_removes_whole_iteration_directories_across_incarnations(root, catalog_url):
    """MindFormers' rotation forgets the directories of earlier launches; ckptd's gc keeps the newest
    restorable ones and removes the others as directories, with the same two-phase protocol."""
    from ckptd.policy import RetentionPolicy
    from ckptd.service.retention import gc

    ckpt = root / "job" / "checkpoint"
    mindformers_save(ckpt, [2, 4, 6], keep_max=5)  # an earlier launch
    mindformers_save(ckpt, [8, 10], keep_max=5)  # the next one: its rotation would never see 2..6
    d = _settle(root, catalog_url, {"job": {2: "verified", 4: "verified", 6: "verified", 8: "verified", 10: "verified"}})
    try:
        report = gc(d.sessions, PosixStorage(str(root)), RetentionPolicy(keep_last=2), run_name="job").to_dict()
    finally:
        d.stop()
    assert sorted(p.name for p in ckpt.iterdir()) == ["iteration_00000008", "iteration_00000010",
                                                       "latest_checkpointed_iteration.txt"]
    assert report["deleted_files"] == 9 and not report["refused"]
    assert sorted(_states(catalog_url, "job")) == [8, 10]


@pytest.mark.parametrize("catalog_url", ["postgresql"], indirect=True)
def test_serve_picks_up_a_new_iteration_and_follows_a_resave(root, tmp_path, catalog_url):
    """``ckptd serve`` over real HTTP: a new iteration MindFormers saves while it runs is answered within
    seconds of its tracker update; an iteration re-saved in place (rank 0 rmtrees and rewrites it)
    is never answered half-written and is answered again once whole."""
    import time

    from tests.api_helpers import resume_of, serve_process

    ckpt = _copy_sample("ckpt2", root, "job")
    log = tmp_path / "serve.log"
    proc, client = serve_process(root, catalog_url, log)
    seen: list[int] = []

    def answer(step: int):
        body = resume_of(proc, client, log, "job")
        if body is not None:
            seen.append(body["step"])
        return body if body is not None and body["step"] == step else None

    try:
        wait_for(lambda: answer(6), 60, interval=0.2, what="iteration 6 answered")
        mindformers_save(ckpt, [8])  # MindFormers' own save: files, common.json, then the tracker
        t0 = time.monotonic()
        body = wait_for(lambda: answer(8), 30, interval=0.1, what="iteration 8 answered")
        print(f"iteration 8 answered {time.monotonic() - t0:.2f} s after MindFormers' save returned")
        assert body["mindformers"]["tracker"] == {"path": str(ckpt / "latest_checkpointed_iteration.txt"), "iteration": 8,
                                                  "agrees": True, "note": "names the answered iteration"}
        first = {s["path"]: s for s in client.get("/v1/runs/job/steps/8/shards").json()}
        seen.clear()
        mindformers_save(ckpt, [8])  # the same iteration again: rank 0 rmtrees the directory and rewrites it
        wait_for(lambda: (r := answer(8)) and {s["path"] for s in r["shards"]} == set(first) and all(
            s["verified_at"] != first[s["path"]]["verified_at"]
            for s in client.get("/v1/runs/job/steps/8/shards").json() if s["state"] == "verified") and r, 30,
            interval=0.1, what="the re-saved iteration 8 verified again")
        assert set(seen) <= {6, 8}  # never an error, never another step
    finally:
        client.close()
        proc.terminate()
        proc.wait(30)


def test_convert_iterations_to_legacy_files(ms, root, tmp_path, catalog_url):
    """A verified 2.0 iteration (plain and balanced dp2 x tp2, from the catalog; single-rank, from its
    directory) re-sharded into legacy per-rank .ckpt files: every tensor equals the slice of the full
    tensor MindFormers' metadata.json says it is, bit for bit, and each file loads in MindSpore."""
    import subprocess
    import sys

    import numpy as np

    from ckptd.service.conversions import convert_step
    from tests.mf2_fixtures import PARAMS, global_tensor

    ckpt = root / "job" / "checkpoint"
    make_records(ckpt, plain=[100], balanced=[200])
    for it in (100, 200):
        write_files(ms, ckpt / f"iteration_{it:08d}", it)
    d = _settle(root, catalog_url, {"job": {100: "verified", 200: "verified"}})
    try:
        docs = {it: convert_step(d.sessions, PosixStorage(str(root)), "job", it, split=parse_split(layout))
                for it, layout in ((100, "tp=1,dp=1"), (200, "tp=2,dp=1"))}
    finally:
        d.stop()
    shapes = {name: shape for name, _, shape in PARAMS}
    for it, tp in ((100, 1), (200, 2)):
        out = Path(docs[it]["out_dir"])
        for rank in range(tp):
            (path,) = (out / f"rank_{rank}").iterdir()
            got = {k: v.asnumpy() for k, v in ms.load_checkpoint(str(path)).items()}
            assert set(got) == set(shapes)
            for name, split, shape in PARAMS:
                full = global_tensor(name, shape, it)
                want = full if tp == 1 or split == "rep" else np.split(full, tp, axis=1 if split == "tp_cols" else 0)[rank]
                assert got[name].tobytes() == want.tobytes(), (it, rank, name)
    single = _copy_sample("ckpt2", root, "single") / "iteration_00000006"
    proc = subprocess.run([sys.executable, "-m", "ckptd", "convert", "--src", str(single), "--to-strategy", "none",
                           "--out", str(tmp_path / "single_out")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (path,) = (tmp_path / "single_out" / "rank_0").iterdir()
    got = {k: v.asnumpy() for k, v in ms.load_checkpoint(str(path)).items()}
    want = {}
    for f in sorted(single.glob("*.safetensors")):
        want.update({k: v.asnumpy() for k, v in ms.load_checkpoint(str(f), format="safetensors").items()})
    assert set(got) == set(want) and all(got[k].tobytes() == want[k].tobytes() for k in want)
