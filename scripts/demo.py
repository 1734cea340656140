"""`make demo`: ckptd watching a MindSpore job's checkpoints and answering "where do I resume?".

1. `ckptd serve` starts (embedded SQLite catalog, loopback only) on ./demo-out/checkpoints.
2. A tensor-parallel job (tp=2) saves per-rank shards with MindSpore at steps 100..300.
3. Things go wrong as they do at scale: a node dies in the middle of saving step 400, a bit rots
   in step 300; the launcher asks ckptd where to resume and is told step 200, with the reasons.
4. The file tools: `ckptd inspect` / `ckptd verify` on single shards (also encrypted ones).
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
import time
import urllib.request
from pathlib import Path

import numpy as np

OUT = Path("demo-out").resolve()
ROOT = OUT / "checkpoints"
CKPTD = [sys.executable, "-m", "ckptd"]
TP, D, VOCAB = 2, 128, 256


def banner(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def run(*args: str, show: bool = True) -> int:
    print(f"$ ckptd {' '.join(args)}", flush=True)
    return subprocess.call([*CKPTD, *args], stdout=None if show else subprocess.DEVNULL)


def shard_tensors(rank: int, step: int) -> dict[str, np.ndarray]:
    """One tensor-parallel rank's slice of a tiny Llama layer plus Adam moments."""
    rng = np.random.default_rng(step * 10 + rank)
    p = {
        "embed.weight": rng.standard_normal((VOCAB // TP, D), np.float32),
        "attn.wq.weight": rng.standard_normal((D // TP, D), np.float32),
        "attn.wo.weight": rng.standard_normal((D, D // TP), np.float32),
        "norm.weight": np.ones(D, np.float32),
    }
    p.update({f"adam_m.{k}": v * 0.01 for k, v in list(p.items())})
    return p


def write_strategy(run_dir: Path) -> None:
    from ckptd.format.layout import TensorLayout
    from ckptd.format.strategy import ParamStrategy, Strategy, save_strategy

    maps = {"embed.weight": (1, -1), "attn.wq.weight": (1, -1), "attn.wo.weight": (-1, 1), "norm.weight": (-1,)}
    entries = []
    for name, tmap in maps.items():
        for full in (name, f"adam_m.{name}"):
            entries.append(ParamStrategy(full, TensorLayout(dev_matrix=(1, TP), tensor_map=tuple(0 if m == 1 else m for m in tmap))))
    run_dir.mkdir(parents=True, exist_ok=True)
    save_strategy(Strategy.build(tuple(entries)), run_dir / "strategy.ckpt")


def save(ms, rank: int, step: int) -> Path:
    rank_dir = ROOT / "llama" / f"rank_{rank}"
    rank_dir.mkdir(parents=True, exist_ok=True)
    path = rank_dir / f"llama-1_{step}.ckpt"
    data = [{"name": n, "data": ms.Tensor(a)} for n, a in shard_tensors(rank, step).items()]
    ms.save_checkpoint(data, str(path), crc_check=True, append_dict={"step_num": step, "epoch_num": 1, "rank_id": rank})
    return path


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


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit("demo: timed out waiting for ckptd")
        time.sleep(0.2)


def main() -> int:
    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms

    shutil.rmtree(OUT, ignore_errors=True)
    ROOT.mkdir(parents=True)
    db = f"sqlite:///{OUT / 'catalog.db'}"
    env = dict(os.environ, CKPTD_DB=db, CKPTD_ROOT=str(ROOT), CKPTD_SETTLE_SECONDS="0.5")
    os.environ.update(CKPTD_DB=db, CKPTD_ROOT=str(ROOT))

    banner("1. Start ckptd (catalog: embedded SQLite; API on loopback)")
    run("db", "upgrade")
    port = free_port()
    log = open(OUT / "ckptd.log", "wb")
    server = subprocess.Popen([*CKPTD, "serve", "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _up(base))
        print(f"ckptd serving on {base} (log: {OUT / 'ckptd.log'})")

        banner("2. A tp=2 MindSpore job saves per-rank shards at steps 100, 200, 300")
        write_strategy(ROOT / "llama")
        for step in (100, 200, 300):
            for rank in range(TP):
                print(f"  rank {rank} saved {save(ms, rank, step).relative_to(OUT)}")
        wait_until(lambda: get(f"{base}/v1/runs/llama/resume").get("step") == 300)
        run("ls", "llama")
        print(f"$ curl {base}/v1/runs/llama/resume")
        print(json.dumps(get(f"{base}/v1/runs/llama/resume"), indent=2))

        banner("3. A node dies while saving step 400; a bit rots in step 300")
        save(ms, 0, 400)
        torn = ROOT / "llama" / "rank_1" / "llama-1_400.tmp"  # rank 1's save never reached its rename
        torn.write_bytes((ROOT / "llama" / "rank_0" / "llama-1_400.ckpt").read_bytes()[:5000])
        victim = ROOT / "llama" / "rank_0" / "llama-1_300.ckpt"
        os.chmod(victim, 0o600)
        with open(victim, "r+b") as fh:
            fh.seek(victim.stat().st_size // 2)
            byte = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([byte[0] ^ 0x08]))
        print("  rank_1/llama-1_400.tmp left behind (never renamed); rank_0/llama-1_300.ckpt has one flipped bit")
        run("verify", "--run", "llama", "--step", "300")
        banner("   The launcher asks where to resume")
        run("resume", "--run", "llama")
        run("show", "llama", "300")

        banner("4. File tools on single shards (no catalog needed)")
        run("inspect", str(ROOT / "llama" / "rank_0" / "llama-1_200.ckpt"))
        key = os.urandom(32)
        (OUT / "ckpt.key").write_bytes(key)
        enc = OUT / "encrypted-1_200.ckpt"
        data = [{"name": n, "data": ms.Tensor(a)} for n, a in shard_tensors(0, 200).items()]
        ms.save_checkpoint(data, str(enc), enc_key=key, enc_mode="AES-GCM")
        run("verify", "--key-file", str(OUT / "ckpt.key"), str(enc))
        (OUT / "wrong.key").write_bytes(os.urandom(32))
        run("verify", "--key-file", str(OUT / "wrong.key"), str(enc))
        run("verify", str(victim), str(ROOT / "llama" / "rank_0" / "llama-1_200.ckpt"))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    banner(f"Done. Catalog, checkpoints and the daemon log are in {OUT}")
    return 0


def _up(base: str) -> bool:
    try:
        return get(f"{base}/healthz").get("first_rescan_done", False)
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
