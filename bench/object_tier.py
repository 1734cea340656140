"""The object tier's transfers against a local SeaweedFS (issue 23): which client, how fast, how much memory.

A "step" of 4 rank files of random bytes (default 4 x 256 MiB; ``--mib 512`` for the issue's ~2 GiB)
is uploaded and downloaded by each client in its own process (so each peak RSS is its own), in one
run against one server:

  boto3     baseline: ``upload_file`` / ``download_file`` with boto3's default TransferConfig
  obstore   obstore's ``put`` of a Path / ``get`` streamed to a file, defaults (the raw client)
  ckptd     ``ckptd.storage.s3.ObjectStore``: ``put_file`` (multipart, 8 MiB parts, 4 in flight)
            *plus* the read-back that verifies it (``digest``: ranged GETs, xxh3-128), counted in
            the upload time; ``download`` (parallel ranged GETs, hashed) into
            ``PosixStorage.create`` (confined temp, fsync, rename), as ``ckptd fetch`` writes

Files go one after another in every mode (a node uploads its ranks through one store). Throughput
is bytes / wall time; peak RSS is the child's ``ru_maxrss``. ``ckptd`` also runs at a quarter of the
shard size: bounded memory means its peak RSS does not follow the shard size.

    python bench/object_tier.py [--mib 256] [--ranks 4]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(mode: str, src: str, dst: str, bucket: str, prefix: str) -> dict:
    files = sorted(os.listdir(src))
    total = sum(os.path.getsize(os.path.join(src, f)) for f in files)
    out: dict = {"mode": mode, "bytes": total}
    if mode == "boto3":
        import boto3

        client = boto3.client("s3")  # endpoint, region and keys from the environment
        out["rss_before"] = rss_mib()
        t = time.perf_counter()
        for f in files:
            client.upload_file(os.path.join(src, f), bucket, f"{prefix}/{f}")
        out["up_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for f in files:
            client.download_file(bucket, f"{prefix}/{f}", os.path.join(dst, f))
        out["down_s"] = time.perf_counter() - t
    elif mode == "obstore":
        import obstore
        from obstore.store import S3Store

        store = S3Store(bucket, config={"endpoint": os.environ["AWS_ENDPOINT_URL"], "region": "us-east-1"},
                        client_options={"allow_http": True})
        out["rss_before"] = rss_mib()
        t = time.perf_counter()
        for f in files:
            obstore.put(store, f"{prefix}/{f}", Path(src, f))
        out["up_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for f in files:
            with open(os.path.join(dst, f), "wb") as fh:
                for chunk in obstore.get(store, f"{prefix}/{f}"):
                    fh.write(chunk)
        out["down_s"] = time.perf_counter() - t
    else:
        from ckptd.storage.s3 import ObjectStore

        store = ObjectStore(f"s3://{bucket}/{prefix}")
        out["rss_before"] = rss_mib()
        digests = {}
        t = time.perf_counter()
        for f in files:
            size = store.put_file(f, os.path.join(src, f))
            digests[f] = (size, store.digest(f, size))  # the read-back that proves the upload
        out["up_s"] = time.perf_counter() - t
        t = time.perf_counter()
        from ckptd.storage import PosixStorage

        below = PosixStorage(os.path.dirname(dst))  # as ckptd fetch writes: confined temp, fsync, rename
        for f in files:
            with below.create(os.path.join(dst, f), overwrite=True) as fh:
                store.download(f, fh, *digests[f])
        out["down_s"] = time.perf_counter() - t
    out["rss_peak"] = rss_mib()  # before the comparison below, which reads buffers of its own
    for f in files:  # every mode must have moved the same bytes
        with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "rb") as b:
            while (x := a.read(1 << 20)):
                assert x == b.read(1 << 20), f"{mode}: {f} differs"
        os.unlink(os.path.join(dst, f))
    return out


def run_child(mode: str, src: str, dst: str, prefix: str, env: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", mode, src, dst, prefix], env={**os.environ, **env},
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def make_step(where: str, ranks: int, mib: int) -> None:
    os.makedirs(where, exist_ok=True)
    for r in range(ranks):
        with open(os.path.join(where, f"rank_{r}.ckpt"), "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(1 << 20))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        mode, src, dst, prefix = sys.argv[2:6]
        print(json.dumps(child(mode, src, dst, "ckptd", prefix)))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256, help="MiB per rank file")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    from seaweed import SeaweedServer

    tmp = tempfile.mkdtemp(prefix="ckptd-bench-obj-")
    server = SeaweedServer(data_dir=os.path.join(tmp, "weed")).start()
    try:
        big, small, dst = os.path.join(tmp, "big"), os.path.join(tmp, "small"), os.path.join(tmp, "dst")
        make_step(big, args.ranks, args.mib)
        make_step(small, args.ranks, max(1, args.mib // 4))
        os.makedirs(dst)
        print(f"load average before: {os.getloadavg()}  step: {args.ranks} x {args.mib} MiB", flush=True)
        rows = []
        for rnd in range(args.rounds):
            for mode in ("boto3", "obstore", "ckptd"):
                rows.append(run_child(mode, big, dst, f"r{rnd}-{mode}", server.env()))
                print(json.dumps(rows[-1]), flush=True)
            small_row = run_child("ckptd", small, dst, f"r{rnd}-small", server.env())
            small_row["mode"] = "ckptd (1/4 shard size)"
            rows.append(small_row)
            print(json.dumps(rows[-1]), flush=True)
        print(f"load average after: {os.getloadavg()}")
        print("\n| client | upload MiB/s | download MiB/s | peak RSS MiB (before transfers) |")
        print("|---|---|---|---|")
        for r in rows:
            mib = r["bytes"] / (1 << 20)
            print(f"| {r['mode']} | {mib / r['up_s']:.0f} | {mib / r['down_s']:.0f} | "
                  f"{r['rss_peak']:.0f} ({r['rss_before']:.0f}) |")
    finally:
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
