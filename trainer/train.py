"""Training entry point, one process per rank (``msrun ... trainer/train.py ARGS`` or plain python for 1 rank).

Every rank: build its slices, train with tp/dp collectives, report health (rank 0), heartbeat each
step, checkpoint every ``--save-every`` steps asynchronously, and on ``--resume-from`` restore its own
shard exactly (weights, moments, schedule position = step, data position and RNG state).

``--layout`` picks the on-disk layout (trainer.checkpoint): ``native`` (``<run-dir>/rank_<r>/``,
``<run-dir>/strategy.ckpt``) or ``mindformers`` -- exactly MindFormers 2.1.0's legacy
``CheckpointMonitor`` with ``--run-dir`` as its output_dir: ``checkpoint/rank_<r>/{P}_rank_<r>[_k]-{E}_{S}.ckpt``
(``S`` = step within the epoch of ``--steps-per-epoch`` steps; ``_k`` = the k-th restart into the
directory), a lagging ``meta.json`` per rank and ``strategy/ckpt_strategy_rank_<r>.ckpt``. Resuming
takes each rank's shard path from the answer's ``shards``, whatever the layout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

#: MindFormers-style epoch length by default: so long that every run here is epoch 1 (S = global step)
DEFAULT_STEPS_PER_EPOCH = 1_000_000


def build_parser() -> argparse.ArgumentParser:
    from ckptd.runlayout import MINDFORMERS, NATIVE  # pure path rules (no numpy: threads are set later)

    p = argparse.ArgumentParser(prog="trainer.train", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True,
                   help="<root>/<run>: rank_<r>/ shards and strategy.ckpt go here (mindformers: its output_dir)")
    p.add_argument("--layout", choices=(NATIVE, MINDFORMERS), default=NATIVE,
                   help="on-disk layout: native, or MindFormers 2.1.0's legacy one (default native)")
    p.add_argument("--steps-per-epoch", type=int, default=DEFAULT_STEPS_PER_EPOCH,
                   help="mindformers layout: epoch length naming files {E}_{S} (default: so large that E=1, S=step)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (world = tp * dp)")
    p.add_argument("--steps", type=int, default=50, help="train until this global step")
    p.add_argument("--total-steps", type=int, default=None, help="schedule length (default: --steps)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per dp rank per step")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps (and at the last step); 0 = never")
    p.add_argument("--save-initial", action="store_true", help="also checkpoint step 0 (the initial weights)")
    p.add_argument("--sync-save", action="store_true", help="async_save=False (benchmark baseline)")
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="memory tier: copy the state into the node's shared memory every N steps (0 = off)")
    p.add_argument("--memory-root", default=None,
                   help="memory tier root (default $CKPTD_MEMORY_ROOT, else /dev/shm/ckptd)")
    p.add_argument("--prefix", default="llama", help="checkpoint file prefix (mindformers: {prefix}_rank_<r>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--corpus-bytes", type=int, default=1 << 16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--weight-decay", type=float, default=0.01)
    # the defaults are what ``ckptd launch`` gives any job, so the trainer runs under it as well
    p.add_argument("--resume-from", default=os.environ.get("CKPTD_RESUME_FILE"),
                   help="JSON file with a resume answer (ckptd's GET /resume body; default $CKPTD_RESUME_FILE)")
    p.add_argument("--enc-key-file", default=None, help="raw AES key (16/24/32 bytes) for enc_key / dec_key")
    p.add_argument("--heartbeat-dir", default=os.environ.get("CKPTD_HEARTBEAT_DIR"),
                   help="default $CKPTD_HEARTBEAT_DIR, else <run-dir>/heartbeat")
    p.add_argument("--ckptd-url", default=os.environ.get("CKPTD_URL"), help="health reports go here (optional)")
    p.add_argument("--run-name", default=os.environ.get("CKPTD_RUN_NAME"),
                   help="run name for ckptd (default: $CKPTD_RUN_NAME, else basename of --run-dir)")
    p.add_argument("--attempt", type=int, default=int(os.environ.get("CKPTD_ATTEMPT", "0")),
                   help="launch attempt number (set by the launcher; default $CKPTD_ATTEMPT)")
    p.add_argument("--fault", action="append", default=[], help="KIND:RANK:STEP, see trainer.faults")
    p.add_argument("--fault-attempt", type=int, default=0, help="faults fire only in this attempt")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank (fixed for bitwise determinism)")
    return p


def _log(rank: int, msg: str) -> None:
    print(f"[trainer rank {rank}] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    world = args.tp * args.dp
    env_rank = int(os.environ.get("RANK_ID", "0"))
    hb_dir = args.heartbeat_dir or os.path.join(args.run_dir, "heartbeat")

    from trainer.health import HealthReporter, Heartbeat

    hb = Heartbeat(hb_dir, env_rank, args.attempt)
    hb.beat(0, "starting")

    import mindspore as ms

    # The CPU kernel pool defaults to 30 threads: on a 2-core box several ranks then spend most of
    # their time context-switching, and the thread count must be fixed for bitwise reproducibility.
    ms.device_context.cpu.op_tuning.threads_num(args.threads)
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    ms.runtime.dispatch_threads_num(args.threads)
    # PyNative's asynchronous op pipeline hands every op to a backend thread; with more ranks than
    # cores each hand-off waits for a time slice (~1-2 ms/op, measured 10x slower steps). Executing
    # ops synchronously in the Python thread is both faster here and simpler to reason about.
    ms.runtime.launch_blocking()
    ms.set_seed(args.seed)
    distributed = "MS_ROLE" in os.environ  # set by msrun for every worker
    if distributed:
        from mindspore.communication import get_group_size, get_rank, init

        init()
        rank = get_rank()
        if get_group_size() != world:
            raise SystemExit(f"msrun started {get_group_size()} workers but tp*dp = {world}")
    elif world != 1:
        raise SystemExit("tp*dp > 1 needs msrun (or python -m trainer.launch)")
    else:
        rank = 0
    if rank != env_rank:
        hb = Heartbeat(hb_dir, rank, args.attempt)

    from trainer.checkpoint import CheckpointWriter, load_shard, write_strategy
    from trainer.config import ModelConfig, OptimConfig, lr_at
    from trainer.data import Sampler, make_corpus
    from trainer.faults import Faults
    from trainer.model import Llama
    from trainer.optim import AdamW
    from trainer.parallel import make_comm, prime_numpy_bridge
    from trainer.topology import Topology

    prime_numpy_bridge()
    topo = Topology(args.tp, args.dp, rank)
    cfg = ModelConfig(hidden=args.hidden, heads=args.heads, ffn=args.ffn, layers=args.layers, seq=args.seq)
    oc = OptimConfig(lr=args.lr, min_lr=args.min_lr, warmup=args.warmup, total_steps=args.total_steps or args.steps,
                     weight_decay=args.weight_decay, clip=args.clip)
    comm = make_comm(topo, distributed)
    model = Llama(cfg, topo, comm, args.seed)
    opt = AdamW(model.params, model.specs, oc, comm)
    sampler = Sampler(make_corpus(args.corpus_bytes), cfg.seq, args.micro_batch, topo.dp, topo.dp_index, args.seed)
    enc_key = None
    if args.enc_key_file:
        with open(args.enc_key_file, "rb") as fh:
            enc_key = fh.read()
    writer = CheckpointWriter(args.run_dir, topo, args.prefix, enc_key, args.layout, args.steps_per_epoch,
                              global_batch_size=args.micro_batch * topo.dp)
    faults = Faults(args.fault, rank, args.attempt == args.fault_attempt, lambda m: _log(rank, m),
                    os.path.join(hb_dir, f"fault_rank_{rank}.json"))
    # one reporter per job: the loss is already reduced over tp/dp, so every rank would send the same
    health = HealthReporter(args.ckptd_url if rank == 0 else None, args.run_name or os.path.basename(os.path.abspath(args.run_dir)),
                            os.environ.get("CKPTD_TOKEN"))
    if rank == 0 or args.layout == "mindformers":  # mindformers: every rank its own file
        write_strategy(args.run_dir, model.specs, topo, args.layout)

    def items():
        return [(n, model.params[n]) for n in opt.names] + opt.state_items()

    step = 0
    if args.resume_from:
        with open(args.resume_from) as fh:
            answer = json.load(fh)
        shard = [s for s in answer.get("shards", []) if int(s["rank"]) == rank]
        if len(shard) != 1:
            raise SystemExit(f"resume answer has {len(shard)} shards for rank {rank}")
        mine = shard[0]["path"]
        targets = dict(items())
        if answer.get("tier") == "memory":
            from trainer.flash import load_snapshot

            restored = load_snapshot(mine, topo, targets, verified=shard[0].get("digest"))
        else:
            restored = load_shard(mine, topo, targets, enc_key)
        if restored.step != int(answer["step"]):  # the training step ("name_step" is the file name's)
            raise SystemExit(f"{mine} holds step {restored.step}, the answer says {answer['step']}")
        sampler.restore(restored.data_state)
        step = restored.step
        _log(rank, f"resumed from step {step} ({answer.get('tier', 'file')}: {mine})")
    elif args.save_initial and args.save_every:
        writer.save(items(), 0, sampler.epoch, sampler.state(), async_save=not args.sync_save)

    flash = None
    if args.snapshot_every:
        from ckptd.integrations.flash import FlashWriter, MemoryTierUnavailable

        try:
            flash = FlashWriter(args.run_dir, rank, world, encrypted=enc_key is not None, root=args.memory_root)
        except MemoryTierUnavailable as exc:
            _log(rank, f"memory tier off: {exc}")

    params = [model.params[n] for n in opt.names]
    grad_fn = ms.value_and_grad(lambda ids, tg: model.loss(ids, tg), grad_position=None, weights=params)
    # rank 0's per-step log (kept open for the whole run; one flushed JSON line per step)
    metrics = open(os.path.join(args.run_dir, "metrics.jsonl"), "a") if rank == 0 else None  # noqa: SIM115
    first = step + 1

    def beat(phase: str) -> None:
        # An attempt's first step compiles the network and sets up the collectives: the launcher
        # judges it by its start-up allowance, not by the per-step heartbeat timeout.
        hb.beat(step, phase, startup=step == first)

    while step < args.steps:
        step += 1
        beat("train")
        faults.before_step(step)
        t0 = time.perf_counter()
        batch = sampler.next()
        beat("compute")  # from here a healthy rank may block in collectives behind a stuck peer
        loss, grads = grad_fn(ms.Tensor(batch.ids), ms.Tensor(batch.onehot(cfg.vocab)))
        beat("sync")
        grads = opt.reduce_grads(list(grads))
        if comm.dp_allreduce is not None:
            loss = comm.dp_allreduce(loss) * (1.0 / topo.dp)
        lr = lr_at(step, oc)
        norm, overflow = opt.step(grads, lr)
        loss_f = float(loss.asnumpy())
        t1 = time.perf_counter()
        save_s = 0.0
        writer.step_end()
        if args.save_every and (step % args.save_every == 0 or step == args.steps):
            beat("save")
            faults.before_save(step, writer.wait)
            path = writer.save(items(), step, sampler.epoch, sampler.state(), async_save=not args.sync_save)
            save_s = time.perf_counter() - t1
            faults.after_save_issued(step, path)
        snap_s = 0.0
        if flash is not None and step % args.snapshot_every == 0:
            from ckptd.integrations.flash import MemoryTierUnavailable
            from trainer.flash import snapshot

            try:
                pad = faults.before_snapshot(step, flash.paths)
                snap_s = snapshot(flash, writer, items(), step, sampler.epoch, sampler.state(), pad)
            except MemoryTierUnavailable as exc:  # e.g. /dev/shm filled up since the start
                _log(rank, f"memory tier off: {exc}")
                flash = None
        health.report(step, loss_f, norm, overflow)
        if metrics:
            metrics.write(json.dumps({"step": step, "loss": loss_f, "loss_hex": loss_f.hex(), "grad_norm": norm,
                                      "lr": lr, "overflow": overflow, "attempt": args.attempt,
                                      "step_s": t1 - t0, "save_s": save_s, "snap_s": snap_s,
                                      "time": time.time()}) + "\n")
            metrics.flush()
    hb.beat(step, "finishing")
    writer.wait()
    if flash is not None:
        flash.release()  # a clean end: the files are the run's resume point now
    health.flush()
    if metrics:
        metrics.close()
    hb.exited(0, step)
    _log(rank, f"finished at step {step}")
    return 0


if __name__ == "__main__":
    # msrun runs this file as a script: put the repository root (not trainer/, whose module names
    # like config/data would shadow others) on sys.path so ``trainer.*`` and ``ckptd.*`` import.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(_here))
    sys.exit(main())
