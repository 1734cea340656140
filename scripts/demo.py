"""`make demo`: what ckptd sees in checkpoints that MindSpore itself writes.

1. MindSpore saves a small Llama-style model's per-rank shards the way production jobs do
   (plain + CRC, AES-GCM encrypted, safetensors), with step/epoch in append_dict.
2. `ckptd inspect` and `ckptd verify` read them (no MindSpore in ckptd itself).
3. We damage copies the ways real jobs do — a save torn by a dying node, a flipped bit, the wrong
   key — and ckptd says exactly what is wrong and where, and exits non-zero.
Everything lands in ./demo-out (recreated on each run).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

OUT = Path("demo-out")
CKPTD = [sys.executable, "-m", "ckptd"]


def banner(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def run(*args: str) -> int:
    shown = " ".join(["ckptd", *args])
    print(f"$ {shown}", flush=True)
    return subprocess.call([*CKPTD, *args])


def llama_params(rank: int, tp: int = 2, d: int = 256, vocab: int = 512, layers: int = 1) -> dict[str, np.ndarray]:
    """One tensor-parallel rank's slice of a tiny Llama: column-parallel qkv/gate/up, row-parallel o/down."""
    rng = np.random.default_rng(rank)
    p: dict[str, np.ndarray] = {"embed.weight": rng.standard_normal((vocab // tp, d), np.float32)}
    for i in range(layers):
        pre = f"layers.{i}."
        p[pre + "attn_norm.weight"] = np.ones(d, np.float32)
        for name in ("q", "k", "v"):
            p[pre + f"attn.w{name}.weight"] = rng.standard_normal((d // tp, d), np.float32)
        p[pre + "attn.wo.weight"] = rng.standard_normal((d, d // tp), np.float32)
        p[pre + "mlp_norm.weight"] = np.ones(d, np.float32)
        p[pre + "mlp.w_gate.weight"] = rng.standard_normal((4 * d // tp, d), np.float32)
        p[pre + "mlp.w_up.weight"] = rng.standard_normal((4 * d // tp, d), np.float32)
        p[pre + "mlp.w_down.weight"] = rng.standard_normal((d, 4 * d // tp), np.float32)
    p["lm_head.weight"] = rng.standard_normal((vocab // tp, d), np.float32)
    p.update({f"adam_m.{k}": np.zeros_like(v) for k, v in list(p.items())})
    p["global_step"] = np.array([200], np.int32)
    return p


def main() -> int:
    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms

    shutil.rmtree(OUT, ignore_errors=True)
    run_dir = OUT / "run1"
    key = os.urandom(32)
    (OUT / "ckpt.key").parent.mkdir(parents=True, exist_ok=True)
    (OUT / "ckpt.key").write_bytes(key)

    banner("1. MindSpore writes per-rank shards of step 200 (tp=2): plain+CRC, AES-GCM, safetensors")
    for rank in range(2):
        rank_dir = run_dir / f"rank_{rank}"
        rank_dir.mkdir(parents=True)
        tensors = [{"name": n, "data": ms.Tensor(a)} for n, a in llama_params(rank).items()]
        append = {"epoch_num": 1, "step_num": 200}
        ms.save_checkpoint(tensors, str(rank_dir / "llama-1_200.ckpt"), crc_check=True, append_dict=append)
        ms.save_checkpoint(tensors, str(rank_dir / "llama_enc-1_200.ckpt"), enc_key=key, enc_mode="AES-GCM",
                           append_dict=append)
        ms.save_checkpoint(tensors, str(rank_dir / "llama-1_200.safetensors"), format="safetensors", crc_check=True)
    for f in sorted(run_dir.rglob("*")):
        if f.is_file():
            print(f"  {f}  {f.stat().st_size:,} bytes")

    banner("2. ckptd inspects a shard (no MindSpore involved)")
    run("inspect", str(run_dir / "rank_0" / "llama-1_200.ckpt"))
    banner("   ... and an encrypted one, with the key file")
    run("inspect", str(run_dir / "rank_1" / "llama_enc-1_200.ckpt"), "--key-file", str(OUT / "ckpt.key"))

    banner("3. ckptd verifies every plaintext shard completely (structure + CRC)")
    run("verify", *[str(p) for p in sorted(run_dir.rglob("llama-1_200.*"))])

    banner("4. Damage, as real jobs do it")
    bad = OUT / "damaged"
    bad.mkdir()
    src = (run_dir / "rank_0" / "llama-1_200.ckpt").read_bytes()
    (bad / "torn-1_200.ckpt").write_bytes(src[: len(src) * 2 // 3])  # node died mid-save
    flipped = bytearray(src)
    flipped[len(flipped) // 2] ^= 0x10  # one bit rotted on disk
    (bad / "bitflip-1_200.ckpt").write_bytes(bytes(flipped))
    enc = bytearray((run_dir / "rank_0" / "llama_enc-1_200.ckpt").read_bytes())
    enc[-1] ^= 0x01  # tampered ciphertext
    (bad / "tampered_enc-1_200.ckpt").write_bytes(bytes(enc))
    rc = run("verify", str(bad / "torn-1_200.ckpt"), str(bad / "bitflip-1_200.ckpt"))
    print(f"  exit code {rc} (non-zero: do not resume from these)")
    rc = run("verify", "--key-file", str(OUT / "ckpt.key"), str(bad / "tampered_enc-1_200.ckpt"))
    print(f"  exit code {rc}")
    (OUT / "wrong.key").write_bytes(os.urandom(32))
    rc = run("verify", "--key-file", str(OUT / "wrong.key"), str(run_dir / "rank_0" / "llama_enc-1_200.ckpt"))
    print(f"  exit code {rc}")

    banner("Done. Files are in ./demo-out; try `.venv/bin/ckptd inspect --help`.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
