"""Fault campaign (issue 15): randomized trials on a real multi-rank MindSpore job under the launcher,
with a real ``ckptd serve`` as its resume oracle, each checked against an uninterrupted run.

Every trial runs ``python -m trainer.launch --ckptd-url`` on a fresh run directory under ckptd's root
(tp=2 x dp=2 on 4 ranks by default, the tiny model of tests/trainer_helpers.py) and injects one kind
of fault, with its rank, step and moment drawn at random:

``rank-kill``       SIGKILL of a random rank's process (pid from its heartbeat) at a random moment of a
                    random step, from outside the job;
``rank-kill-save``  a random rank SIGKILLs itself while its async save of a random save step is in
                    flight (``--fault kill-in-save``: MindSpore's writer issued, the shard never lands);
``daemon-kill``     SIGKILL of ``ckptd serve`` at a random moment, restarted after a random down time
                    (0.5-8 s; same catalog, same port); the job trains on, its health reports dropped;
``both``            a random rank and ckptd SIGKILLed around the same moment (ckptd -2..+1 s from the
                    rank), ckptd down 1-12 s: the restart's question meets a dead or starting daemon
                    (the launcher waits: ``event=oracle-wait``);
``corrupt-run``     one byte of the newest committed shard of a random rank flipped in place (mode,
                    size kept; as root, like bit rot on a read-only file) while the job runs, a random
                    rank SIGKILLed 0.3-3 s later;
``corrupt-resume``  a random rank SIGKILLed; the newest committed shard flipped as soon as the launcher
                    logs the failure, i.e. during its back-off before it asks ckptd;
``corrupt-down``    ckptd SIGKILLed, the newest committed shard flipped while it is down, a random rank
                    SIGKILLed, ckptd restarted 1-8 s later: only its rescan at start can know (the
                    launcher waits for ``/healthz`` ``first_rescan_done``);
``hang``            a random rank stops at a random step (``--fault hang``, no heartbeat): the
                    launcher's ``--heartbeat-timeout`` finds it.

A trial passes when all of these hold:

1. the launcher finished (exit 0) and the fault really happened (a rank failure was logged; for
   ``daemon-kill`` ckptd was really down while the job trained);
2. every step's loss, in every attempt that computed it, and every rank's final shard are bitwise those
   of the uninterrupted reference run (the trainer is deterministic);
3. every resume was from a step ckptd still calls ``verified`` whose files are intact -- bitwise the
   reference run's shards of that step, read the moment the launcher logs its decision (before the
   trainer loads them); the trainer is deterministic, so this needs no sidecar (a rank killed between
   MindSpore's rename + chmod and its ``.done`` leaves a whole shard without one). A resume from
   anything else is a *bad resume*; resuming older than the newest intact committed save is counted as
   lost work (``older``), and a restart that starts fresh while an intact save exists as ``fresh``
   (both noted, not failures: ckptd may not have judged it yet when asked);
4. the catalog is true at the end: for every save committed on disk by every rank, ckptd's state is
   ``verified`` if all its shards are intact and ``corrupt`` if one is not (waited for up to 90 s).

Each trial is one JSON line appended to ``<work>/trials.jsonl``; a later run continues the numbering
(and the random draws) and the summary covers every trial in the file::

    .venv/bin/python bench/chaos.py --trials 10            # ~1.5 min per trial on 2 cores
    .venv/bin/python bench/chaos.py --summary              # passed / total, per kind, from the file
    .venv/bin/python bench/chaos.py --kinds both,hang --trials 4

Not a test: it takes minutes per trial and its draws differ per seed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from ckptd.launcher.supervise import free_port  # noqa: E402
from trainer.oracle import committed_saves  # noqa: E402

KINDS = ("rank-kill", "rank-kill-save", "daemon-kill", "both", "corrupt-run", "corrupt-resume", "corrupt-down", "hang")
TINY = ["--hidden", "32", "--heads", "4", "--ffn", "64", "--layers", "2", "--seq", "16", "--warmup", "3"]
REPORT, ADMIN = "chaos-report-token", "chaos-admin-token"


def env() -> dict[str, str]:
    e = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    e.setdefault("GLOG_v", "3")
    return e


def load_avg() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


# --- ckptd serve ---------------------------------------------------------------------------------


class Serve:
    """``ckptd serve`` on a fixed port and catalog; SIGKILL and restart keep both."""

    def __init__(self, work: str, port: int) -> None:
        self.work, self.port = work, port
        self.root = os.path.join(work, "root")
        os.makedirs(self.root, exist_ok=True)
        self.db = f"sqlite:///{os.path.join(work, 'catalog.db')}"
        self.tokens = os.path.join(work, "tokens")
        with open(self.tokens, "w") as fh:
            fh.write(f"report {REPORT}\nadmin {ADMIN}\n")
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.lock = threading.Lock()
        subprocess.run([sys.executable, "-m", "ckptd", "db", "upgrade", "--db", self.db], cwd=REPO, env=env(),
                       check=True, capture_output=True)

    def start(self) -> None:
        with self.lock:
            self.starts += 1
            log = open(os.path.join(self.work, "ckptd.log"), "ab")  # noqa: SIM115
            log.write(f"\n=== chaos: start {self.starts} at {time.time():.3f}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ckptd", "serve", "--root", self.root, "--port", str(self.port), "--db", self.db],
                cwd=REPO, env=dict(env(), CKPTD_TOKEN_FILE=self.tokens), stdout=log, stderr=subprocess.STDOUT)
            log.close()

    def kill(self) -> None:
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()

    def up(self) -> bool:
        try:
            return bool(get_json(f"{self.url}/healthz", None).get("first_rescan_done"))
        except (OSError, ValueError):
            return False

    def ensure_up(self, timeout: float = 90.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        deadline = time.monotonic() + timeout
        while not self.up():
            if time.monotonic() > deadline:
                raise SystemExit(f"chaos: ckptd serve did not come up (see {self.work}/ckptd.log)")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def get_json(url: str, token: str | None = REPORT, timeout: float = 5.0):
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


# --- the job -------------------------------------------------------------------------------------


@dataclass
class Job:
    tp: int
    dp: int
    steps: int
    save_every: int
    micro_batch: int

    @property
    def world(self) -> int:
        return self.tp * self.dp

    def train_args(self) -> list[str]:
        return [*TINY, "--steps", str(self.steps), "--save-every", str(self.save_every),
                "--micro-batch", str(self.micro_batch)]

    def key(self) -> str:
        return f"tp{self.tp}dp{self.dp}-s{self.steps}-e{self.save_every}-mb{self.micro_batch}"


def launcher_cmd(job: Job, run_dir: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainer.launch", "--run-dir", run_dir, "--tp", str(job.tp), "--dp", str(job.dp),
            *extra, "--", *job.train_args()]


def reference(job: Job, work: str) -> str:
    """The uninterrupted run (no ckptd), once per job configuration."""
    d = os.path.join(work, f"ref-{job.key()}")
    if os.path.exists(os.path.join(d, "DONE")):
        return d
    if os.path.exists(d):
        subprocess.run(["rm", "-rf", d], check=True)
    print(f"chaos: reference run {job.key()} ...", flush=True)
    proc = subprocess.run(launcher_cmd(job, d, "--fresh"), cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=900, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"chaos: reference run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    open(os.path.join(d, "DONE"), "w").close()
    return d


def losses(run_dir: str) -> dict[int, list[tuple[int, str]]]:
    out: dict[int, list[tuple[int, str]]] = {}
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            for line in fh:
                d = json.loads(line)
                out.setdefault(d["step"], []).append((d["attempt"], d["loss_hex"]))
    except OSError:
        pass
    return out


def shard_path(run_dir: str, rank: int, step: int) -> str:
    from ckptd import runlayout

    return runlayout.shard_path(run_dir, rank, "llama", 1, step, runlayout.NATIVE)


def read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


def heartbeat(run_dir: str, rank: int) -> dict | None:
    try:
        with open(os.path.join(run_dir, "heartbeat", f"rank_{rank}.json")) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def launcher_lines(run_dir: str) -> list[str]:
    try:
        with open(os.path.join(run_dir, "launcher.log")) as fh:
            return [line.rstrip("\n") for line in fh]
    except OSError:
        return []


# --- one trial -----------------------------------------------------------------------------------


@dataclass
class Trial:
    index: int
    kind: str
    seed: int
    plan: dict = field(default_factory=dict)
    events: list = field(default_factory=list)  # (time since start, what)
    resumes: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def event(self, t0: float, what: str) -> None:
        self.events.append((round(time.monotonic() - t0, 2), what))


class Stop(Exception):
    pass


def wait_until(pred, stop: threading.Event, timeout: float, poll: float = 0.02):
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            return None
        time.sleep(poll)
    raise Stop


def flip_newest(run_dir: str, world: int, rng: random.Random, trial: Trial, t0: float) -> None:
    """One byte of the newest save committed by every rank, of a random rank, flipped in place: no
    chmod (root writes the 0400 file), same size -- what ckptd's event path and rescans must notice."""
    saves = committed_saves(run_dir, world)
    if not saves:
        trial.notes.append("nothing committed to corrupt")
        return
    _, _, step = saves[0]
    rank = rng.randrange(world)
    path = shard_path(run_dir, rank, step)
    size = os.path.getsize(path)
    off = rng.randrange(size)
    with open(path, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
    trial.plan.update(corrupted_step=step, corrupted_rank=rank, corrupted_offset=off, corrupted_size=size)
    trial.event(t0, f"flipped byte {off}/{size} of rank {rank} step {step}")


def kill_rank_at(run_dir: str, rank: int, step: int, frac: float, stop: threading.Event, trial: Trial,
                 t0: float) -> bool:
    """SIGKILL ``rank``'s process ``frac`` of a second into its step ``step`` (attempt 0)."""
    hb = wait_until(lambda: (h := heartbeat(run_dir, rank)) and h.get("attempt") == 0 and h.get("step", 0) >= step
                    and h, stop, timeout=300)
    if not hb:
        trial.notes.append(f"rank {rank} never reached step {step}")
        return False
    time.sleep(frac)
    hb = heartbeat(run_dir, rank) or hb
    try:
        os.kill(int(hb["pid"]), signal.SIGKILL)
    except ProcessLookupError:
        trial.notes.append(f"rank {rank} pid {hb['pid']} already gone")
        return False
    trial.event(t0, f"SIGKILL rank {rank} pid {hb['pid']} at step {hb.get('step')} phase {hb.get('phase')}")
    return True


def chaos(job: Job, run_dir: str, serve: Serve, trial: Trial, rng: random.Random, stop: threading.Event,
          t0: float) -> None:
    """The fault thread of one trial (faults injected by the trainer itself are in trial.plan['fault'])."""
    kind, world = trial.kind, job.world
    try:
        if kind == "rank-kill":
            p = trial.plan
            kill_rank_at(run_dir, p["rank"], p["step"], p["frac"], stop, trial, t0)
        elif kind == "daemon-kill":
            p = trial.plan
            if wait_until(lambda: (h := heartbeat(run_dir, 0)) and h.get("step", 0) >= p["step"], stop, 300):
                time.sleep(p["frac"])
                serve.kill()
                # the fault counts only if the job was still training when ckptd died
                trial.plan["daemon_was_down"] = not os.path.exists(os.path.join(run_dir, "heartbeat", "rank_0.exit"))
                trial.event(t0, f"SIGKILL ckptd (rank 0 at step {(heartbeat(run_dir, 0) or {}).get('step')})")
                time.sleep(p["down"])
                serve.start()
                trial.event(t0, "ckptd restarted")
        elif kind == "both":
            p = trial.plan
            hb = wait_until(lambda: (h := heartbeat(run_dir, p["rank"])) and h.get("attempt") == 0
                            and h.get("step", 0) >= p["step"] and h, stop, 300)
            if hb:
                # daemon offset in [-2, +1] s around the rank kill
                first, gap = ("daemon", -p["offset"]) if p["offset"] < 0 else ("rank", p["offset"])
                time.sleep(p["frac"])
                if first == "daemon":
                    serve.kill()
                    trial.event(t0, "SIGKILL ckptd")
                    time.sleep(gap)
                    kill_rank_at(run_dir, p["rank"], 0, 0.0, stop, trial, t0)
                else:
                    kill_rank_at(run_dir, p["rank"], 0, 0.0, stop, trial, t0)
                    time.sleep(gap)
                    serve.kill()
                    trial.event(t0, "SIGKILL ckptd")
                time.sleep(p["down"])
                serve.start()
                trial.event(t0, "ckptd restarted")
        elif kind == "corrupt-run":
            p = trial.plan
            if wait_until(lambda: (h := heartbeat(run_dir, 0)) and h.get("step", 0) >= p["flip_step"]
                          and committed_saves(run_dir, world), stop, 300):
                time.sleep(p["frac"])
                flip_newest(run_dir, world, rng, trial, t0)
                time.sleep(p["delay"])
                kill_rank_at(run_dir, p["rank"], 0, 0.0, stop, trial, t0)
        elif kind == "corrupt-resume":
            p = trial.plan
            if kill_rank_at(run_dir, p["rank"], p["step"], p["frac"], stop, trial, t0) and wait_until(
                    lambda: any("event=rank_failed" in l for l in launcher_lines(run_dir)), stop, 120, poll=0.01):
                flip_newest(run_dir, world, rng, trial, t0)
        elif kind == "corrupt-down":
            p = trial.plan
            if wait_until(lambda: (h := heartbeat(run_dir, 0)) and h.get("step", 0) >= p["step"]
                          and committed_saves(run_dir, world), stop, 300):
                time.sleep(p["frac"])
                serve.kill()
                trial.event(t0, "SIGKILL ckptd")
                flip_newest(run_dir, world, rng, trial, t0)
                kill_rank_at(run_dir, p["rank"], 0, 0.0, stop, trial, t0)
                time.sleep(p["down"])
                serve.start()
                trial.event(t0, "ckptd restarted")
        # rank-kill-save, hang: the trainer's own --fault; nothing to do from outside
    except Stop:
        pass


def intact(run_dir: str, ref: str, rank: int, step: int) -> bool:
    """Bitwise the uninterrupted run's shard of this rank and step."""
    got = read(shard_path(run_dir, rank, step))
    return got is not None and got == read(shard_path(ref, rank, step))


def newest_intact(job: Job, run_dir: str, ref: str) -> int | None:
    for _, _, step in committed_saves(run_dir, job.world):
        if all(intact(run_dir, ref, r, step) for r in range(job.world)):
            return step
    return None


_DECISION = re.compile(r"attempt=(\d+) event=(resume|fresh_start) step=(\d+)")


def watch_resumes(job: Job, run_dir: str, ref: str, trial: Trial, stop: threading.Event, t0: float) -> None:
    """At each restart's decision (logged after the answer is written, before msrun starts): read the
    answered shards and note the newest save whose every shard was intact at that moment."""
    seen = set()
    while not stop.is_set():
        for line in launcher_lines(run_dir):
            m = _DECISION.search(line)
            if m is None or int(m.group(1)) == 0 or int(m.group(1)) in seen:
                continue
            attempt = int(m.group(1))
            seen.add(attempt)
            newest = newest_intact(job, run_dir, ref)
            if m.group(2) == "fresh_start":
                trial.resumes.append({"attempt": attempt, "step": None, "intact": {}, "newest_intact": newest})
                trial.event(t0, f"attempt {attempt} starts fresh (newest intact {newest})")
                continue
            with open(os.path.join(run_dir, "launcher", f"resume_{attempt}.json")) as fh:
                answer = json.load(fh)
            step = int(answer["step"])
            ok = {int(s["rank"]): read(s["path"]) == read(shard_path(ref, int(s["rank"]), step))
                  for s in answer.get("shards", [])}
            trial.resumes.append({"attempt": attempt, "step": step, "intact": ok, "newest_intact": newest})
            trial.event(t0, f"attempt {attempt} resumes from step {step} (newest intact {newest})")
        time.sleep(0.02)


def draw(kind: str, job: Job, rng: random.Random) -> dict:
    world, steps, every = job.world, job.steps, job.save_every
    rank = rng.randrange(world)
    if kind == "rank-kill":
        return {"rank": rank, "step": rng.randint(2, steps - 1), "frac": round(rng.uniform(0.0, 0.9), 2)}
    if kind == "rank-kill-save":
        saves = [s for s in range(every, steps, every)]
        return {"rank": rank, "fault": f"kill-in-save:{rank}:{rng.choice(saves)}"}
    if kind == "daemon-kill":
        return {"step": rng.randint(1, steps - 2), "frac": round(rng.uniform(0.0, 0.9), 2),
                "down": round(rng.uniform(0.5, 8.0), 1)}
    if kind == "both":
        return {"rank": rank, "step": rng.randint(2, steps - 1), "frac": round(rng.uniform(0.0, 0.9), 2),
                "offset": round(rng.uniform(-2.0, 1.0), 2), "down": round(rng.uniform(1.0, 12.0), 1)}
    if kind == "corrupt-run":
        flip = rng.randint(every + 1, steps - 3)  # the kill follows up to 3 s later: before the job ends
        return {"rank": rank, "flip_step": flip, "frac": round(rng.uniform(0.0, 0.9), 2),
                "delay": round(rng.uniform(0.3, 3.0), 1)}
    if kind == "corrupt-resume":
        return {"rank": rank, "step": rng.randint(every + 2, steps - 1), "frac": round(rng.uniform(0.0, 0.9), 2)}
    if kind == "corrupt-down":
        return {"rank": rank, "step": rng.randint(every + 1, steps - 1), "frac": round(rng.uniform(0.0, 0.9), 2),
                "down": round(rng.uniform(1.0, 8.0), 1)}
    if kind == "hang":
        return {"rank": rank, "fault": f"hang:{rank}:{rng.randint(every + 1, steps - 1)}"}
    raise ValueError(kind)


def catalog_states(serve: Serve, run: str) -> dict[int, str]:
    try:
        rows = get_json(f"{serve.url}/v1/runs/{run}/steps?limit=1000")
    except (OSError, ValueError):
        return {}
    return {int(r["step"]): str(r["state"]) for r in rows if r.get("kind", "trained") == "trained"}


def run_trial(job: Job, ref: str, serve: Serve, index: int, kind: str, seed: int, args) -> dict:
    rng = random.Random(seed)
    trial = Trial(index, kind, seed, draw(kind, job, rng))
    run = f"t{index:03d}-{kind}"
    run_dir = os.path.join(serve.root, run)
    serve.ensure_up()
    extra = ["--ckptd-url", serve.url, "--heartbeat-timeout", str(args.heartbeat_timeout), "--max-restarts", "3",
             "--oracle-wait", str(args.oracle_wait)]
    if "fault" in trial.plan:
        extra += ["--fault", trial.plan["fault"]]
    cmd = launcher_cmd(job, run_dir, *extra)
    t0 = time.monotonic()
    started = time.time()
    load_before = load_avg()
    with open(os.path.join(args.work, f"{run}.launcher.err"), "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=dict(env(), CKPTD_TOKEN=REPORT), stdout=subprocess.DEVNULL,
                                stderr=err)
    stop = threading.Event()
    threads = [threading.Thread(target=chaos, args=(job, run_dir, serve, trial, rng, stop, t0), daemon=True),
               threading.Thread(target=watch_resumes, args=(job, run_dir, ref, trial, stop, t0), daemon=True)]
    for t in threads:
        t.start()
    try:
        rc = proc.wait(args.trial_timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the launcher stops its ranks on SIGTERM
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        trial.problems.append(f"launcher still running after {args.trial_timeout:.0f}s")
    threads[0].join(60)  # a daemon restart in flight finishes
    time.sleep(0.3)
    stop.set()
    threads[1].join(5)
    serve.ensure_up()
    lines = launcher_lines(run_dir)
    decisions = [l.split(" ", 1)[1] for l in lines]

    # 1. finished, and the fault happened
    if rc != 0 or not any("event=finished" in l for l in decisions):
        trial.problems.append(f"launcher exit {rc}: {decisions[-1] if decisions else 'no log'}")
    failed = [l for l in decisions if "event=rank_failed" in l]
    if kind == "daemon-kill":
        if not trial.plan.get("daemon_was_down"):
            trial.problems.append("fault missed: the job finished before ckptd was killed")
    elif not failed:
        trial.problems.append("fault missed: no rank failure was logged")
    # 2. bitwise equal to the reference
    want, got = losses(ref), losses(run_dir)
    if sorted(got) != list(range(1, job.steps + 1)):
        trial.problems.append(f"steps with a loss: {sorted(got)}")
    diff = [s for s, entries in got.items() if s in want and {h for _, h in entries} != {want[s][0][1]}]
    if diff:
        trial.problems.append(f"losses differ from the uninterrupted run at steps {diff}")
    for r in range(job.world):
        if read(shard_path(run_dir, r, job.steps)) != read(shard_path(ref, r, job.steps)):
            trial.problems.append(f"rank {r}'s final shard differs from the uninterrupted run")
    # 3. every resume from a verified, intact step
    states = catalog_states(serve, run)
    for res in trial.resumes:
        if res["step"] is None:
            if res["newest_intact"] is not None:
                trial.notes.append(f"fresh: attempt {res['attempt']} started fresh, intact save "
                                   f"{res['newest_intact']} existed")
            continue
        if not res["intact"] or not all(res["intact"].values()):
            trial.problems.append(f"BAD RESUME: attempt {res['attempt']} resumed from step {res['step']} whose "
                                  f"shards were not intact (ranks {res['intact']})")
        if states.get(res["step"]) != "verified":
            trial.problems.append(f"BAD RESUME: attempt {res['attempt']} resumed from step {res['step']}, which "
                                  f"ckptd now calls {states.get(res['step'])}")
        if res["newest_intact"] is not None and res["step"] < res["newest_intact"]:
            trial.notes.append(f"older: resumed from {res['step']}, newest intact save was {res['newest_intact']}")
    restarts = sum(1 for l in decisions if re.search(r"attempt=[1-9]\d* event=(resume|fresh_start)", l))
    if restarts != len(trial.resumes):
        trial.problems.append(f"{restarts} restart decisions logged, {len(trial.resumes)} checked")
    # 4. the catalog is true
    truth: dict[int, str] = {}
    for _, _, step in committed_saves(run_dir, job.world):
        ok = all(intact(run_dir, ref, r, step) for r in range(job.world))
        truth[step] = "verified" if ok else "corrupt"
    try:  # ckptd's own barrier: every save committed so far judged (docs/API.md)
        get_json(f"{serve.url}/v1/runs/{run}/settled?wait=90", timeout=120)
    except (OSError, ValueError) as err:
        trial.notes.append(f"settled barrier: {err}")
    states = catalog_states(serve, run)
    wrong = {s: (states.get(s), t) for s, t in truth.items() if states.get(s) != t}
    if wrong:
        trial.problems.append("catalog untrue: " + ", ".join(f"step {s} is {g}, on disk {t}"
                                                             for s, (g, t) in sorted(wrong.items())))
    waits = sum("event=oracle-wait" in l for l in decisions)
    record = {
        "index": index, "kind": kind, "seed": seed, "plan": trial.plan, "passed": not trial.problems,
        "problems": trial.problems, "notes": trial.notes, "events": trial.events, "resumes": trial.resumes,
        "restarts": len(failed), "oracle_waits": waits, "catalog": {str(k): v for k, v in sorted(states.items())},
        "seconds": round(time.monotonic() - t0, 1), "started": round(started, 1), "load_before": load_before,
        "load_after": load_avg(), "job": job.key(), "decisions": decisions,
    }
    return record


# --- campaign ------------------------------------------------------------------------------------


def read_records(path: str) -> list[dict]:
    try:
        with open(path) as fh:
            return [json.loads(line) for line in fh if line.strip()]
    except OSError:
        return []


def missed(record: dict) -> bool:
    """The fault never happened (the job ended first): not a trial of anything, whatever else held."""
    return bool(record["problems"]) and all(p.startswith("fault missed") for p in record["problems"])


def summary(records: list[dict]) -> str:
    out = []
    valid = [r for r in records if not missed(r)]
    passed = sum(r["passed"] for r in valid)
    bad = sum(any("BAD RESUME" in p for p in r["problems"]) for r in valid)
    out.append(f"trials passed: {passed} / {len(valid)}   bad resumes: {bad}   "
               f"(+ {len(records) - len(valid)} where the fault was missed: the job ended first)")
    kinds = sorted({r["kind"] for r in records}, key=lambda k: KINDS.index(k) if k in KINDS else 99)
    out.append("| kind | trials | passed | fault missed | restarts | resumed from step (none = fresh) | "
               "oracle-wait lines | restarts older than the newest intact save |")
    out.append("|---|---|---|---|---|---|---|---|")
    for k in kinds:
        rs = [r for r in valid if r["kind"] == k]
        older = sum(any(n.startswith(("older", "fresh")) for n in r["notes"]) for r in rs)
        steps = " ".join(str(x["step"]) if x["step"] is not None else "none" for r in rs for x in r["resumes"])
        out.append(f"| {k} | {len(rs)} | {sum(r['passed'] for r in rs)} | "
                   f"{sum(missed(r) for r in records if r['kind'] == k)} | {sum(r['restarts'] for r in rs)} | "
                   f"{steps} | {sum(r['oracle_waits'] for r in rs)} | {older} |")
    for r in records:
        if not r["passed"]:
            what = "MISSED" if missed(r) else "FAILED"
            out.append(f"{what} trial {r['index']} ({r['kind']}, seed {r['seed']}): " + "; ".join(r["problems"]))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/chaos.py", description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of: " + ", ".join(KINDS))
    p.add_argument("--seed", type=int, default=15, help="trial i draws from seed*100000+i")
    p.add_argument("--work", default="/tmp/ckptd-chaos", help="ckptd root, catalog, reference run, trials.jsonl")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--heartbeat-timeout", type=float, default=8.0)
    p.add_argument("--oracle-wait", type=float, default=120.0)
    p.add_argument("--trial-timeout", type=float, default=600.0)
    p.add_argument("--summary", action="store_true", help="only print the summary of the trials recorded so far")
    args = p.parse_args(argv)
    args.work = os.path.abspath(args.work)
    os.makedirs(args.work, exist_ok=True)
    record_path = os.path.join(args.work, "trials.jsonl")
    if args.summary:
        print(summary(read_records(record_path)))
        return 0
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise SystemExit(f"chaos: unknown kinds {unknown}")
    job = Job(args.tp, args.dp, args.steps, args.save_every, args.micro_batch)
    ref = reference(job, args.work)
    port_file = os.path.join(args.work, "port")
    port = free_port()
    if os.path.exists(port_file):
        with open(port_file) as fh:
            port = int(fh.read())
    with open(port_file, "w") as fh:
        fh.write(str(port))
    serve = Serve(args.work, port)
    first = len(read_records(record_path))
    print(f"chaos: {args.trials} trials from #{first}, job {job.key()}, load {load_avg()}, work {args.work}", flush=True)
    try:
        serve.ensure_up()
        for i in range(first, first + args.trials):
            kind = kinds[i % len(kinds)]
            rec = run_trial(job, ref, serve, i, kind, args.seed * 100000 + i, args)
            with open(record_path, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            verdict = "PASS" if rec["passed"] else "FAIL"
            print(f"trial {i:3d} {kind:15s} {verdict} {rec['seconds']:6.1f}s restarts={rec['restarts']} "
                  f"waits={rec['oracle_waits']} resumes={[r['step'] for r in rec['resumes']]} "
                  f"load={rec['load_after']} {'; '.join(rec['problems'] + rec['notes'])[:300]}", flush=True)
    finally:
        serve.stop()
    records = read_records(record_path)
    print(summary(records))
    return 0 if all(r["passed"] or missed(r) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
