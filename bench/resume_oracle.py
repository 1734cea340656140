"""Resume-oracle latency under load (issue 4): 32 concurrent clients, catalog of >= 1M shard rows.

For each backend (embedded SQLite, PostgreSQL on 127.0.0.1:5432) the script fills a fresh catalog
with synthetic rows, starts the real server (`ckptd serve`, one uvicorn process) and drives
`GET /v1/runs/{run}/resume` over real HTTP from 32 concurrent asyncio clients in this process,
round-robin over the runs (each answer skips a pending and a corrupt step and returns 512 shards).

    python bench/resume_oracle.py [--runs 40] [--steps 50] [--ranks 512] [--clients 32] [--requests 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.synthetic_catalog import fill  # noqa: E402
from ckptd.catalog.db import make_engine, upgrade  # noqa: E402

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def drive(base: str, runs: int, clients: int, total: int) -> tuple[list[float], float, int]:
    latencies: list[float] = []
    errors = 0
    counter = iter(range(total))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as client:

        async def worker() -> None:
            nonlocal errors
            for i in counter:
                t = time.perf_counter()
                r = await client.get(f"/v1/runs/run{i % runs:03d}/resume")
                latencies.append(time.perf_counter() - t)
                if r.status_code != 200 or len(r.json()["shards"]) == 0:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return latencies, wall, errors


async def drive_paced(base: str, runs: int, clients: int, rate: float, seconds: float) -> tuple[list[float], int]:
    """Open loop: each client sends on a fixed schedule (aggregate ``rate`` req/s); latency counts
    from the *scheduled* send time, so a slow server cannot hide queueing (no coordinated omission)."""
    latencies: list[float] = []
    errors = 0
    interval = clients / rate
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as client:

        async def worker(k: int) -> None:
            nonlocal errors
            start = time.perf_counter() + k * interval / clients
            n = 0
            while (due := start + n * interval) < start + seconds:
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                r = await client.get(f"/v1/runs/run{(k + n) % runs:03d}/resume")
                latencies.append(time.perf_counter() - due)
                errors += r.status_code != 200
                n += 1

        await asyncio.gather(*(worker(k) for k in range(clients)))
    return latencies, errors


def bench_backend(name: str, url: str, args: argparse.Namespace) -> dict:
    engine = make_engine(url)
    upgrade(engine)
    t = time.perf_counter()
    rows = fill(engine, runs=args.runs, steps=args.steps, ranks=args.ranks)
    fill_s = time.perf_counter() - t
    engine.dispose()
    port = free_port()
    with tempfile.TemporaryDirectory() as root:
        env = dict(os.environ, CKPTD_DB=url, CKPTD_ROOT=root, CKPTD_RESCAN_INTERVAL="3600")
        server = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--port", str(port)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(f"{name}: server did not start")
                time.sleep(0.2)
            asyncio.run(drive(base, args.runs, args.clients, min(200, args.requests)))  # warm-up
            lat, wall, errors = asyncio.run(drive(base, args.runs, args.clients, args.requests))
            paced, paced_errors = asyncio.run(drive_paced(base, args.runs, args.clients, args.rate, args.seconds))
        finally:
            server.terminate()
            server.wait(30)
    return {"backend": name, "rows": rows, "fill_s": fill_s, "saturated": _stats(lat, errors, wall),
            "paced": _stats(paced, paced_errors, args.seconds)}


def _stats(lat: list[float], errors: int, wall: float) -> dict:
    lat = sorted(lat)
    q = statistics.quantiles(lat, n=100)
    return {"p50": q[49] * 1e3, "p99": q[98] * 1e3, "max": lat[-1] * 1e3, "rps": len(lat) / wall, "errors": errors}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--rate", type=float, default=100.0, help="paced phase: aggregate requests/second")
    ap.add_argument("--seconds", type=float, default=20.0, help="paced phase duration")
    args = ap.parse_args()
    results = []
    for backend in args.backends.split(","):
        if backend == "sqlite":
            with tempfile.TemporaryDirectory() as d:
                results.append(bench_backend("sqlite", f"sqlite:///{d}/catalog.db", args))
        else:
            db = f"ckptd_bench_{uuid.uuid4().hex[:8]}"
            admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
            with admin.connect() as c:
                c.execute(text(f'CREATE DATABASE "{db}"'))
            try:
                results.append(bench_backend("postgresql", PG_ADMIN.rsplit("/", 1)[0] + f"/{db}", args))
            finally:
                with admin.connect() as c:
                    c.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
                admin.dispose()
    print(f"\n{args.clients} concurrent clients, answers of {args.ranks} shards each, {os.cpu_count()} cpus shared by "
          f"server and clients. saturated = closed loop, {args.requests} requests as fast as possible; "
          f"paced = open loop at {args.rate:g} req/s for {args.seconds:g} s\n")
    print("| backend | shard rows | load | p50 | p99 | max | requests/s | errors | target p99 < 20 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for load in ("saturated", "paced"):
            m = r[load]
            ok = "met" if m["p99"] < 20 else "**missed**"
            print(f"| {r['backend']} | {r['rows']:,} | {load} | {m['p50']:.1f} ms | {m['p99']:.1f} ms | {m['max']:.1f} ms | "
                  f"{m['rps']:.0f} | {m['errors']} | {ok} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
