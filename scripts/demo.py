"""`make demo`: a sharded MindSpore job loses a rank, asks ckptd where to resume, and trains on exactly.

1. `ckptd serve` starts (embedded SQLite catalog, loopback) watching ./demo-out/checkpoints.
2. The launcher starts a real 4-rank job under msrun (tensor parallel 2 x data parallel 2, a small
   Llama on CPU) that checkpoints every few steps with async per-rank saves, and copies its state
   into the node's shared memory after every step (the memory tier: flash checkpoints). Fault
   injection SIGKILLs rank 2 two steps after a file save.
3. The launcher notices, stops the job, asks ckptd's resume oracle, and restarts from the step ckptd
   says is whole and verified: the step before the kill, from memory, not the file save. The loss
   curve continues bit for bit.
4. What ckptd knows: `ckptd ls`, the resume answer; then the file tools on one shard, and a flipped
   bit caught by `ckptd verify` (and by the daemon, which moves the resume point back).
5. Elastic restart: the node of ranks 2-3 is gone for good. The launcher relaunches the job on the 2
   remaining ranks (tp 2 x dp 1, same global batch); ckptd's oracle answers with a 4-rank step, so the
   launcher has ckptd re-shard it (POST /v1/runs/llama/conversions) and resumes from the converted
   copy. Steps trained again on 2 ranks give the 4-rank losses (to float rounding: sums run in
   another order). The 2-rank job saves step 30 again: ckptd re-binds the step to the new layout
   and judges that save alone (verified); ranks 2-3's old files (one of them the bit flipped in
   part 4) stay on disk as superseded history instead of keeping the step corrupt.
6. The same kind of job as MindFormers 2.1.0 writes it (`--layout mindformers`, a second, shorter
   2-rank run): `checkpoint/rank_<r>/llama_rank_<r>-<epoch>_<step in epoch>.ckpt`, a lagging
   `meta.json` per rank, `strategy/ckpt_strategy_rank_<r>.ckpt`. A rank is killed; the launcher
   resumes from ckptd's answer (GET /v1/runs/llama-mf/resume names every rank's MindFormers shard)
   and the restart into the same directory writes MindFormers' next-incarnation `..._rank_<r>_1-...`
   files, the recomputed steps bit for bit.
7. A 4-rank MindFormers-layout job (tp 2 x pp 2, per-rank stage strategy files) written by the real
   mindspore.save_checkpoint (scripts/demo_mf_pp.py): one shard torn, the next save missing a rank.
   `ckptd resume --run` answers the newest whole step and says why the other two are skipped; a save
   written while ckptd runs is answered within a second.
Everything lands in ./demo-out (recreated on each run).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from demo_mf_pp import mindformers_pp_run  # part 7 (scripts/ is on sys.path: this file runs as a script)

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "demo-out"
ROOT = OUT / "checkpoints"
RUN = "llama"
RUN_DIR = ROOT / RUN
TP, DP = 2, 2
STEPS, SAVE_EVERY = 30, 5
FAULT_RANK, FAULT_STEP = 2, 23  # rank 2 is SIGKILLed at the start of step 23 (last save: step 20)
ELASTIC_TP, ELASTIC_DP, ELASTIC_STEPS = 2, 1, 35  # part 5: continue on 2 ranks to step 35
TOTAL_STEPS = ELASTIC_STEPS  # one lr schedule for both jobs, so part 5 continues the same training
MICRO_BATCH = 2  # per dp rank: the global batch is MICRO_BATCH * DP sequences in every layout
# part 6: a MindFormers-layout job (its output_dir is RUN_MF_DIR); epochs of MF_SPE steps name the files
RUN_MF = "llama-mf"
RUN_MF_DIR = ROOT / RUN_MF
MF_TP, MF_DP, MF_STEPS, MF_SAVE_EVERY, MF_SPE = 2, 1, 12, 4, 8
MF_FAULT_RANK, MF_FAULT_STEP = 1, 11  # last save before the kill: global step 8 = epoch 1, step 8
#: losses of one step computed in two layouts agree to float rounding (the all-reduces sum in another order)
LAYOUT_TOLERANCE = 1e-5
MODEL = ["--hidden", "64", "--heads", "4", "--ffn", "128", "--layers", "2", "--seq", "32",
         "--warmup", "5", "--lr", "5e-3", "--total-steps", str(TOTAL_STEPS)]
BOLD, DIM, RED, GREEN, OFF = ("\033[1m", "\033[2m", "\033[31m", "\033[32m", "\033[0m") if sys.stdout.isatty() \
    else ("", "", "", "", "")
_print_lock = threading.Lock()


def say(text: str = "") -> None:
    with _print_lock:
        print(text.replace(str(OUT), "demo-out"), flush=True)


def banner(text: str) -> None:
    say(f"\n{BOLD}== {text}{OFF}")


def ckptd(*args: str, env: dict[str, str], head: int | None = None, tail: int = 0, width: int | None = None) -> int:
    """Run and show one ckptd CLI command (optionally abridged to its first/last lines, each line to
    ``width`` characters)."""
    say(f"$ ckptd {' '.join(args)}")
    proc = subprocess.run([sys.executable, "-m", "ckptd", *args], env=env, cwd=REPO, capture_output=True, text=True,
                          check=False)
    lines = (proc.stdout + proc.stderr).rstrip("\n").splitlines()
    if head is not None and len(lines) > head + tail + 1:
        lines = lines[:head] + [f"{DIM}  ... {len(lines) - head - tail} more lines ...{OFF}"] + lines[-tail:]
    for line in lines:
        say(f"  {line if width is None or len(line) <= width else line[:width] + ' ...'}")
    say(f"{DIM}  (exit code {proc.returncode}){OFF}")
    return proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as err:
        return json.loads(err.read())


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def wait_until(predicate, what: str, timeout: float = 60.0, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: timed out waiting for {what} (see {OUT / 'ckptd.log'})")
        time.sleep(interval)


class LossCurve:
    """Tails rank 0's metrics.jsonl and prints one line per step; marks each resume and checks steps
    trained again against their first computation: bit for bit in the same layout, to
    LAYOUT_TOLERANCE in another one (``earlier`` = losses of the previous job, by step)."""

    def __init__(self, path: Path, earlier: dict[int, dict] | None = None, layout_note: str = "") -> None:
        self.path, self.stop = path, threading.Event()
        self.start = path.stat().st_size if path.exists() else 0  # only this job's lines
        self.earlier = earlier or {}
        self.layout_note = layout_note
        self.seen: dict[int, dict] = {}  # step -> this job's first computation of it
        self.attempt: int | None = None
        self.recomputed: list[tuple[int, bool, float]] = []  # (step, same, |difference|)
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        pos, buf = self.start, ""
        while not self.stop.is_set() or os.path.exists(self.path) and os.path.getsize(self.path) > pos:
            if os.path.exists(self.path):
                with open(self.path) as fh:
                    fh.seek(pos)
                    buf += fh.read()
                    pos = fh.tell()
                *done, buf = buf.split("\n")
                for line in done:
                    if line.strip():
                        self._show(json.loads(line))
            time.sleep(0.1)

    def _show(self, d: dict) -> None:
        step, loss = d["step"], d["loss"]
        if d["attempt"] != self.attempt:
            if self.attempt is not None or self.earlier:
                say(f"  {BOLD}---- attempt {d['attempt']}{self.layout_note}: resumed, training continues "
                    f"from step {step} ----{OFF}")
            self.attempt = d["attempt"]
        note = ""
        if step in self.seen:  # same job, same layout: must be bitwise
            same = self.seen[step]["loss_hex"] == d["loss_hex"]
            self.recomputed.append((step, same, abs(self.seen[step]["loss"] - loss)))
            note = f"{GREEN}= attempt 0, bit for bit{OFF}" if same else f"{RED}differs from attempt 0!{OFF}"
        elif step in self.earlier:  # the previous job, another layout: float rounding apart
            diff = abs(self.earlier[step]["loss"] - loss)
            same = diff <= LAYOUT_TOLERANCE
            self.recomputed.append((step, same, diff))
            exact = "the same float" if diff == 0 else f"|diff| {diff:.1e}"
            note = (f"{GREEN}= 4-rank loss ({exact}){OFF}" if same
                    else f"{RED}differs from the 4-rank loss by {diff:.1e}!{OFF}")
            self.seen[step] = d
        else:
            self.seen[step] = d
        saved = f"  saved step {step}" if d["save_s"] > 0 else ""
        bar = "#" * max(1, int((loss - 2.0) * 12))
        say(f"  step {step:3d}  loss {loss:.4f}  {DIM}{bar:<45}{OFF}{note}{saved}")
        self.first_loss = self.first_loss if self.first_loss is not None else loss
        self.last_loss = loss


def run_launcher(cmd: list[str], env: dict[str, str], curve: LossCurve) -> tuple[int, list[str]]:
    """Run the launcher, echo its decisions (``launch:`` lines) and the loss curve as they come."""
    curve.thread.start()
    launcher = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    decisions = []
    try:
        for line in launcher.stderr:
            if line.startswith("launch:"):
                decisions.append(line.rstrip())
                say(f"  {BOLD}{line.rstrip()}{OFF}")
        rc = launcher.wait()
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)  # the launcher then stops every rank it started
            launcher.wait(30)
        curve.stop.set()
        curve.thread.join()
    return rc, decisions


def fail(what: str) -> int:
    say(f"{RED}demo failed: {what}{OFF}")
    return 1


def main() -> int:
    t_start = time.monotonic()
    shutil.rmtree(OUT, ignore_errors=True)
    ROOT.mkdir(parents=True)
    db = f"sqlite:///{OUT / 'catalog.db'}"
    env = dict(os.environ, CKPTD_DB=db, CKPTD_ROOT=str(ROOT), GLOG_v="3", PYTHONPATH=str(REPO))
    env.pop("CKPTD_TOKENS", None)
    env.pop("CKPTD_TOKEN", None)

    banner("1. Start ckptd: catalog on embedded SQLite, API on loopback, watching demo-out/checkpoints")
    ckptd("db", "upgrade", env=env)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(OUT / "ckptd.log", "wb")  # noqa: SIM115 -- the daemon's log for the whole demo
    server = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", str(ROOT), "--port", str(port)],
                              env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    say(f"$ ckptd serve --root {ROOT} --port {port} &")
    try:
        wait_until(lambda: get(f"{url}/healthz").get("first_rescan_done"), "ckptd to start")
        say(f"  ckptd is up: {url}  (log: {OUT / 'ckptd.log'})")

        banner(f"2. A 4-rank job (tp={TP} x dp={DP}) through the launcher; rank {FAULT_RANK} will be killed "
               f"at step {FAULT_STEP}")
        cmd = [sys.executable, "-m", "trainer.launch", "--run-dir", str(RUN_DIR), "--tp", str(TP), "--dp", str(DP),
               "--ckptd-url", url, "--backoff", "0.5", "--fault", f"kill:{FAULT_RANK}:{FAULT_STEP}",
               "--", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--micro-batch", str(MICRO_BATCH),
               "--snapshot-every", "1", *MODEL]
        say(f"$ python -m trainer.launch --run-dir {RUN_DIR} --tp {TP} --dp {DP} --ckptd-url {url} \\\n"
            f"      --fault kill:{FAULT_RANK}:{FAULT_STEP} -- --steps {STEPS} --save-every {SAVE_EVERY} "
            f"--snapshot-every 1 ...")
        say(f"{DIM}  (launch: lines are the launcher's decisions; step lines are rank 0's loss as it trains){OFF}")
        curve = LossCurve(RUN_DIR / "metrics.jsonl")
        rc, decisions = run_launcher(cmd, env, curve)
        if rc != 0:
            return fail(f"the launcher exited {rc}; see {RUN_DIR / 'launcher.log'}")
        same = sum(ok for _, ok, _ in curve.recomputed)
        say(f"\n  loss {curve.first_loss:.3f} -> {curve.last_loss:.3f} over {STEPS} steps; "
            f"{len(curve.recomputed)} steps trained again after the resume, {same} of them bit-for-bit identical")
        if same != len(curve.recomputed):
            return fail("the steps trained again after the resume should have had bit-for-bit the same loss")
        first_answer = json.loads((RUN_DIR / "launcher" / "resume_1.json").read_text())
        last_save = (FAULT_STEP - 1) // SAVE_EVERY * SAVE_EVERY
        if first_answer.get("tier") != "memory" or first_answer["step"] <= last_save:
            return fail(f"the restart should have resumed from memory after step {last_save}'s file save; "
                        f"ckptd answered step {first_answer['step']} from {first_answer.get('tier')}")
        say(f"  {GREEN}resumed from memory at step {first_answer['step']}{OFF}: rank {FAULT_RANK} died at the start "
            f"of step {FAULT_STEP}, so {FAULT_STEP - 1 - first_answer['step']} step(s) of work were lost -- from the "
            f"last file save (step {last_save}) it would have been {FAULT_STEP - 1 - last_save}")

        banner("3. What ckptd knows")
        failed = next((d for d in decisions if "event=rank_failed" in d), "")
        resumed = next((d for d in decisions if "event=resume" in d), "")
        say(f"  the launcher saw:   {failed.split('event=', 1)[-1]}")
        say(f"  and ckptd told it:  {resumed.split('event=', 1)[-1]}")
        answer_file = RUN_DIR / "launcher" / "resume_1.json"
        if answer_file.exists():
            answer = json.loads(answer_file.read_text())
            say(f"  the resume answer it got (GET /v1/runs/{RUN}/resume, saved as {answer_file}):")
            head = {k: answer.get(k) for k in ("run", "step", "tier", "epoch", "global_step", "world_size",
                                                "strategy_file")}
            say(f"    {json.dumps(head)[:-1]},")
            say('     "shards": [')
            for s in answer["shards"]:
                say(f"       {json.dumps(s)},")
            say(f'     ], "skipped": {json.dumps(answer["skipped"])}, "conversion": {json.dumps(answer["conversion"])}}}')
            why = "; ".join(f"step {x['step']}: {x['reason']}" for x in answer["skipped"]) or \
                "nothing newer was saved before the kill"
            where = ("snapshots, one per rank in its node's shared memory, are all committed and verified "
                     "(digest, one global step, shapes against the strategy)") if answer.get("tier") == "memory" else \
                "shards are all verified (structure, CRC, the trainer's size+digest sidecar, step-level checks)"
            say(f"  why step {answer['step']}: the newest step whose {len(answer['shards'])} {where}; skipped: {why}")
        wait_until(lambda: get(f"{url}/v1/runs/{RUN}/resume").get("step") == STEPS, "ckptd to verify the last step")
        ckptd("ls", env=env)
        ckptd("ls", RUN, env=env)

        banner("4. File tools on one shard, and a flipped bit")
        shard = RUN_DIR / f"rank_{FAULT_RANK}" / f"llama-1_{STEPS}.ckpt"
        ckptd("inspect", str(shard), env=env, head=8, tail=8)
        os.chmod(shard, 0o600)  # MindSpore leaves shards read-only
        with open(shard, "r+b") as fh:
            fh.seek(shard.stat().st_size // 2)
            byte = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([byte[0] ^ 0x08]))
        say(f"  (flipped one bit in the middle of {shard})")
        ckptd("verify", str(shard), env=env)
        say(f"$ curl -X POST {url}/v1/runs/{RUN}/verify -H 'Content-Type: application/json' -d '{{\"step\": {STEPS}}}'")
        say(f"{DIM}  (an operator re-verifies the step){OFF}")
        job = post(f"{url}/v1/runs/{RUN}/verify", {"step": STEPS})
        wait_until(lambda: get(f"{url}/v1/jobs/{job['id']}")["state"] in ("done", "failed"), "the verify job")
        say(f"  {json.dumps(get(f'{url}/v1/jobs/' + str(job['id'])).get('result'))}")
        wait_until(lambda: get(f"{url}/v1/runs/{RUN}/resume").get("step") != STEPS, "ckptd to rule out the step")
        say(f"  step {STEPS} is now corrupt in the catalog; a restart now would be told:")
        ckptd("resume", "--run", RUN, env=env)

        rc = elastic_restart(url, env, curve.seen)
        if rc != 0:
            return rc
        rc = mindformers_run(url, env)
        if rc != 0:
            return rc
        rc = mindformers_pp_run(url, ROOT, env, say=say, banner=banner, ckptd=ckptd, get=get,
                                wait_until=wait_until, fail=fail)
        if rc != 0:
            return rc
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    banner(f"Done in {time.monotonic() - t_start:.0f}s. Catalog, checkpoints, launcher and daemon logs: {OUT}")
    return 0


def elastic_restart(url: str, env: dict[str, str], earlier: dict[int, dict]) -> int:
    """Part 5: the job continues on fewer ranks from ckptd's re-sharded copy of its newest verified step."""
    world = ELASTIC_TP * ELASTIC_DP
    micro_batch = MICRO_BATCH * DP // ELASTIC_DP  # the same global batch on fewer dp ranks
    banner(f"5. The node of ranks {world}-{TP * DP - 1} is gone for good: continue on the {world} remaining ranks "
           f"(tp={ELASTIC_TP} x dp={ELASTIC_DP}) through ckptd's conversion")
    cmd = [sys.executable, "-m", "trainer.launch", "--run-dir", str(RUN_DIR), "--tp", str(ELASTIC_TP),
           "--dp", str(ELASTIC_DP), "--ckptd-url", url, "--backoff", "0.5", "--max-restarts", "0",
           "--", "--steps", str(ELASTIC_STEPS), "--save-every", str(SAVE_EVERY), "--micro-batch", str(micro_batch),
           *MODEL]
    say(f"$ python -m trainer.launch --run-dir {RUN_DIR} --tp {ELASTIC_TP} --dp {ELASTIC_DP} --ckptd-url {url} \\\n"
        f"      -- --steps {ELASTIC_STEPS} --save-every {SAVE_EVERY} --micro-batch {micro_batch} ...")
    say(f"{DIM}  (the same global batch: {micro_batch} sequences x dp {ELASTIC_DP}, was {MICRO_BATCH} x dp {DP}. "
        f"ckptd's newest verified step has {TP * DP} shards, so the launcher has ckptd re-shard it for "
        f"{world} ranks){OFF}")
    curve = LossCurve(RUN_DIR / "metrics.jsonl", earlier=earlier, layout_note=f" on {world} ranks")
    rc, decisions = run_launcher(cmd, env, curve)
    if rc != 0:
        return fail(f"the relaunch on {world} ranks exited {rc}; see {RUN_DIR / 'launcher.log'}")
    if not any("event=convert_done" in d or "event=convert_existing" in d for d in decisions):
        return fail("the launcher resumed without a converted copy")
    answer = json.loads((RUN_DIR / "launcher" / "resume_0.json").read_text())
    say(f"\n  the {world} ranks loaded ckptd's re-sharded copy of step {answer['step']} (one file per new rank):")
    for s in answer["shards"]:
        say(f"    rank {s['rank']}: {s['path']}")
    conversion = get(f"{url}/v1/runs/{RUN}/conversions")[0]
    say(f"$ curl {url}/v1/runs/{RUN}/conversions")
    say(f"  [{{\"source_step\": {conversion['source_step']}, \"state\": \"{conversion['state']}\", "
        f"\"source_strategy_hash\": \"{conversion['source_strategy_hash'][:19]}...\", "
        f"\"target_strategy_hash\": \"{conversion['target_strategy_hash'][:19]}...\", ...}}]")
    worst = max((diff for _, _, diff in curve.recomputed), default=0.0)
    same = sum(ok for _, ok, _ in curve.recomputed)
    say(f"\n  loss {curve.first_loss:.3f} -> {curve.last_loss:.3f}; {len(curve.recomputed)} steps trained again on "
        f"{world} ranks, {same} of them within {LAYOUT_TOLERANCE:.0e} of the {TP * DP}-rank loss "
        f"(largest difference {worst:.1e}: the all-reduces sum in another order)")
    if not curve.recomputed or same != len(curve.recomputed):
        return fail(f"steps trained again on {world} ranks should match the {TP * DP}-rank losses")
    return resaved_step(url, env, world)


def resaved_step(url: str, env: dict[str, str], world: int) -> int:
    """Step STEPS, corrupt on 4 ranks since part 4, was saved again by the 2-rank job."""
    step_url = f"{url}/v1/runs/{RUN}/steps/{STEPS}"

    def resaved() -> bool:
        doc = get(step_url)
        return doc.get("state") == "verified" and doc.get("expected_ranks") == world

    say(f"\n  the {world}-rank job saved step {STEPS} again, over the {TP * DP}-rank save that part 4 left corrupt:")
    wait_until(resaved, f"ckptd to verify the {world}-rank save of step {STEPS}")
    doc = get(step_url)
    ranks = [s["rank"] for s in get(f"{step_url}/shards")]
    history = [x for x in get(f"{url}/v1/runs/{RUN}/steps") if x["step"] == STEPS and x["kind"] == "superseded"]
    say(f"$ curl {step_url}")
    say(f'  {{"step": {doc["step"]}, "state": "{doc["state"]}", "restorable": {json.dumps(doc["restorable"])}, '
        f'"expected_ranks": {doc["expected_ranks"]}, ...}}   shards of ranks {ranks}')
    for h in history:
        say(f"  superseded history of step {STEPS} (files left on disk): {h['reason']}")
    ckptd("ls", RUN, env=env)
    if doc.get("state") != "verified" or ranks != list(range(world)) or not history:
        return fail(f"step {STEPS} should be the verified {world}-rank save, the old ranks superseded")
    return 0


def mf_epoch_step(step: int) -> tuple[int, int]:
    """MindSpore's (epoch, step in epoch) of a global step in MF_SPE-step epochs."""
    return (step - 1) // MF_SPE + 1, (step - 1) % MF_SPE + 1


def mindformers_run(url: str, env: dict[str, str]) -> int:
    """Part 6: a job in MindFormers' legacy layout loses a rank and resumes from ckptd's answer."""
    world = MF_TP * MF_DP
    banner(f"6. The same kind of job as MindFormers 2.1.0 writes it (--layout mindformers, tp={MF_TP} x dp={MF_DP}); "
           f"rank {MF_FAULT_RANK} will be killed at step {MF_FAULT_STEP}")
    cmd = [sys.executable, "-m", "trainer.launch", "--run-dir", str(RUN_MF_DIR), "--layout", "mindformers",
           "--tp", str(MF_TP), "--dp", str(MF_DP), "--ckptd-url", url, "--backoff", "0.5", "--max-restarts", "1",
           "--settle-timeout", "20", "--fault", f"kill:{MF_FAULT_RANK}:{MF_FAULT_STEP}",
           "--", "--steps", str(MF_STEPS), "--save-every", str(MF_SAVE_EVERY), "--steps-per-epoch", str(MF_SPE),
           "--micro-batch", str(MICRO_BATCH * DP // MF_DP), *MODEL]
    say(f"$ python -m trainer.launch --run-dir {RUN_MF_DIR} --layout mindformers --tp {MF_TP} --dp {MF_DP} "
        f"--ckptd-url {url} \\\n      --fault kill:{MF_FAULT_RANK}:{MF_FAULT_STEP} -- --steps {MF_STEPS} "
        f"--save-every {MF_SAVE_EVERY} --steps-per-epoch {MF_SPE} ...")
    say(f"{DIM}  (--run-dir is MindFormers' output_dir; files are named by epoch and step within the epoch, "
        f"{MF_SPE} steps per epoch){OFF}")
    curve = LossCurve(RUN_MF_DIR / "metrics.jsonl")
    rc, decisions = run_launcher(cmd, env, curve)
    if rc != 0:
        return fail(f"the MindFormers-layout job's launcher exited {rc}; see {RUN_MF_DIR / 'launcher.log'}")
    resumed = next((d for d in decisions if "attempt=1 event=resume " in d), None)
    if resumed is None:
        return fail("the MindFormers-layout job was not resumed from ckptd's answer "
                    "(does this ckptd catalogue runs in the MindFormers layout?); see "
                    f"{RUN_MF_DIR / 'launcher.log'} and {OUT / 'ckptd.log'}")
    same = sum(ok for _, ok, _ in curve.recomputed)
    say(f"\n  {len(curve.recomputed)} steps trained again after the resume, {same} of them bit-for-bit identical")
    if not curve.recomputed or same != len(curve.recomputed):
        return fail("the steps trained again after the resume should have had bit-for-bit the same loss")

    answer = json.loads((RUN_MF_DIR / "launcher" / "resume_1.json").read_text())
    resumed_step = (MF_FAULT_STEP - 1) // MF_SAVE_EVERY * MF_SAVE_EVERY
    epoch, in_epoch = mf_epoch_step(resumed_step)
    want = [{"rank": r, "path": str(RUN_MF_DIR / "checkpoint" / f"rank_{r}"
                                     / f"llama_rank_{r}-{epoch}_{in_epoch}.ckpt")}
            for r in range(world)]
    say(f"  ckptd's answer (GET /v1/runs/{RUN_MF}/resume, saved as {RUN_MF_DIR / 'launcher' / 'resume_1.json'}):")
    head = {k: answer.get(k) for k in ("step", "epoch", "name_step", "world_size", "strategy_file")}
    say(f"    {json.dumps(head)[:-1]},")
    say(f'     "shards": {json.dumps(answer.get("shards"))}')
    if answer.get("mindformers") is not None:
        say(f'     "mindformers": {json.dumps(answer["mindformers"])}  {DIM}(what MindFormers\' own loader takes){OFF}')
    say("    ...}")
    got = sorted(({"rank": x["rank"], "path": x["path"]} for x in answer.get("shards") or []), key=lambda x: x["rank"])
    if answer.get("step") != resumed_step or got != want:
        return fail(f"ckptd should have answered step {resumed_step} with the ranks' MindFormers shards {want}")

    say("\n  what the job left in its output_dir (MindFormers' legacy layout; the restart wrote the next "
        "incarnation's _1 files):")
    final_epoch, final_in_epoch = mf_epoch_step(MF_STEPS)
    for r in range(world):
        rank_dir = RUN_MF_DIR / "checkpoint" / f"rank_{r}"
        names = sorted(n for n in os.listdir(rank_dir) if n.endswith(".ckpt"))
        say(f"    checkpoint/rank_{r}/  {'  '.join(names)}")
        say(f"    checkpoint/rank_{r}/meta.json  {(rank_dir / 'meta.json').read_text()}  "
            f"{DIM}(MindFormers' own hint: lags, never names the last async save){OFF}")
        if f"llama_rank_{r}_1-{final_epoch}_{final_in_epoch}.ckpt" not in names:
            return fail(f"rank {r}'s restart should have written llama_rank_{r}_1-{final_epoch}_{final_in_epoch}.ckpt")
    say(f"    strategy/  {'  '.join(sorted(os.listdir(RUN_MF_DIR / 'strategy')))}")
    wait_until(lambda: get(f"{url}/v1/runs/{RUN_MF}/resume").get("step") == MF_STEPS,
               f"ckptd to verify step {MF_STEPS} of {RUN_MF}")
    ckptd("ls", RUN_MF, env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
