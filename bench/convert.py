"""Benchmark: ``ckptd convert`` vs ``mindspore.transform_checkpoints`` on one multi-GB checkpoint.

The source is a tp=4 job (weights + Adam moments, float32, ~2.25 GiB over 4 rank files by
default; ``--source tp2dp2``: a tp=2 x dp=2 job, whose ranks 2-3 replicate ranks 0-1), written
with ckptd's MindSpore-byte-compatible writer. For each target layout both tools
run in their own child process (``python bench/convert.py --child ...``) on the same inputs with
a warm page cache; we report

* wall time of the conversion call inside the child (imports excluded) and of the whole child,
* peak RSS of the child: the kernel's high-water mark of the child's own address space
  (``VmHWM`` in ``/proc/self/status``, read by the child just before it exits; it counts resident
  mmap'd file pages too -- ckptd releases them as it goes). Not ``ru_maxrss`` from ``wait4``: Linux
  folds the *parent's* high-water mark into it at exec (vfork), which would charge this script's
  own memory to whichever tool runs next.

then compare every output tensor of both tools bitwise. ckptd's time includes what MindSpore does
not do: fsync of every file and directory, and digest-verifying every output piece (on the bytes
in hand since issue 16). Each run also times the copy limit: ``cp -r`` of the source + ``sync``
(every byte a conversion reads, as many written), the physical floor for a conversion here; for
the tp2dp2 source only one data-parallel replica (ranks 0-1) is copied: a conversion reads each
slice once, from one replica.

Usage: ``.venv/bin/python bench/convert.py [--gib 2.25] [--source tp4|tp2dp2] [--targets tp2,none,tp4] [--repeat N] [--workdir DIR] [--keep]``
(on a shared/noisy machine use ``--repeat 3``: every run is printed as it ends, with the 1-minute load
average around it; the summary shows each tool's best time and worst peak RSS).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HIDDEN = 4096


def _names(n_layers: int) -> list[tuple[str, int]]:
    """(name, split dim) in MindSpore's save order: weights, then moments."""
    weights = [(f"layers.{i}.{kind}.weight", 0 if kind == "up" else 1) for i in range(n_layers) for kind in ("up", "down")]
    return weights + [(f"adam_m.{n}", d) for n, d in weights] + [(f"adam_v.{n}", d) for n, d in weights]


def _strategy(names: list[tuple[str, int]], tp: int, dp: int = 1):
    from ckptd.format.layout import TensorLayout
    from ckptd.format.strategy import OpItem, ParamStrategy, Strategy

    # dev matrix (dp, tp): tensor_map 0 names the last axis (tp); the dp axis replicates
    entries = [ParamStrategy(n, TensorLayout((dp, tp), (0, -1) if d == 0 else (-1, 0))) for n, d in names]
    return Strategy.build(entries, op_items=[OpItem("Default/MatMul-op0", 0, ((dp, tp),))])


SOURCES = {"tp4": (4, 1), "tp2dp2": (2, 2)}  # name -> (tp, dp) of the 4-rank source


def build(work: Path, gib: float, source: str = "tp4") -> list[tuple[str, int]]:
    from ckptd.format.checkpoint import write_checkpoint
    from ckptd.format.layout import slice_for_rank
    from ckptd.format.strategy import save_strategy

    per_matrix = HIDDEN * HIDDEN * 4
    n_layers = max(1, round(gib * 2**30 / (per_matrix * 2 * 3)))
    names = _names(n_layers)
    src = _strategy(names, *SOURCES[source])
    save_strategy(src, work / "src_strategy.ckpt")
    save_strategy(_strategy(names, 2), work / "tp2_strategy.ckpt")
    save_strategy(_strategy(names, 4), work / "tp4_strategy.ckpt")
    rng = np.random.default_rng(0)
    base = rng.standard_normal((HIDDEN, HIDDEN), dtype=np.float32)
    for rank in range(4):
        def items(rank: int = rank):
            for i, e in enumerate(src.entries):
                full = base + np.float32(i)  # distinct, deterministic content per parameter
                s = slice_for_rank(e.layout, full.shape, rank)
                yield e.name, np.ascontiguousarray(full[s.index])
            yield "global_step", np.array([100], np.int32)
            yield "epoch_num", 1
            yield "step_num", 100
        (work / "src" / f"rank_{rank}").mkdir(parents=True, exist_ok=True)
        write_checkpoint(work / "src" / f"rank_{rank}" / "net-1_100.ckpt", items(), crc=True)
    return names


def child(tool: str, work: Path, target: str, out: Path) -> None:
    """Runs in the measured child process; prints the call's own wall time as JSON."""
    dst = None if target == "none" else str(work / f"{target}_strategy.ckpt")
    if tool == "ms":
        import mindspore as ms

        ms.set_context(device_target="CPU")
        t0 = time.perf_counter()
        ms.transform_checkpoints(str(work / "src"), str(out), "checkpoint_", str(work / "src_strategy.ckpt"), dst)
    else:
        from ckptd.convert import convert

        t0 = time.perf_counter()
        convert(work / "src", str(work / "src_strategy.ckpt"), dst, out)
    call = time.perf_counter() - t0
    with open("/proc/self/status") as fh:
        hwm = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
    print(json.dumps({"call_s": call, "vm_hwm": hwm}))


def measure(tool: str, work: Path, target: str) -> dict:
    out = work / f"out_{tool}_{target}"
    shutil.rmtree(out, ignore_errors=True)
    os.sync()  # no write-back of an earlier run competes with this one
    env = dict(os.environ, GLOG_v="3")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", tool, "--workdir", str(work), "--targets", target],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    _, status, _usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    stdout, stderr = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{tool} {target} failed ({proc.returncode}):\n{stderr.decode()[-3000:]}")
    doc = json.loads(stdout.decode().strip().splitlines()[-1])
    return {"call_s": doc["call_s"], "wall_s": wall, "peak_rss": doc["vm_hwm"], "out": out}


def copy_limit(work: Path, ranks: range = range(4)) -> float:
    """``cp -r`` of the source (every byte a conversion reads, and as many written) + ``sync``: the
    physical limit of a conversion on this disk, measured like ``measure`` (after an ``os.sync``,
    the previous copy's output deleted first, so both write into memory the guest just freed)."""
    out = work / "out_cp"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    os.sync()
    t0 = time.perf_counter()
    subprocess.run(["cp", "-r", *(str(work / "src" / f"rank_{r}") for r in ranks), str(out)], check=True)
    os.sync()
    seconds = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return seconds


def compare(a: Path, b: Path) -> tuple[int, int]:
    """(tensors compared, bytes compared); raises if any differs (rank_id aside: absent here)."""
    from ckptd.format.checkpoint import open_checkpoint

    count = nbytes = 0
    ranks_a = sorted(p.name for p in a.glob("rank_*"))
    if ranks_a != sorted(p.name for p in b.glob("rank_*")):
        raise SystemExit(f"different rank sets in {a} and {b}")
    for rank in ranks_a:
        (fa,), (fb,) = list((a / rank).glob("*.ckpt")), list((b / rank).glob("*.ckpt"))
        with open_checkpoint(fa) as ca, open_checkpoint(fb) as cb:
            if sorted(ca.entries) != sorted(cb.entries):
                raise SystemExit(f"{rank}: different entries")
            for name, e in ca.entries.items():
                x, y = ca.array(name), cb.array(name)
                if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                    raise SystemExit(f"{rank}/{name}: outputs differ")
                count, nbytes = count + 1, nbytes + e.nbytes
    return count, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.25, help="total source size (weights + 2 moments)")
    ap.add_argument("--source", choices=sorted(SOURCES), default="tp4", help="layout of the 4-rank source")
    ap.add_argument("--targets", default=None, help="comma list of tp2 / none / tp4 (default tp2,none; tp4 for tp2dp2)")
    ap.add_argument("--workdir", default="/tmp/ckptd-bench-convert")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--repeat", type=int, default=1, help="runs per tool and target, alternating; best time, worst RSS")
    ap.add_argument("--child", choices=("ms", "ckptd"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = Path(args.workdir)
    if args.child:
        child(args.child, work, args.targets, work / f"out_{args.child}_{args.targets}")
        return
    targets = args.targets or ("tp4" if args.source == "tp2dp2" else "tp2,none")
    tp, dp = SOURCES[args.source]
    needed = range(4 // dp)  # the ranks of one data-parallel replica: all a conversion reads
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    build(work, args.gib, args.source)
    size = sum(f.stat().st_size for f in (work / "src").rglob("*.ckpt"))
    print(f"source: 4 ranks ({args.source}), {size / 2**30:.2f} GiB, built in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    print("per run: | case | run | MindSpore call | ckptd call | speed-up | MindSpore peak RSS | ckptd peak RSS "
          "| copy limit (cp + sync) | ckptd / copy limit | 1-min load average before -> after |", flush=True)
    copy_limit(work, needed)  # warm-up: the first write into memory the guest has not used lately is slow on this VM
    try:
        for target in targets.split(","):
            runs: dict[str, list[dict]] = {"ms": [], "ckptd": []}
            copies: list[float] = []
            for run in range(max(1, args.repeat)):  # alternate so background load hits both alike
                load0 = os.getloadavg()[0]
                for tool in ("ms", "ckptd"):
                    runs[tool].append(measure(tool, work, target))
                copies.append(copy_limit(work, needed))
                m, c = runs["ms"][-1], runs["ckptd"][-1]
                print(f"run | {args.source} -> {target} | {run + 1} | {m['call_s']:.2f} s | {c['call_s']:.2f} s | "
                      f"{m['call_s'] / c['call_s']:.1f}x | {m['peak_rss'] / 2**30:.2f} GiB | {c['peak_rss'] / 2**30:.2f} GiB "
                      f"({c['peak_rss'] / m['peak_rss']:.0%}) | {copies[-1]:.2f} s | {c['call_s'] / copies[-1]:.2f}x "
                      f"| {load0:.1f} -> {os.getloadavg()[0]:.1f} |", flush=True)
            res = {tool: {"call_s": min(r["call_s"] for r in rs), "wall_s": min(r["wall_s"] for r in rs),
                          "peak_rss": max(r["peak_rss"] for r in rs), "out": rs[-1]["out"]} for tool, rs in runs.items()}
            tensors, nbytes = compare(res["ms"]["out"], res["ckptd"]["out"])
            res["cp"] = {"call_s": min(copies)}
            rows.append((target, res, tensors, nbytes))
            for tool in ("ms", "ckptd"):
                shutil.rmtree(res[tool]["out"], ignore_errors=True)
            print(f"done {target}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"Source: {args.source} (tp={tp}, dp={dp}), 4 rank files, {size / 2**30:.2f} GiB (float32 weights + adam_m + "
          f"adam_v), warm page cache, {os.cpu_count()} CPUs; copy limit = cp + sync of ranks {list(needed)}.")
    print()
    print(f"| {args.source} -> | MindSpore call (s) | ckptd call (s) | speedup | MindSpore child (s) | ckptd child (s) "
          "| copy limit (s) | ckptd call / copy limit | MindSpore peak RSS | ckptd peak RSS | RSS ratio | outputs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for target, res, tensors, nbytes in rows:
        m, c, cp = res["ms"], res["ckptd"], res["cp"]
        print(f"| {target} | {m['call_s']:.2f} | {c['call_s']:.2f} | {m['call_s'] / c['call_s']:.1f}x "
              f"| {m['wall_s']:.2f} | {c['wall_s']:.2f} | {cp['call_s']:.2f} | {c['call_s'] / cp['call_s']:.2f}x "
              f"| {m['peak_rss'] / 2**30:.2f} GiB | {c['peak_rss'] / 2**30:.2f} GiB "
              f"| {c['peak_rss'] / m['peak_rss']:.2f} | identical ({tensors} tensors, {nbytes / 2**30:.2f} GiB) |")


if __name__ == "__main__":
    main()
