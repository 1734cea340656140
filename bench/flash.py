"""Benchmark: flash checkpoints (the memory tier, issue 22) against their baselines, side by side.

1. Stall per snapshot, per-rank state of ``--sizes`` MiB (MindSpore parameters of the trainer's
   dtype, float32): ckptd's ``FlashWriter.snapshot`` (the copy; hash and commit run after, in the
   background), MindSpore's ``save_checkpoint(async_save=True)`` (what the call holds the caller
   for), and a plain ``numpy.copyto`` of the same bytes into a mapped buffer (the memcpy limit).
   Then the load: ``flash.load_into`` against the same memcpy, two ways: hashing while it copies
   (no verdict given), and copying only (the resume answer's ``digest``, the one the daemon
   verified, is the slot's; what a restore from a daemon's answer does). Medians of ``--repeat`` after two warm-up rounds per slot.
2. The daemon's side: CPU seconds and bytes read per persisted byte (``MemoryTier`` catalogues a
   committed snapshot of a persist step and writes it as a ``.ckpt``), in this process.
3. Step-time overhead of a snapshot on the trainer's default model (one rank): in one process
   (``--snapshot-every 2``), the median wall time of a step that snapshots against one that does not.
4. Recovery (``--recovery``): a real ``ckptd serve``, ``trainer.launch`` tp=2; rank 1 is SIGKILLed
   at step ``--kill-step``; memory tier (snapshot every step) against the file tier (a save every
   ``--save-every`` steps): death -> first trained step after the restart, and the steps lost.

Run: ``.venv/bin/python bench/flash.py [--sizes 50,500,2048] [--recovery]``; record the machine's load.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SHM = "/dev/shm"
CHUNK = 16 << 20  # bytes per parameter: a model's state is many tensors, not one


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    env.setdefault("GLOG_v", "3")
    return env


def _params(ms, np, mib: int):
    n, rest = divmod(mib << 20, CHUNK)
    sizes = [CHUNK] * n + ([rest] if rest else [])
    rng = np.random.default_rng(0)
    return [ms.Parameter(ms.Tensor(rng.standard_normal(s // 4).astype(np.float32)), name=f"p{i}")
            for i, s in enumerate(sizes)]


def stall_and_load(mib: int, repeat: int, workdir: str) -> dict[str, float]:
    import mmap

    import mindspore as ms
    import numpy as np

    from ckptd.integrations.flash import FlashWriter, load_into
    from ckptd.storage import memslot

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    params = _params(ms, np, mib)
    views = [(p.name, p.asnumpy()) for p in params]
    nbytes = sum(a.nbytes for _, a in views)
    root = tempfile.mkdtemp(prefix="ckptd-bench-", dir=SHM)
    w = FlashWriter(os.path.join(workdir, f"run{mib}"), 0, 1, root=root)
    # the memcpy limit: the same bytes into a shared mapping of tmpfs, pages already faulted in
    fd = os.open(os.path.join(root, "memcpy"), os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, nbytes)
    buf = mmap.mmap(fd, nbytes)
    os.close(fd)
    dst, off = [], 0
    for _, a in views:
        dst.append(np.ndarray(a.shape, a.dtype, buffer=buf, offset=off))
        off += a.nbytes
    out: dict[str, list[float]] = {"memcpy": [], "flash": [], "ms_async": [], "load": [], "load_verified": []}
    ckpt = os.path.join(workdir, "ms.ckpt")
    try:
        for i in range(repeat + 4):
            t0 = time.perf_counter()
            for d, (_, a) in zip(dst, views):
                np.copyto(d, a)
            t_copy = time.perf_counter() - t0
            t_flash = w.snapshot(i + 1, 1, f"rank_0/net-1_{i + 1}.ckpt", views, [("step_num", i + 1)])
            w.wait()
            t0 = time.perf_counter()
            ms.save_checkpoint(params, ckpt, async_save=True)
            t_ms = time.perf_counter() - t0
            for t in __import__("threading").enumerate():
                if t.name == "asyn_save_ckpt":
                    t.join()
            targets = {name: a for name, a in views}
            t0 = time.perf_counter()
            load_into(w.paths[w.newest_slot], targets)
            t_load = time.perf_counter() - t0
            snap = memslot.open_snapshot(w.paths[w.newest_slot])
            digest = snap.digest
            snap.close()
            t0 = time.perf_counter()
            load_into(w.paths[w.newest_slot], targets, verified=digest)
            t_verified = time.perf_counter() - t0
            if i >= 4:  # two snapshots per slot to warm the mappings
                out["memcpy"].append(t_copy)
                out["flash"].append(t_flash)
                out["ms_async"].append(t_ms)
                out["load"].append(t_load)
                out["load_verified"].append(t_verified)
    finally:
        w.release()
        buf.close()
        shutil.rmtree(root, ignore_errors=True)
    return {k: statistics.median(v) for k, v in out.items()} | {"bytes": nbytes}


def daemon_persist(mib: int, workdir: str) -> dict[str, float]:
    import numpy as np
    from sqlalchemy.orm import sessionmaker

    from ckptd.catalog.db import make_engine, upgrade
    from ckptd.integrations.flash import FlashWriter
    from ckptd.service.memtier import MemoryTier
    from ckptd.storage import PosixStorage

    root = os.path.join(workdir, "root")
    os.makedirs(os.path.join(root, "run1"), exist_ok=True)
    shm = tempfile.mkdtemp(prefix="ckptd-bench-", dir=SHM)
    engine = make_engine(f"sqlite:///{workdir}/c.db")
    upgrade(engine)
    tier = MemoryTier(sessionmaker(engine, expire_on_commit=False), PosixStorage(root), shm, "bench", persist_every=1)
    tier.advertise()
    w = FlashWriter(os.path.join(root, "run1"), 0, 1, root=shm)
    rng = np.random.default_rng(0)
    state = [(f"p{i}", rng.standard_normal(CHUNK // 4).astype(np.float32)) for i in range((mib << 20) // CHUNK)]
    try:
        w.snapshot(1, 1, "rank_0/net-1_1.ckpt", state, [("step_num", 1)])
        w.wait()
        c0, t0 = time.process_time(), time.perf_counter()
        tier.scan()
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        written = os.path.getsize(os.path.join(root, "run1", "rank_0", "net-1_1.ckpt"))
    finally:
        w.release()
        shutil.rmtree(shm, ignore_errors=True)
        engine.dispose()
    return {"cpu_s": cpu, "wall_s": wall, "bytes_written": written, "bytes_read": tier.bytes_hashed,
            "ns_per_byte": cpu / written * 1e9}


def step_overhead(steps: int, rounds: int = 3) -> dict[str, float]:
    """Wall time of a step that snapshots against one that does not, in the same process: the
    trainer runs with ``--snapshot-every 2`` and the even steps (with a snapshot) are compared with
    the odd ones. (Two separate runs differ by more than the snapshot costs: PyNative's step time
    moves 10-30 % from one process to the next on this machine, measured.)"""
    walls: dict[str, list[float]] = {"files only": [], "snapshot every step": []}
    snaps: list[float] = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as d:
            shm = tempfile.mkdtemp(prefix="ckptd-bench-", dir=SHM)
            try:
                subprocess.run([sys.executable, "-m", "trainer.train", "--run-dir", d, "--steps", str(steps),
                                "--save-every", "0", "--memory-root", shm, "--snapshot-every", "2"], cwd=REPO,
                               env=_env(), check=True, capture_output=True)
            finally:
                shutil.rmtree(shm, ignore_errors=True)
            with open(os.path.join(d, "metrics.jsonl")) as fh:
                m = [json.loads(line) for line in fh][3:]
            for a, b in itertools.pairwise(m):
                walls["snapshot every step" if b["step"] % 2 == 0 else "files only"].append(b["time"] - a["time"])
            snaps += [x["snap_s"] for x in m if x["step"] % 2 == 0]
    return {k: statistics.median(v) for k, v in walls.items()} | {"snapshot every step snap_s": statistics.median(snaps)}


def recovery(kill_step: int, save_every: int, workdir: str) -> list[tuple[str, float, int, int]]:
    from tests.api_helpers import serve_process, stop_process
    from tests.daemon_helpers import migrated_sqlite

    rows = []
    for label, extra in (("file tier", ["--save-every", str(save_every)]),
                         ("memory tier", ["--save-every", "100", "--snapshot-every", "1"])):
        base = tempfile.mkdtemp(dir=workdir)
        root, shm = os.path.join(base, "root"), tempfile.mkdtemp(prefix="ckptd-bench-", dir=SHM)
        os.makedirs(root)
        proc, client = serve_process(root, migrated_sqlite(os.path.join(base, "c.db")), os.path.join(base, "s.log"),
                                     "--memory-root", shm, "--persist-every", "1000")
        try:
            for _ in range(300):
                try:
                    if client.get("/healthz").json().get("first_rescan_done"):
                        break
                except Exception:  # noqa: BLE001 -- not up yet
                    pass
                time.sleep(0.1)
            run_dir = os.path.join(root, "job")
            subprocess.run([sys.executable, "-m", "trainer.launch", "--run-dir", run_dir, "--tp", "2", "--dp", "1",
                            "--ckptd-url", str(client.base_url), "--backoff", "0.2", "--fault", f"kill:1:{kill_step}",
                            "--", "--steps", str(kill_step + 4), "--memory-root", shm, *extra],
                           cwd=REPO, env=_env(), check=True, capture_output=True, timeout=900)
            with open(os.path.join(run_dir, "heartbeat", "fault_rank_1.json")) as fh:
                died = json.load(fh)["time"]
            with open(os.path.join(run_dir, "launcher", "resume_1.json")) as fh:
                resumed = json.load(fh)["step"]
            with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
                first = min(d["time"] for d in map(json.loads, fh) if d["attempt"] == 1)
            rows.append((label, first - died, resumed, (kill_step - 1) - resumed))
        finally:
            stop_process(proc)
            shutil.rmtree(shm, ignore_errors=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="50,500,2048", help="per-rank state sizes, MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40, help="trainer steps for the overhead run")
    ap.add_argument("--recovery", action="store_true")
    ap.add_argument("--kill-step", type=int, default=17)
    ap.add_argument("--save-every", type=int, default=10)
    args = ap.parse_args()
    print(f"load average before: {open('/proc/loadavg').read().split()[:3]}")
    with tempfile.TemporaryDirectory() as work:
        print("\n| state | memcpy | ckptd snapshot stall | x memcpy | MindSpore async_save stall | ckptd / MindSpore "
              "| load, hashed | x memcpy | load, daemon-verified | x memcpy |\n|---|---|---|---|---|---|---|---|---|---|")
        for mib in (int(x) for x in args.sizes.split(",")):
            r = stall_and_load(mib, args.repeat, work)
            print(f"| {mib} MiB | {r['memcpy'] * 1e3:.1f} ms | {r['flash'] * 1e3:.1f} ms | {r['flash'] / r['memcpy']:.2f} "
                  f"| {r['ms_async'] * 1e3:.1f} ms | 1/{r['ms_async'] / r['flash']:.0f} | {r['load'] * 1e3:.1f} ms "
                  f"| {r['load'] / r['memcpy']:.2f} | {r['load_verified'] * 1e3:.1f} ms "
                  f"| {r['load_verified'] / r['memcpy']:.2f} |", flush=True)
        d = daemon_persist(512, work)
        print(f"\ndaemon, one 512 MiB snapshot of a persist step: {d['cpu_s']:.2f} s CPU, {d['wall_s']:.2f} s wall, "
              f"{d['ns_per_byte']:.2f} ns CPU per persisted byte; slot bytes read {d['bytes_read']} "
              f"(= the snapshot once), file {d['bytes_written']} bytes")
        o = step_overhead(args.steps)
        base, snap = o["files only"], o["snapshot every step"]
        print(f"\nstep time, trainer default model, 1 rank, same process: {base * 1e3:.1f} ms for a step without, "
              f"{snap * 1e3:.1f} ms for a step with a snapshot ({(snap / base - 1) * 100:+.1f} %; the snapshot call "
              f"itself {o['snapshot every step snap_s'] * 1e3:.2f} ms)")
        if args.recovery:
            print("\n| tier | death -> first trained step | resumed at | steps lost |\n|---|---|---|---|")
            for label, secs, resumed, lost in recovery(args.kill_step, args.save_every, work):
                print(f"| {label} | {secs:.1f} s | {resumed} | {lost} |", flush=True)
    print(f"\nload average after: {open('/proc/loadavg').read().split()[:3]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
