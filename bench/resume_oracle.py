"""Resume-oracle latency under load (issue 4): 32 concurrent clients, catalog of >= 1M shard rows.

For each backend (embedded SQLite, PostgreSQL on 127.0.0.1:5432) the script fills a fresh catalog
with synthetic rows, starts the real server (`ckptd serve`, one uvicorn process, a read token
configured) and drives `GET /v1/runs/{run}/resume` over real HTTP. Each answer skips a pending
and a corrupt step and lists 512 shards (~40 KB of JSON).

The client is lean on purpose — raw asyncio streams, HTTP/1.1 keep-alive, every response read
in full (status line, Content-Length, body) and the first answer per run parsed and checked — so
the numbers are the server's, not an HTTP library's: client and server share the same 2 cores.

Modes (latency = from the send, or the scheduled send, to the last byte of the answer):
  saturated  closed loop: 32 clients, each sends its next request when its answer arrived
  paced      open loop at --rate req/s in total; latency counts from the *scheduled* send time, so
             a slow server cannot hide queueing (no coordinated omission)
  storm      what follows a failure: 32 clients (new connections) send one request for the same
             run at the same instant; repeated --storms times. "warm": the run's answer is cached;
             "cold": the run's catalog changed just before (an operator pins a step), so the storm
             starts with a cache miss.

    python bench/resume_oracle.py [--runs 40] [--steps 50] [--ranks 512] [--clients 32] [--requests 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.synthetic_catalog import fill
from ckptd.catalog.db import make_engine, upgrade
from ckptd.launcher.supervise import free_port  # noqa: E402

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
TOKEN = "bench-read-token"


class Conn:
    """One keep-alive HTTP/1.1 connection; ``get`` returns (status, body) with the body read in full."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> Conn:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writer.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    async def get(self, path: str) -> tuple[int, bytes]:
        if self.writer is None:
            await self.open()
        assert self.reader is not None and self.writer is not None
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length = next((int(v) for k, _, v in (ln.partition(b":") for ln in lines[1:]) if k.strip().lower() == b"content-length"),
                      None)
        if length is None:
            raise RuntimeError(f"response without Content-Length: {head!r}")
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()
            self.writer = None


class Checker:
    """Counts errors; parses the first answer for each run and checks it (shards, skipped steps)."""

    def __init__(self, ranks: int, steps: int) -> None:
        self.ranks, self.steps, self.errors, self.checked = ranks, steps, 0, set()

    def __call__(self, run: str, status: int, body: bytes) -> None:
        if status != 200 or not body.startswith(b"{"):
            self.errors += 1
            return
        if run not in self.checked:
            doc = json.loads(body)
            newest = self.steps * 100
            if (doc["run"] != run or len(doc["shards"]) != self.ranks or doc["step"] != newest - 200
                    or [s["step"] for s in doc["skipped"]] != [newest, newest - 100]):
                self.errors += 1
            self.checked.add(run)


def path_for(run: str) -> str:
    return f"/v1/runs/{run}/resume"


async def saturated(port: int, runs: list[str], clients: int, total: int, check: Checker) -> tuple[list[float], float]:
    latencies: list[float] = []
    counter = iter(range(total))
    conns = [await Conn(port).open() for _ in range(clients)]

    async def worker(conn: Conn) -> None:
        for i in counter:
            run = runs[i % len(runs)]
            t = time.perf_counter()
            status, body = await conn.get(path_for(run))
            latencies.append(time.perf_counter() - t)
            check(run, status, body)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    wall = time.perf_counter() - t0
    for c in conns:
        await c.close()
    return latencies, wall


async def paced(port: int, runs: list[str], clients: int, rate: float, seconds: float, check: Checker) -> list[float]:
    latencies: list[float] = []
    interval = clients / rate
    conns = [await Conn(port).open() for _ in range(clients)]
    start = time.perf_counter() + 0.1

    async def worker(k: int, conn: Conn) -> None:
        first = start + k * interval / clients
        n = 0
        while (due := first + n * interval) < start + seconds:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            run = runs[(k + n) % len(runs)]
            status, body = await conn.get(path_for(run))
            latencies.append(time.perf_counter() - due)
            check(run, status, body)
            n += 1

    await asyncio.gather(*(worker(k, c) for k, c in enumerate(conns)))
    for c in conns:
        await c.close()
    return latencies


async def storm(port: int, run: str, clients: int, check: Checker) -> list[float]:
    """``clients`` new connections, one request each, all released at the same instant."""
    go = asyncio.Event()
    ready = 0
    latencies: list[float] = []
    t0 = 0.0

    async def launcher() -> None:
        nonlocal ready
        conn = Conn(port)
        ready += 1
        await go.wait()
        await conn.open()  # a relaunched job opens a fresh connection
        status, body = await conn.get(path_for(run))
        latencies.append(time.perf_counter() - t0)
        check(run, status, body)
        await conn.close()

    tasks = [asyncio.create_task(launcher()) for _ in range(clients)]
    while ready < clients:
        await asyncio.sleep(0)
    t0 = time.perf_counter()
    go.set()
    await asyncio.gather(*tasks)
    return latencies


def change_run(engine, run: str, flip: int) -> None:
    """A catalog change that invalidates the run's cached answer without changing it (pin a step)."""
    with engine.begin() as c:
        c.execute(text("UPDATE checkpoints SET pinned = :p WHERE step = 100 AND run_id = (SELECT id FROM runs WHERE name = :r)"),
                  {"p": bool(flip % 2), "r": run})


def run_storms(port: int, runs: list[str], args: argparse.Namespace, check: Checker, engine, cold: bool) -> list[float]:
    latencies: list[float] = []
    for i in range(args.storms):
        run = runs[i % len(runs)]
        if cold:
            change_run(engine, run, i // len(runs) + 1)
        else:
            asyncio.run(storm(port, run, 1, check))  # make sure the answer is cached
        time.sleep(0.02)  # let the server go idle between storms
        latencies += asyncio.run(storm(port, run, args.clients, check))
    return latencies


def bench_backend(name: str, url: str, args: argparse.Namespace) -> dict:
    engine = make_engine(url)
    upgrade(engine)
    t = time.perf_counter()
    rows = fill(engine, runs=args.runs, steps=args.steps, ranks=args.ranks)
    fill_s = time.perf_counter() - t
    runs = [f"run{r:03d}" for r in range(args.runs)]
    check = Checker(args.ranks, args.steps)
    port = free_port()
    results: dict = {"backend": name, "rows": rows, "fill_s": fill_s}
    with tempfile.TemporaryDirectory() as root:
        env = dict(os.environ, CKPTD_DB=url, CKPTD_ROOT=root, CKPTD_RESCAN_INTERVAL="3600",
                   CKPTD_TOKENS=json.dumps({TOKEN: "read"}))
        server = subprocess.Popen([sys.executable, "-m", "ckptd", "serve", "--port", str(port)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1):
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(f"{name}: server did not start")
                time.sleep(0.2)
            def phase(label: str, measure, wall=None) -> None:
                errors = check.errors
                latencies = measure()
                if isinstance(latencies, tuple):
                    latencies, wall = latencies
                results[label] = _stats(latencies, check.errors - errors, wall)

            # warm-up: a daemon that has run for a while (connections open, statement caches filled);
            # "cold" below means the run's cached answer is stale, not that the process just started
            asyncio.run(saturated(port, runs, args.clients, len(runs) * 8, check))
            phase("storm cold", lambda: run_storms(port, runs, args, check, engine, cold=True))
            phase("storm warm", lambda: run_storms(port, runs, args, check, engine, cold=False))
            phase("saturated", lambda: asyncio.run(saturated(port, runs, args.clients, args.requests, check)))
            for rate in args.rates:
                phase(f"paced {rate:g}/s", lambda rate=rate: asyncio.run(paced(port, runs, args.clients, rate, args.seconds, check)),
                      args.seconds)
        finally:
            server.terminate()
            server.wait(30)
            engine.dispose()
    results["checked"] = len(check.checked)
    return results


def _stats(lat: list[float], errors: int, wall: float | None = None) -> dict:
    lat = sorted(lat)
    q = statistics.quantiles(lat, n=100)
    return {"n": len(lat), "p50": q[49] * 1e3, "p99": q[98] * 1e3, "max": lat[-1] * 1e3,
            "rps": len(lat) / wall if wall else None, "errors": errors}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=20000, help="saturated phase: requests in total")
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--rates", default="100,500", help="paced phases: aggregate requests/second, comma-separated")
    ap.add_argument("--seconds", type=float, default=20.0, help="duration of each paced phase")
    ap.add_argument("--storms", type=int, default=120, help="storms per storm phase")
    args = ap.parse_args()
    args.rates = [float(r) for r in args.rates.split(",") if r]
    results = []
    load_before = os.getloadavg()
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
          f"server and client. saturated = closed loop, {args.requests} requests; paced = open loop for "
          f"{args.seconds:g} s; storm = {args.clients} new connections at one instant, {args.storms} storms. "
          f"Load average before: {load_before[0]:.2f}, after: {os.getloadavg()[0]:.2f}\n")
    print("| backend | shard rows | mode | requests | p50 | p99 | max | requests/s | errors | target p99 < 20 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for mode, m in r.items():
            if not isinstance(m, dict):
                continue
            ok = "met" if m["p99"] < 20 else "**missed**"
            rps = f"{m['rps']:.0f}" if m["rps"] else "-"
            print(f"| {r['backend']} | {r['rows']:,} | {mode} | {m['n']} | {m['p50']:.1f} ms | {m['p99']:.1f} ms | "
                  f"{m['max']:.1f} ms | {rps} | {m['errors']} | {ok} |")
    print(f"\nanswers checked in full (one per run and backend): {sum(r['checked'] for r in results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
