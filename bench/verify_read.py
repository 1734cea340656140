"""Full verification speed and memory: ckptd vs ``mindspore.load_checkpoint`` vs ``cat``, one process.

For each case the same file is checked completely by
  * ckptd:     ``verify_file`` — parse every record, recompute the CRC / decrypt+authenticate every block;
  * MindSpore: ``load_checkpoint(..., crc_check=True)`` or ``(..., dec_key=...)`` (its full check);
  * raw:       ``cat FILE > /dev/null`` — the read-bandwidth ceiling.
Timings are best-of-N with a warm page cache (and one cold-cache run each when the script may
drop caches, i.e. as root). Memory: peak RSS (VmHWM, reset between runs through
/proc/self/clear_refs) and peak anonymous RSS (sampled), both minus the pre-run level.

    python bench/verify_read.py [--size-gb 1.2] [--repeat 3] [--data-dir bench/.data]
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptd.format.verify import verify_file  # noqa: E402


# --- measurement helpers ---------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class MemoryProbe:
    """Peak VmHWM and sampled peak RssAnon over a block, relative to the level at entry."""

    def __enter__(self) -> "MemoryProbe":
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # reset VmHWM to the current RSS
        except OSError:
            pass
        self.rss0, self.anon0 = _status_kib("VmRSS"), _status_kib("RssAnon")
        self.anon_peak = self.anon0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.anon_peak = max(self.anon_peak, _status_kib("RssAnon"))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.anon_peak = max(self.anon_peak, _status_kib("RssAnon"))
        self.peak_rss_mib = max(0, _status_kib("VmHWM") - self.rss0) / 1024
        self.peak_anon_mib = max(0, self.anon_peak - self.anon0) / 1024


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3")
        return True
    except OSError:
        return False


@dataclass
class Result:
    seconds: float
    cold_seconds: float | None
    peak_rss_mib: float
    peak_anon_mib: float


def measure(fn, repeat: int, cold: bool) -> Result:
    cold_s = None
    if cold and drop_caches():
        t = time.perf_counter()
        fn()
        cold_s = time.perf_counter() - t
    fn()  # warm the page cache
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    with MemoryProbe() as probe:
        fn()
    return Result(best, cold_s, probe.peak_rss_mib, probe.peak_anon_mib)


# --- test files ------------------------------------------------------------------------------


def llama_like(total_bytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Weights and Adam moments of a Llama-ish layer stack, float32/bfloat16-sized tensors."""
    rng = np.random.default_rng(seed)
    d, tensors, used, layer = 2048, {}, 0, 0
    while used < total_bytes:
        for name, shape in (("wq", (d, d)), ("wkv", (d // 2, d)), ("wo", (d, d)), ("w_gate", (2 * d, d)), ("w_down", (d, 2 * d))):
            arr = rng.standard_normal(shape, dtype=np.float32)
            tensors[f"layers.{layer}.{name}.weight"] = arr
            used += arr.nbytes
            if used >= total_bytes:
                break
        layer += 1
    return tensors


def make_files(data_dir: Path, size_gb: float, key: bytes) -> dict[str, Path]:
    import mindspore as ms

    data_dir.mkdir(parents=True, exist_ok=True)
    want = {
        "plain_crc": data_dir / f"plain_crc_{size_gb:g}g.ckpt",
        "aes_gcm": data_dir / f"aes_gcm_{size_gb:g}g.ckpt",
        "plain_crc_small": data_dir / f"plain_crc_{size_gb / 4:g}g.ckpt",
    }
    if all(p.exists() for p in want.values()):
        return want
    for name, path in want.items():
        if path.exists():
            continue
        nbytes = int((size_gb / 4 if name.endswith("small") else size_gb) * (1 << 30))
        data = [{"name": k, "data": ms.Tensor(v)} for k, v in llama_like(nbytes).items()]
        kwargs = {"enc_key": key, "enc_mode": "AES-GCM"} if name == "aes_gcm" else {"crc_check": True}
        print(f"writing {path} with mindspore.save_checkpoint ...", flush=True)
        ms.save_checkpoint(data, str(path), **kwargs)
        del data
        gc.collect()
    return want


# --- main ------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--data-dir", type=Path, default=Path(__file__).parent / ".data")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache run")
    args = ap.parse_args()

    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms  # imported before any measurement so both sides share its baseline

    key_path = args.data_dir / "bench.key"
    args.data_dir.mkdir(parents=True, exist_ok=True)
    if not key_path.exists():
        key_path.write_bytes(os.urandom(16))
    key = key_path.read_bytes()
    files = make_files(args.data_dir, args.size_gb, key)
    cold = not args.no_cold

    def ckptd_verify(path: Path, k: bytes | None = None):
        def run() -> None:
            report = verify_file(path, k)
            assert report.ok, report.problems

        return run

    cases = [
        ("plaintext + CRC", files["plain_crc"], ckptd_verify(files["plain_crc"]),
         lambda: ms.load_checkpoint(str(files["plain_crc"]), crc_check=True)),
        ("AES-GCM", files["aes_gcm"], ckptd_verify(files["aes_gcm"], key),
         lambda: ms.load_checkpoint(str(files["aes_gcm"]), dec_key=key, dec_mode="AES-GCM")),
    ]
    print(f"python {sys.version.split()[0]}, mindspore {ms.__version__}, cpus {os.cpu_count()}")
    rows = []
    for label, path, ours, theirs in cases:
        size = path.stat().st_size
        raw = measure(lambda: subprocess.run(f"cat '{path}' > /dev/null", shell=True, check=True), args.repeat, cold)
        r_ours = measure(ours, args.repeat, cold)
        r_ms = measure(theirs, max(1, args.repeat - 1), cold)
        rows.append((label, size, raw, r_ours, r_ms))

    small = files["plain_crc_small"]
    r_small = measure(ckptd_verify(small), 1, False)

    gb = 1e9
    print("\n| case | file | raw `cat` | ckptd | MindSpore | ckptd vs MindSpore | ckptd / raw bandwidth | peak RSS ckptd / MindSpore (MiB) | peak anon ckptd / MindSpore (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, size, raw, o, m in rows:
        print(
            f"| {label} (warm) | {size / gb:.2f} GB | {raw.seconds:.3f} s ({size / raw.seconds / gb:.2f} GB/s) "
            f"| {o.seconds:.3f} s ({size / o.seconds / gb:.2f} GB/s) | {m.seconds:.3f} s ({size / m.seconds / gb:.2f} GB/s) "
            f"| **{m.seconds / o.seconds:.1f}x** faster | {raw.seconds / o.seconds * 100:.0f}% "
            f"| {o.peak_rss_mib:.0f} / {m.peak_rss_mib:.0f} | {o.peak_anon_mib:.0f} / {m.peak_anon_mib:.0f} |"
        )
        if o.cold_seconds and m.cold_seconds and raw.cold_seconds:
            print(
                f"| {label} (cold cache) | | {raw.cold_seconds:.3f} s | {o.cold_seconds:.3f} s | {m.cold_seconds:.3f} s "
                f"| **{m.cold_seconds / o.cold_seconds:.1f}x** | {raw.cold_seconds / o.cold_seconds * 100:.0f}% | | |"
            )
    print(
        f"\nckptd memory vs file size (plaintext + CRC): {small.stat().st_size / gb:.2f} GB file -> peak RSS "
        f"{r_small.peak_rss_mib:.0f} MiB, anon {r_small.peak_anon_mib:.0f} MiB; {rows[0][1] / gb:.2f} GB file -> "
        f"peak RSS {rows[0][3].peak_rss_mib:.0f} MiB, anon {rows[0][3].peak_anon_mib:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
