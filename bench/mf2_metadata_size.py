"""How big MindFormers' own ``metadata.json`` is for a Llama-2-70B save on 256 ranks (issue 26, finding 4).

The bound ``ckptd.format.limits.MAX_METADATA_BYTES`` (512 MiB) is grounded in this measurement;
this script reproduces it. It builds the parameter set MindFormers 2.1.0 saves for Llama-2-70B --
80 layers, hidden 8192, ffn 28672, vocab 32000, GQA with 8 kv heads (head dim 128), mcore names
with fused qkv (``linear_qkv``: 8192 + 2 x 1024 rows) and fused gate/up (``linear_fc1``: 2 x 28672
rows), bf16 weights, ``adam_m.`` / ``adam_v.`` float32 moments, ``global_step`` and
``learning_rate`` -- as real ``mindspore.parallel.Layout`` objects of a dp x tp x pp job (default
dp 8, tp 8, pp 4 = 256 ranks; 20 layers per stage, embedding on stage 0, final norm and output layer
on the last; each stage's layouts carry its 64 ranks as ``rank_list``; column-parallel weights and
the vocabulary split over tp on dim 0, row-parallel ones on dim 1, norms replicated, the two scalars
without a layout on every rank), and writes ``metadata.json`` with MindFormers' OWN code:

* ``mindformers/checkpoint/sharded_tensor.py::_build_all_sharded_tensor_from_layout_index`` -- the
  per-rank ``ShardedTensor`` metadata rank 0 builds from the layout index
  (``get_all_sharded_tensor_on_rank0`` in a Graph-mode job);
* ``mindformers/checkpoint/checkpoint.py::save_metadata_json`` -- what ``save_checkpoint`` calls in
  a non-redundancy-removing save, i.e. ``metadata.py::get_total_params_file_mapping_info`` and
  ``metadata.py::save_metadata`` (compact ``json.dumps``).

Nothing of MindFormers is re-implemented: only the world size, the rank and the world barrier are
patched (there is no cluster), as tests/mf_stub.py does for the test fixtures. ``import
mindformers`` itself pulls in models, datasets and tokenizers that are not installed (MindFormers is
installed with ``--no-deps``), so the heavy package ``__init__`` files are pre-registered as empty
packages -- the trick of MindFormers' reference tools/mf_stub_import.py -- and every module used
here is then imported and run as shipped. If ``checkpoint.py`` cannot be imported (it imports more
of MindFormers than the metadata path needs), its ``save_metadata_json`` is not re-implemented
either: the two ``metadata.py`` functions it calls are called directly, which is what it does on
rank 0 (the script says which path it took).

Usage: ``python bench/mf2_metadata_size.py [--dp 8 --tp 8 --pp 4] [--opt-shard] [--out DIR] [--parse]``
(``--opt-shard``: moments sharded over dp, optimizer parallel; ``--parse``: also ckptd's bounded
parse of the file in a fresh process: its time and peak RSS growth, the file's bytes already read;
a file over ckptd's bounds is parsed with them lifted, and the script says so). Prints the file's size, ckptd's bound and the ratio, and the counts of
tensors, slices and storage records. Needs MindSpore and MindFormers 2.1.0 (the project venv).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

LAYERS, HIDDEN, FFN, VOCAB, KV_HEADS, HEAD_DIM = 80, 8192, 28672, 32000, 8, 128
PREFIX = "llama2_70b"


def _stub_import() -> None:
    """Pre-register the heavy MindFormers packages as empty ones (their ``__init__`` not run): the
    tests' own helper (one copy of the trick)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.mf_stub import stub_import

    stub_import()


def model_params() -> list[tuple[str, str, tuple[int, ...], int]]:
    """(name, split, global shape, pipeline layer index or -1 first / -2 last stage) of the model."""
    qkv = HIDDEN + 2 * KV_HEADS * HEAD_DIM
    out = [("embedding.word_embeddings.weight", "col", (VOCAB, HIDDEN), -1)]
    for i in range(LAYERS):
        p = f"decoder.layers.{i}."
        out += [(p + "input_layernorm.weight", "rep", (HIDDEN,), i),
                (p + "self_attention.linear_qkv.weight", "col", (qkv, HIDDEN), i),
                (p + "self_attention.linear_proj.weight", "row", (HIDDEN, HIDDEN), i),
                (p + "pre_mlp_layernorm.weight", "rep", (HIDDEN,), i),
                (p + "mlp.linear_fc1.weight", "col", (2 * FFN, HIDDEN), i),
                (p + "mlp.linear_fc2.weight", "row", (HIDDEN, FFN), i)]
    out += [("decoder.final_layernorm.weight", "rep", (HIDDEN,), -2),
            ("output_layer.weight", "col", (VOCAB, HIDDEN), -2)]
    return out


def layout_index(dp: int, tp: int, pp: int, opt_shard: bool):
    """MindFormers' layout index: ``{name: [Layout | None, dtype, shape]}`` and each rank's names."""
    import mindspore as ms
    from mindspore.parallel import Layout

    per_stage = dp * tp
    if LAYERS % pp:
        raise SystemExit(f"{LAYERS} layers do not split into pp={pp} stages")
    layouts = {s: Layout((dp, tp), ("dp", "tp"), list(range(s * per_stage, (s + 1) * per_stage))) for s in range(pp)}
    maps = {"col": ("tp", "None"), "row": ("None", "tp"), "rep": ("None",)}
    opt_maps = {"col": (("dp", "tp"), "None"), "row": ("dp", "tp"), "rep": ("dp",)}  # moments over dp too
    params: dict[str, list] = {}
    stage_names: dict[int, list[str]] = {s: [] for s in range(pp)}
    for name, split, shape, where in model_params():
        stage = 0 if where == -1 else pp - 1 if where == -2 else where // (LAYERS // pp)
        lay = layouts[stage]
        params[name] = [lay(*maps[split]), ms.bfloat16, shape]
        stage_names[stage].append(name)
        for moment in ("adam_m.", "adam_v."):
            tmap = opt_maps[split] if opt_shard and shape[0] % (dp * (tp if split == "col" else 1)) == 0 \
                else maps[split]
            params[moment + name] = [lay(*tmap), ms.float32, shape]
            stage_names[stage].append(moment + name)
    scalars = {"global_step": [None, ms.int32, (1,)], "learning_rate": [None, ms.float32, (1,)]}
    params.update(scalars)
    ranks = {r: stage_names[r // per_stage] + list(scalars) for r in range(pp * per_stage)}
    model_keys = {name for name, _, _, _ in model_params()}
    return params, ranks, model_keys


def write_metadata(dp: int, tp: int, pp: int, opt_shard: bool, path: str) -> str:
    """Write ``path`` with MindFormers' own functions; returns which entry point wrote it."""
    # MindFormers logs under $LOCAL_DEFAULT_PATH (default ./output): beside the file, removed with it
    os.environ.setdefault("LOCAL_DEFAULT_PATH", os.path.join(os.path.dirname(path), "mf-output"))
    os.environ.setdefault("GLOG_v", "3")
    _stub_import()
    from mindformers.checkpoint import metadata as md
    from mindformers.checkpoint import sharded_tensor as st

    world = dp * tp * pp
    md.get_group_size = lambda: world  # the file names' "-NNNNNNN-<world>" part
    st.get_real_group_size = lambda: world
    params, ranks, model_keys = layout_index(dp, tp, pp, opt_shard)
    metas = st._build_all_sharded_tensor_from_layout_index(params, ranks)  # MindFormers' own
    try:
        from mindformers.checkpoint import checkpoint as ck
    except Exception as err:  # noqa: BLE001 - whatever of MindFormers' dependencies is missing
        print(f"mindformers.checkpoint.checkpoint not importable ({type(err).__name__}: {err}); calling the "
              "metadata.py functions its save_metadata_json calls on rank 0", file=sys.stderr)
        md.save_metadata(metas, md.get_total_params_file_mapping_info(metas, PREFIX, model_keys), path)
        return "metadata.save_metadata(get_total_params_file_mapping_info(...))"
    ck.get_real_group_size = lambda: world
    ck.get_real_rank = lambda: 0
    ck.barrier_world = lambda *_a, **_k: None
    ck.save_metadata_json(metas, model_keys, PREFIX, path)
    return "checkpoint.save_metadata_json"


def counts(path: str) -> tuple[int, int, int]:
    with open(path, encoding="utf-8") as fh:
        doc = json.load(fh)
    meta = doc["state_dict_metadata"]
    return (len(meta), sum(len(v["chunk"]) for v in meta.values()),
            sum(len(v) for v in doc["storage_data"].values()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--opt-shard", action="store_true", help="moments sharded over dp (optimizer parallel)")
    ap.add_argument("--out", help="directory to keep metadata.json in (default: a temporary one, removed)")
    ap.add_argument("--parse", action="store_true", help="also parse it with ckptd's bounded reader")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ckptd.format.limits import MAX_METADATA_BYTES, MAX_METADATA_ITEMS

    with tempfile.TemporaryDirectory(prefix="mf2-metadata-") as tmp:
        out = args.out or tmp
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, "metadata.json")
        t0 = time.monotonic()
        writer = write_metadata(args.dp, args.tp, args.pp, args.opt_shard, path)
        seconds = time.monotonic() - t0
        size = os.path.getsize(path)
        tensors, slices, records = counts(path)
        world = args.dp * args.tp * args.pp
        print(f"Llama-2-70B, {world} ranks (dp {args.dp} x tp {args.tp} x pp {args.pp})"
              f"{', moments sharded over dp' if args.opt_shard else ''}: MindFormers 2.1.0 {writer}")
        print(f"metadata.json: {size:,} B = {size / 2**20:.1f} MiB; {tensors:,} tensors, {slices:,} slices, "
              f"{records:,} storage records (written in {seconds:.1f} s)")
        print(f"bound MAX_METADATA_BYTES: {MAX_METADATA_BYTES:,} B = {MAX_METADATA_BYTES / 2**20:.0f} MiB; "
              f"bound / file = {MAX_METADATA_BYTES / size:.2f}x ({'within' if size <= MAX_METADATA_BYTES else 'OVER'})")
        if args.parse:
            got = parse_peak(path, lift=size > MAX_METADATA_BYTES or slices + records > MAX_METADATA_ITEMS)
            print(f"ckptd parse_metadata{' (bounds lifted)' if got['lifted'] else ''}: {got['cpu']:.1f} s CPU, "
                  f"peak RSS +{got['grown'] / 2**20:.1f} MiB = {got['grown'] / size:.2f}x the file "
                  f"({got['placements']:,} placements; {got['total'] / 2**20:.0f} MiB in all with the file's bytes)")
    return 0


_MEASURE = '''
import json, os, sys, time
from ckptd.format import mf2
if sys.argv[2] == "lift":
    mf2.MAX_METADATA_BYTES = mf2.MAX_METADATA_ITEMS = 1 << 62

def status(key):  # bytes, from kB in /proc/self/status
    return next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith(key))

with open(sys.argv[1], "rb") as fh:
    raw = fh.read(os.fstat(fh.fileno()).st_size)
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # the high-water mark (VmHWM) back to the current RSS: the file's bytes are in
before, cpu = status("VmRSS:"), time.process_time()
meta = mf2.parse_metadata(raw, sys.argv[1])
print(json.dumps({"grown": status("VmHWM:") - before, "total": status("VmHWM:"), "cpu": time.process_time() - cpu,
                  "placements": len(meta.placements), "lifted": sys.argv[2] == "lift"}))
'''


def parse_peak(path: str, lift: bool) -> dict:
    """ckptd's parse of ``path`` in a fresh interpreter (as tests/test_unreadable_inputs.py measures it)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _MEASURE, path, "lift" if lift else "keep"], cwd=root,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"parse failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


if __name__ == "__main__":
    sys.exit(main())
