"""``ckptd launch`` + the MindSpore callback on a job that is not ckptd's trainer (issue 14).

The job (tests/fixtures/ms_user_job.py) is plain ``Model.train`` (PyNative; Graph mode after a
resume) with ``ModelCheckpoint(async_save=True, integrated_save=False, keep_checkpoint_max=3)`` and
``CkptdCallback``, run by ``msrun`` with 2 ranks
(data parallel), supervised by ``ckptd launch`` asking a real ``ckptd serve`` over HTTP. One launcher
run takes three faults, from outside: a rank SIGKILLed while training, a rank SIGKILLed while its
async save is half written, a rank SIGSTOPped (hung: only its heartbeats tell). Each time the
launcher stops the job, asks ckptd and resumes -- and every loss after every resume equals an
uninterrupted run's bit for bit, as do the final checkpoints.

The other cases need no MindSpore: templates refused before anything starts, and the command
built for MindFormers' run_mindformer.py from a MindFormers-layout answer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from ckptd.convert.layouts import derive_strategy
from ckptd.format.strategy import load_strategy
from ckptd.launcher import template
from ckptd.launcher.command import world_from_command
from ckptd.launcher.supervise import free_port
from tests import trainer_helpers as th
from tests.daemon_helpers import FULL_W, query, rank_tensors, save_shard, wait_for, write_tp_strategy

JOB = os.path.join(th.REPO, "tests", "fixtures", "ms_user_job.py")
STEPS_PER_EPOCH, EPOCHS = 6, 3
#: resumed attempts run in Graph mode (the first attempt and the reference in PyNative: on CPU this
#: network's losses are bit-identical in both), and check the step the template carried
RESUME_ARGS = "--mode graph --expect-step {global_step}"
#: the job does nothing after Model.train, whose end waits for the last async save (and the callback
#: for its sidecar): its seconds of MindSpore teardown need not be waited for
FAST_EXIT = ("--exit-grace", "1")


def env() -> dict[str, str]:
    e = th.env()
    # msrun starts workers as plain "python": this interpreter
    e["PATH"] = os.path.dirname(sys.executable) + os.pathsep + e.get("PATH", "")
    return e


def launch_cmd(run_dir: Path, *launch_args: str, job_args: tuple[str, ...] = ()) -> list[str]:
    """``ckptd launch ... -- msrun ... ms_user_job.py``; the launcher appends ``--resume-args`` after ``job_args``."""
    msrun = os.path.join(os.path.dirname(sys.executable), "msrun")
    return [sys.executable, "-m", "ckptd", "launch", "--run-dir", str(run_dir), *launch_args, "--",
            msrun, "--worker_num=2", "--local_worker_num=2", f"--master_port={free_port()}",
            f"--log_dir={run_dir / 'msrun_logs'}", "--join=True", JOB, "--run-dir", str(run_dir), *job_args]


def losses(run_dir: Path) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for line in (run_dir / "losses.jsonl").read_text().splitlines():
        d = json.loads(line)
        out.setdefault(d["step"], set()).add(d["loss_hex"])
    return out


def global_step(name: str) -> int | None:
    """``net[_k]-<epoch>_<step>.ckpt`` -> the global step (ModelCheckpoint counts steps within the epoch)."""
    m = re.match(r"^net(?:_\d+)?-(\d+)_(\d+)\.ckpt$", name)
    return (int(m.group(1)) - 1) * STEPS_PER_EPOCH + int(m.group(2)) if m else None


def committed(run_dir: Path, rank: int) -> list[int]:
    """Global steps of ``rank``'s shards that have their .done hint (written by the callback)."""
    d = run_dir / f"rank_{rank}"
    names = set(os.listdir(d)) if d.is_dir() else set()
    return sorted(s for n in names if n + ".done" in names and (s := global_step(n)) is not None)


def both_committed(run_dir: Path) -> set[int]:
    """The global steps both ranks have committed: what a resume may start from."""
    return set(committed(run_dir, 0)) & set(committed(run_dir, 1))


def heartbeat(run_dir: Path, rank: int) -> dict | None:
    try:
        return json.loads((run_dir / "heartbeat" / f"rank_{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def attempt_at(run_dir: Path, rank: int, attempt: int, step: int) -> dict | None:
    hb = heartbeat(run_dir, rank)
    return hb if hb and hb["attempt"] == attempt and hb["step"] >= step and hb["phase"] != "starting" else None


class Serve:
    def __init__(self, base: Path, world_size: str | None = "2", extra_args: tuple[str, ...] = ()) -> None:
        self.root = base / "root"
        self.root.mkdir(parents=True)
        self.url = f"http://127.0.0.1:{free_port()}"
        self.db = db = f"sqlite:///{base / 'catalog.db'}"
        subprocess.run([sys.executable, "-m", "ckptd", "db", "upgrade", "--db", db], cwd=th.REPO, env=th.env(),
                       check=True, capture_output=True)
        e = dict(th.env(), CKPTD_SETTLE_SECONDS="0.2", CKPTD_RESCAN_INTERVAL="1")
        if world_size is not None:  # data parallel without a strategy file: ckptd learns the world size from here
            e["CKPTD_WORLD_SIZE"] = world_size
        self.log = open(base / "ckptd.log", "wb")  # noqa: SIM115 -- for the server's lifetime
        self.proc = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", str(self.root), "--port",
                                      self.url.rsplit(":", 1)[1], "--db", db, *extra_args], cwd=th.REPO, env=e,
                                     stdout=self.log, stderr=subprocess.STDOUT)

    def up(self) -> bool:
        assert self.proc.poll() is None, f"ckptd serve exited {self.proc.returncode}"
        try:
            r = httpx.get(f"{self.url}/healthz", timeout=2)
            return r.status_code == 200 and bool(r.json().get("first_rescan_done"))
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.mark.slow
def test_user_job_resumes_bit_exact_after_kill_kill_during_async_save_and_hang(tmp_path):
    serve = Serve(tmp_path / "ckptd")
    try:
        wait_for(serve.up, timeout=60, interval=0.2, what="ckptd serve to come up")
        ref_dir = tmp_path / "ref"  # the same job, uninterrupted, no ckptd
        # its ranks work 4 s after Model.train (past --exit-grace 1): waited for, never killed
        ref = subprocess.run(launch_cmd(ref_dir, "--fresh", "--max-restarts", "0", *FAST_EXIT,
                                        job_args=("--after-train", "4")), cwd=th.REPO, env=env(),
                             capture_output=True, text=True, timeout=300, check=False)
        assert ref.returncode == 0, ref.stderr[-3000:]
        assert "attempt=0 event=finishing" in ref.stderr and "attempt=0 event=finished" in ref.stderr, ref.stderr[-3000:]
        assert all((ref_dir / f"after_train_{r}").read_text() == "done\n" for r in range(2))

        run_dir = serve.root / "userjob"
        # attempt 1 holds rank 1's async write of epoch 2's step 6 (global step 12) half done
        e = dict(env(), HOLD_SAVE="1:1:2_6")
        launcher = subprocess.Popen(
            launch_cmd(run_dir, "--ckptd-url", serve.url, "--heartbeat-timeout", "4", "--backoff", "0.1",
                       "--max-restarts", "3", "--resume-args", RESUME_ARGS, *FAST_EXIT,
                       job_args=("--step-sleep", "0.1")),
            cwd=th.REPO, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        expected = []
        try:
            # 1. SIGKILL rank 1 while it trains, once its step-4 save is committed
            hb = wait_for(lambda: attempt_at(run_dir, 1, 0, 5) if 4 in both_committed(run_dir) else None,
                          timeout=240, what="attempt 0 training past its first save")
            os.kill(hb["pid"], signal.SIGKILL)
            expected.append(max(both_committed(run_dir)))
            # 2. SIGKILL rank 1 while its async save of step 12 is in flight (.tmp half written)
            flag = run_dir / "save_in_flight_rank_1"
            wait_for(flag.exists, timeout=240, what="attempt 1's held async save")
            partial = Path(flag.read_text())
            rank0_done = Path(str(partial.with_suffix(".ckpt")).replace("rank_1", "rank_0") + ".done")
            wait_for(rank0_done.exists, timeout=60, what="rank 0's own save of that step committed")
            os.kill(heartbeat(run_dir, 1)["pid"], signal.SIGKILL)
            expected.append(max(both_committed(run_dir)))
            # 3. hang rank 1 (SIGSTOP: alive, silent) after attempt 2 saved step 12
            hb = wait_for(lambda: attempt_at(run_dir, 1, 2, 13) if 12 in both_committed(run_dir) else None,
                          timeout=240, what="attempt 2 training past step 12's save")
            os.kill(hb["pid"], signal.SIGSTOP)
            expected.append(max(both_committed(run_dir)))
            _, err = launcher.communicate(timeout=300)
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.communicate()
        log = "\n".join(l for l in err.splitlines() if l.startswith("launch:"))
        assert launcher.returncode == 0, log
    finally:
        serve.stop()

    assert "attempt=0 event=fresh_start" in log
    assert re.search(r"attempt=0 event=rank_failed rank=1 step=\d+ reason=\"rank process died \(exit code -9", log), log
    assert re.search(r"attempt=1 event=rank_failed rank=1 step=\d+ reason=\"rank process died \(exit code -9", log), log
    assert re.search(r"attempt=2 event=rank_failed rank=\d step=\d+ reason=\"heartbeat stale", log), log
    # each restart resumed from the newest step rank 1 had committed when it was stopped: the half
    # written save of step 12 (rank 0's copy complete) is not restorable, so attempt 2 starts at 8
    assert expected[1] == 8 and partial.name.endswith("-2_6.tmp") and partial.exists()
    final_name = partial.with_suffix(".ckpt")  # never renamed into place, so never given a commit hint
    assert not final_name.exists() and not Path(f"{final_name}.done").exists()
    assert Path(str(final_name).replace("rank_1", "rank_0") + ".done").exists()  # rank 0's save finished
    for attempt, step in enumerate(expected, start=1):
        assert f"attempt={attempt} event=resume step={step} " in log, log
    # steps are named as users count them (issue 25, item 3): the torn save is global step 12 (rank
    # 0's shard of it verified), named net-2_6 -- never "skipped 6" next to "resume step=8"
    resumed_2 = next(l for l in log.splitlines() if "attempt=2 event=resume" in l)
    assert "skipped 12 (" in resumed_2 and "files named epoch 2 step 6" in resumed_2, resumed_2
    assert not re.search(r"catalog_(settled|lagging) .*steps=\"?2=", log), log  # step 8 is not "2"
    assert "attempt=3 event=finished" in log
    # msrun's logs of every attempt survive the restarts in their own attempt_<k> (issue 25, item 6):
    # the failed attempts' worker logs are still there, each named in its attempt's started line
    msrun_logs = run_dir / "msrun_logs"
    assert sorted(p.name for p in msrun_logs.iterdir()) == [f"attempt_{k}" for k in range(4)]
    for k in range(4):
        started = next(line for line in log.splitlines() if f"attempt={k} event=started" in line)
        assert f"msrun_logs={msrun_logs / f'attempt_{k}'}" in started, started
        assert len(list((msrun_logs / f"attempt_{k}").glob("worker_*.log"))) == 2, k
    got, want = losses(run_dir), losses(ref_dir)
    assert sorted(got) == list(range(1, STEPS_PER_EPOCH * EPOCHS + 1)) == sorted(want)
    for step, hexes in got.items():  # every attempt that ran a step computed the reference's loss
        assert hexes == want[step], f"step {step}: {hexes} != {want[step]}"
    for r in range(2):  # the final save (step 18, epoch 3 step 6): same bytes as the reference's
        final = [n for n in os.listdir(run_dir / f"rank_{r}") if n.endswith("-3_6.ckpt")]
        assert final == ["net_3-3_6.ckpt"], final
        assert th.read(str(run_dir / f"rank_{r}" / final[0])) == th.read(str(ref_dir / f"rank_{r}" / "net-3_6.ckpt"))
    # rank 0's health reports reached ckptd (those sent before ckptd saw the run's first shard were
    # refused with 404 and dropped, by design): the last attempt's steps, each with the loss trained
    rows = query(serve.db, "SELECT h.step, h.loss, h.grad_norm, h.overflow FROM step_health h JOIN runs r "
                           "ON r.id = h.run_id WHERE r.name = 'userjob' ORDER BY h.step")
    assert {r[0] for r in rows} >= set(range(13, STEPS_PER_EPOCH * EPOCHS + 1)), rows
    for step, loss, grad_norm, overflow in rows:
        assert (loss, grad_norm, bool(overflow)) == (float.fromhex(next(iter(want[step]))), None, False), step


# --- no MindSpore: what the launcher refuses, and the command it builds --------------------------


FAKE_JOB = """
import json, os, sys, time
hb = os.environ["CKPTD_HEARTBEAT_DIR"]
with open(os.path.join(os.environ["OUT"], "argv.json"), "w") as fh:
    json.dump({"argv": sys.argv[1:], "resume_file": os.environ.get("CKPTD_RESUME_FILE"),
               "step": os.environ.get("RESUME_STEP")}, fh)
for r in range(int(os.environ.get("FAKE_RANKS", "2"))):
    for kind, doc in (("json", {"pid": os.getpid(), "rank": r, "step": 0, "phase": "finishing", "time": time.time()}),
                      ("exit", {"code": 0, "step": 0})):
        with open(os.path.join(hb, f"rank_{r}.{kind}"), "w") as fh:
            json.dump(doc, fh)
"""


def mindformers_answer(run_dir: Path) -> dict:
    ck = run_dir / "checkpoint"
    return {"run": "mf", "step": 6, "epoch": 1, "global_step": 6, "world_size": 2, "layout": "mindformers",
            "shards": [{"rank": r, "path": str(ck / f"rank_{r}" / f"llama_rank_{r}-1_6.ckpt")} for r in range(2)],
            "mindformers": {"load_checkpoint": str(ck), "resume_training": "llama_rank_0-1_6.ckpt",
                            "loadable_by_mindformers": True, "remove_redundancy": False}}


def test_mindformers_preset_builds_run_mindformer_command(tmp_path):
    """A MindFormers-layout answer, resumed with ``--resume-preset mindformers``: the command gets
    ``--load_checkpoint <output_dir>/checkpoint --resume_training <file>`` and the job the answer file."""
    run_dir = tmp_path / "mf"
    answer = tmp_path / "answer.json"
    answer.write_text(json.dumps(mindformers_answer(run_dir)))
    job = tmp_path / "run_mindformer.py"
    job.write_text(FAKE_JOB)
    cmd = [sys.executable, "-m", "ckptd", "launch", "--run-dir", str(run_dir), "--world", "2",
           "--resume-cmd", f"cat {answer}", "--resume-preset", "mindformers", "--resume-env", "RESUME_STEP={step}",
           "--", sys.executable, str(job), "--config", "pretrain.yaml", "--use_parallel", "True"]
    proc = subprocess.run(cmd, cwd=th.REPO, env=dict(th.env(), OUT=str(tmp_path)), capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    got = json.loads((tmp_path / "argv.json").read_text())
    assert got["argv"] == ["--config", "pretrain.yaml", "--use_parallel", "True",
                           "--load_checkpoint", str(run_dir / "checkpoint"),
                           "--resume_training", "llama_rank_0-1_6.ckpt"]
    assert got["step"] == "6"
    assert json.loads(Path(got["resume_file"]).read_text()) == mindformers_answer(run_dir)
    assert "attempt=0 event=resume step=6" in proc.stderr and "attempt=0 event=finished" in proc.stderr


def test_native_answer_values():
    vals = template.values({"step": 12, "epoch": 2, "global_step": 12, "shards": [
        {"rank": 1, "path": "/r/run/rank_1/net-2_6.ckpt"}, {"rank": 0, "path": "/r/run/rank_0/net-2_6.ckpt"}]}, "/a.json")
    assert vals == {"checkpoint_dir": "/r/run", "resume_file": "net-2_6.ckpt", "step": "12", "epoch": "2",
                    "global_step": "12", "resume_json": "/a.json", "ckpt_file": "/r/run/rank_0/net-2_6.ckpt"}


@pytest.mark.parametrize("args, env, world, why", [
    ("--load {checkpoint_path}", [], 2, "unknown placeholder {checkpoint_path}"),
    ("--load {ckpt_file}", [], 2, "{ckpt_file} in '{ckpt_file}' names one rank's file, but the job has 2 ranks"),
    ("--load {step!r}", [], 1, "bad placeholder"),
    ("--load {step", [], 1, "bad template"),
    ("--load '{step}", [], 1, "not a valid shell word list"),
    (None, ["NO_EQUALS"], 1, "expected NAME=TEMPLATE"),
    (None, ["X={nope}"], 1, "unknown placeholder {nope}"),
])
def test_bad_templates_are_refused(args, env, world, why):
    with pytest.raises(template.TemplateError) as err:
        template.check(args, env, world)
    assert why in str(err.value)


def test_ckpt_file_is_fine_for_one_rank():
    assert template.check("--load {ckpt_file}", [], 1) == (["--load", "{ckpt_file}"], {})


def test_a_refused_template_starts_nothing(tmp_path):
    marker = tmp_path / "started"
    proc = subprocess.run([sys.executable, "-m", "ckptd", "launch", "--run-dir", str(tmp_path / "run"), "--world", "2",
                           "--resume-args", "--resume {resum_file}", "--", "touch", str(marker)],
                          cwd=th.REPO, env=th.env(), capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "unknown placeholder {resum_file}" in proc.stderr
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_a_missing_command_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ckptd", "launch", "--run-dir", str(tmp_path / "run"), "--world", "1",
                           "--", "no-such-msrun", "x.py"], cwd=th.REPO, env=th.env(), capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 2 and "command not found or not executable: 'no-such-msrun'" in proc.stderr


def elastic_launch(serve: Serve, out: Path, world: int, *launch_args: str) -> tuple[int, str, dict | None]:
    """``ckptd launch`` of FAKE_JOB (``world`` ranks) against ``serve``: (exit code, its launch: lines, what
    the job recorded -- None if it never started)."""
    out.mkdir()
    job = out / "job.py"
    job.write_text(FAKE_JOB)
    cmd = [sys.executable, "-m", "ckptd", "launch", "--run-dir", str(serve.root / "ejob"), "--world", str(world),
           "--ckptd-url", serve.url, "--settle-timeout", "5", "--exit-grace", "0", "--max-restarts", "0",
           "--resume-args", "--ckpt-dir {checkpoint_dir} --resume-json {resume_json}", *launch_args,
           "--", sys.executable, str(job)]
    proc = subprocess.run(cmd, cwd=th.REPO, env=dict(th.env(), OUT=str(out), FAKE_RANKS=str(world)),
                          capture_output=True, text=True, timeout=120, check=False)
    log = "\n".join(l for l in proc.stderr.splitlines() if l.startswith("launch:"))
    got = json.loads((out / "argv.json").read_text()) if (out / "argv.json").exists() else None
    return proc.returncode, log or proc.stderr, got


def TwoParams(ms):  # noqa: N802 -- a Cell class built on demand: the module imports no MindSpore
    class Net(ms.nn.Cell):
        def __init__(self) -> None:
            super().__init__()
            self.w = ms.Parameter(ms.Tensor(np.zeros(FULL_W, np.float32)), name="w")
            self.b = ms.Parameter(ms.Tensor(np.zeros(3, np.float32)), name="b")

    return Net()


def test_elastic_restart_resumes_from_ckptd_resharded_copy(tmp_path, ms, monkeypatch):
    """A tp=2 save (real ``mindspore.save_checkpoint`` shards + strategy file) relaunched with
    ``--layout``: at tp=1 (another world size) and at tp=1,dp=2 (same world, another split) the job gets
    ckptd's re-sharded copy -- its shards, its directory -- and the full tensors (which the callback's
    ``restore()`` loads per rank); at tp=2,dp=1 the saved shards as they are; a second tp=1 launch
    reuses the copy; without ``--layout`` a step of another world size is refused; with the run's
    strategy file overwritten since the save, ckptd derives the target from the one it catalogued."""
    serve = Serve(tmp_path / "ckptd", world_size=None)
    root = serve.root
    write_tp_strategy(root / "ejob")
    saved = [save_shard(ms, root, "ejob", r, 6) for r in range(2)]
    full = {"w": np.concatenate([rank_tensors(r, 6)["w"] for r in range(2)]), "b": rank_tensors(0, 6)["b"]}
    assert full["w"].shape == FULL_W
    src = load_strategy(root / "ejob" / "strategy.ckpt")

    def layout_hash(tp: int, dp: int) -> str:
        return derive_strategy(src, tp, dp).content_hash()

    try:
        wait_for(serve.up, timeout=60, interval=0.2, what="ckptd serve to come up")
        wait_for(lambda: httpx.get(f"{serve.url}/v1/runs/ejob/resume").status_code == 200, timeout=60, interval=0.2,
                 what="ckptd to verify step 6")

        def check_copy(got: dict, world: int) -> dict:
            answer = json.loads(Path(got["resume_file"]).read_text())
            assert [s["rank"] for s in answer["shards"]] == list(range(world))
            copy_dir = os.path.dirname(os.path.dirname(answer["shards"][0]["path"]))
            assert os.path.dirname(copy_dir) == str(root / "ejob" / "converted"), answer["shards"]
            assert got["argv"] == ["--ckpt-dir", copy_dir, "--resume-json", got["resume_file"]]
            assert answer["world_size"] == world and answer["converted_from_world_size"] == 2
            for s in answer["shards"]:  # tp=1 on every rank: each holds the concatenation of the tp=2 halves
                assert s["path"].startswith(copy_dir + os.sep)
                loaded = ms.load_checkpoint(s["path"])
                for name, want in full.items():
                    np.testing.assert_array_equal(loaded[name].asnumpy(), want)
            return answer

        # another world size: 2 ranks (tp=2) -> 1
        rc, log, got = elastic_launch(serve, tmp_path / "tp1", 1, "--layout", "tp=1,dp=1")
        assert rc == 0, log
        assert re.search(r"attempt=0 event=convert_requested step=6 from_world=2 to_world=1 layout=tp=1,dp=1 ", log), log
        assert re.search(r"attempt=0 event=convert_done step=6 from_world=2 to_world=1 job=\d+ ", log), log
        assert "attempt=0 event=resume step=6 from_world=2 to_world=1 " in log and "event=finished" in log
        first = check_copy(got, 1)
        # ckptd made it for the declared layout: its --to-layout derivation of the saved strategy
        convs = httpx.get(f"{serve.url}/v1/runs/ejob/conversions").json()
        assert [(c["state"], c["source_step"], c["target_strategy_hash"], c["out_dir"]) for c in convs] == [
            ("done", 6, layout_hash(1, 1), os.path.dirname(os.path.dirname(first["shards"][0]["path"])))]
        assert first["strategy_hash"] == layout_hash(1, 1)

        # the same again: ckptd's copy is ready, nothing is converted twice
        rc, log, got = elastic_launch(serve, tmp_path / "tp1-again", 1, "--layout", "tp=1,dp=1")
        assert rc == 0 and "event=convert_existing step=6" in log and "convert_requested" not in log, log
        assert check_copy(got, 1)["shards"] == first["shards"]

        # the same world size, another split: ckptd's oracle sees nothing to convert, the strategies differ
        rc, log, got = elastic_launch(serve, tmp_path / "tp1dp2", 2, "--layout", "tp=1,dp=2")
        assert rc == 0, log
        assert "event=convert_requested step=6 from_world=2 to_world=2 layout=tp=1,dp=2 " in log, log
        assert "another layout" in log and "event=convert_done" in log
        other = check_copy(got, 2)
        assert other["strategy_hash"] == layout_hash(1, 2) and other["converted_from_world_size"] == 2
        # and the callback's restore() loads each rank's own file of the copy
        from ckptd.integrations.mindspore_callback import CkptdCallback

        for var in ("CKPTD_HEARTBEAT_DIR", "CKPTD_URL", "CKPTD_RUN_NAME", "CKPTD_RESUME_FILE"):
            monkeypatch.delenv(var, raising=False)  # this process is not a job under a launcher
        for rank in range(2):
            monkeypatch.setenv("RANK_ID", str(rank))
            net = TwoParams(ms)
            cb = CkptdCallback(heartbeat_dir=None, ckptd_url=None)
            assert cb.restore(None, net, resume_file=got["resume_file"]) == 0
            assert cb.resumed_from == other["shards"][rank]["path"] and cb.resume_step == 6
            np.testing.assert_array_equal(net.w.asnumpy(), full["w"])

        # the layout it was saved in: the saved shards, no conversion
        rc, log, got = elastic_launch(serve, tmp_path / "tp2", 2, "--layout", "tp=2,dp=1")
        assert rc == 0 and "convert" not in log, log
        assert [s["path"] for s in json.loads(Path(got["resume_file"]).read_text())["shards"]] == list(map(str, saved))

        # no declared layout: another world size stops the launcher with the way out, the job never starts
        rc, log, got = elastic_launch(serve, tmp_path / "undeclared", 1)
        assert rc == 2 and got is None, log
        assert "event=convert_failed" in log and "saved with world size 2, the job has 1" in log
        assert "--layout tp=..,dp=.." in log and "event=started" not in log

        # the run's strategy file overwritten since (a job restarted in another layout writes its own):
        # the launcher reads no strategy file; ckptd derives the target from the content it catalogued
        # for step 6 -- the same copy, ready, reused
        (root / "ejob" / "strategy.ckpt").unlink()
        write_tp_strategy(root / "ejob", tp=1)
        rc, log, got = elastic_launch(serve, tmp_path / "changed", 1, "--layout", "tp=1,dp=1")
        assert rc == 0, log
        assert "event=convert_existing step=6" in log and "convert_requested" not in log, log
        assert check_copy(got, 1)["shards"] == first["shards"]
    finally:
        serve.stop()


@pytest.mark.parametrize("layout, why", [
    ("tp=2,dq=1", "bad --layout 'tp=2,dq=1': bad --layout item 'dq=1'"),
    ("tp=2", "--layout needs dp=N"),
    ("tp=2,dp=2", "--layout tp=2,dp=2 is 4 ranks, the job has 2"),
])
def test_a_bad_layout_starts_nothing(tmp_path, layout, why):
    marker = tmp_path / "started"
    proc = subprocess.run([sys.executable, "-m", "ckptd", "launch", "--run-dir", str(tmp_path / "run"), "--world", "2",
                           "--layout", layout, "--", "touch", str(marker)],
                          cwd=th.REPO, env=th.env(), capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and why in proc.stderr, proc.stderr
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_world_size_from_msrun():
    assert world_from_command(["msrun", "--worker_num=4", "--local_worker_num=4", "x.py"]) == 4
    assert world_from_command(["msrun", "--worker_num", "8", "x.py"]) == 8
    assert world_from_command(["python", "x.py"]) is None


def test_launcher_and_cli_do_not_import_mindspore():
    """``ckptd launch`` runs where the daemon runs: only the job-side callback imports MindSpore."""
    code = ("import sys, ckptd.cli, ckptd.launcher.command, ckptd.launcher.supervise, ckptd.launcher.heartbeat; "
            "sys.exit('mindspore' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=th.REPO, env=th.env(), timeout=60).returncode == 0


def test_mindformers_yaml_callbacks_build_ckptd_callback_and_commit_async_saves(tmp_path):
    """The README's YAML lines, run by MindFormers' own ``build_callback`` and ``CheckpointMonitor``
    (async saves) in a real ``Model.train``: ckptd's callback is registered from ``REGISTER_PATH``,
    gives every MindFormers shard a true commit hint, and leaves the launcher's heartbeat files."""
    import xxhash

    out, hb = tmp_path / "output_dir", tmp_path / "heartbeat"
    e = dict(th.env(), RANK_ID="0", CKPTD_HEARTBEAT_DIR=str(hb), LOCAL_DEFAULT_PATH=str(tmp_path / "mf_logs"))
    for var in ("MS_ROLE", "RANK_SIZE", "MS_WORKER_NUM", "CKPTD_URL", "CKPTD_RESUME_FILE"):
        e.pop(var, None)
    proc = subprocess.run([sys.executable, os.path.join(th.REPO, "tests", "fixtures", "mf_callback_job.py"), str(out)],
                          cwd=tmp_path, env=e, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "callbacks: ['CheckpointMonitor', 'CkptdCallback']" in proc.stdout
    rank_dir = out / "checkpoint" / "rank_0"
    shards = sorted(p.name for p in rank_dir.glob("*.ckpt"))
    assert shards == ["llama_rank_0-1_2.ckpt", "llama_rank_0-1_4.ckpt", "llama_rank_0-1_6.ckpt"]
    for name in shards:
        data = (rank_dir / name).read_bytes()
        assert json.loads((rank_dir / f"{name}.done").read_text()) == {
            "size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
    assert json.loads((hb / "rank_0.exit").read_text()) == {"code": 0, "step": 6, "attempt": 0}
    assert json.loads((hb / "rank_0.json").read_text())["phase"] == "finishing"
