"""Run MindFormers 2.1.0's OWN code (``CheckpointMonitor``, ``tools/resume_ckpt.py``) in a child process.

``import mindformers`` pulls in models, datasets, transformers, jieba, ... (LAYOUTS.md §4.1), so the
child pre-registers a few packages as empty module objects (their ``__init__`` is not run; every other
module, including every function that writes or selects files, is MindFormers' own code) -- the trick
of the reference ``tools/mf_stub_import.py``, copied here. Installed with
``pip install --no-deps mindformers==2.1.0`` plus pyyaml, deprecated, regex, requests, tensorboardX,
tokenizers (see the Makefile).

Why a child process: MindFormers sets global MindSpore context (graph mode, device memory), writes
logs under ``$LOCAL_DEFAULT_PATH`` (default ``./output``) and MindSpore's ``ModelCheckpoint`` takes
the cwd at import time as its default directory. The child runs with ``cwd`` = a scratch directory
and ``LOCAL_DEFAULT_PATH`` inside it, so nothing leaks into the pytest process or the repository.

Protocol: ``python tests/mf_stub.py REQUEST.json RESULT.json``; the parent side is :func:`run`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

STUB_PACKAGES = ("mindformers", "mindformers.core", "mindformers.trainer", "mindformers.models")
MINDFORMERS_VERSION = "2.1.0"
# Environment a distributed launcher would set; a stray value would change MindFormers' rank/world logic.
_SCRUB_ENV = ("RANK_ID", "RANK_SIZE", "RANK_TABLE_FILE", "MS_ENABLE_TFT", "MS_WORKER_NUM", "MS_ROLE",
              "LOCAL_DEFAULT_PATH", "LOG_MF_PATH", "MF_STUB_PACKAGES")


def available() -> bool:
    """MindFormers is installed (checked without importing it)."""
    try:
        return importlib.util.find_spec("mindformers") is not None
    except (ImportError, ValueError):
        return False


def run(request: dict, work_dir: Path | None = None, timeout: float = 180.0) -> dict:
    """Run one request in a fresh interpreter; returns its JSON result (raises with the child's stderr)."""
    own_tmp = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="mf-child-")) if own_tmp else Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    req, res = work / "mf_request.json", work / "mf_result.json"
    req.write_text(json.dumps(request))
    res.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB_ENV}
    env.update(GLOG_v="3", MS_SUBMODULE_LOG_v="{ME:3}", LOCAL_DEFAULT_PATH=str(work / "output"),
               PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(req), str(res)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not res.exists():
        raise RuntimeError(f"MindFormers child failed (rc={proc.returncode}) for {request.get('op')}:\n"
                           f"{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}")
    out = json.loads(res.read_text())
    if own_tmp:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return out


# --------------------------------------------------------------------------------------------------
# child side


def stub_import() -> None:
    """Pre-register STUB_PACKAGES as empty packages (correct ``__path__``, ``__init__`` not executed)."""
    spec = importlib.util.find_spec("mindformers")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("mindformers is not installed")
    mf_root = list(spec.submodule_search_locations)[0]
    site = os.path.dirname(mf_root)
    for name in STUB_PACKAGES:
        pkg_dir = os.path.join(site, *name.split("."))
        mod = types.ModuleType(name)
        mod.__path__ = [pkg_dir]
        mod.__file__ = os.path.join(pkg_dir, "__init__.py")
        mod.__package__ = name
        mspec = importlib.util.spec_from_loader(name, loader=None, is_package=True)
        mspec.submodule_search_locations = [pkg_dir]
        mod.__spec__ = mspec
        if name == "mindformers":
            mod.__version__ = MINDFORMERS_VERSION
        sys.modules[name] = mod
    # Import order matters: tools first avoids the tools.register <-> core.context circular import that
    # the real top-level __init__ hides.
    import mindformers.tools  # noqa: F401


def _context() -> None:
    from mindformers.core.context.build_context import Context
    from mindformers.tools.register import MindFormerConfig

    Context(MindFormerConfig(context={"mode": 0, "device_target": "CPU", "max_device_memory": "2GB"}))


def _toy_net(params: list[list]):
    """A Cell whose parameters carry exactly the given (dotted) names and shapes, in that order.

    The names are set explicitly (a ParameterTuple keeps them), so the checkpoint keys equal an
    MFJob's for a tp=1 job; construct touches every parameter so each gets a gradient and moments."""
    import numpy as np
    import mindspore as ms
    from mindspore import nn, ops

    class ToyNet(nn.Cell):
        def __init__(self):
            super().__init__()
            rng = np.random.default_rng(0)
            self.weights = ms.ParameterTuple([
                ms.Parameter(ms.Tensor(rng.standard_normal(tuple(shape)).astype(np.float32) * 0.1), name=name)
                for name, shape in params])

        def construct(self, x):
            s = 0.0
            for w in self.weights:
                s = s + ops.mean(w)
            return x * s

    return ToyNet()


def _train_once(req: dict, rank: int) -> None:
    import numpy as np
    import mindspore as ms
    from mindspore import nn
    from mindspore.train import Callback, Model

    from mindformers.core.callback.callback import CheckpointMonitor

    os.environ["RANK_ID"] = str(rank)  # get_real_rank(): no communication initialised -> $RANK_ID
    n = int(req["steps_per_epoch"])
    rng = np.random.default_rng(rank)
    data = {"x": rng.standard_normal((n, 4)).astype(np.float32), "y": rng.standard_normal((n, 4)).astype(np.float32)}
    dataset = ms.dataset.NumpySlicesDataset(data=data, shuffle=False).batch(1)
    net = _toy_net(req["params"])
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3)
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=opt)
    cb = CheckpointMonitor(prefix=req["prefix"], directory=req["directory"],
                           save_checkpoint_steps=int(req["save_steps"]),
                           keep_checkpoint_max=int(req.get("keep_max", 1000)),
                           integrated_save=False, save_network_params=bool(req.get("network", False)),
                           global_batch_size=req.get("global_batch_size"),
                           checkpoint_format=req.get("fmt", "ckpt"),
                           exception_save=req.get("raise_at") is not None)

    class RaiseAt(Callback):
        def on_train_step_end(self, run_context):
            if run_context.original_args().cur_step_num == req.get("raise_at"):
                raise RuntimeError("deliberate failure")

    try:
        model.train(int(req["epochs"]), dataset, callbacks=[cb, RaiseAt()], dataset_sink_mode=False)
    except RuntimeError as err:
        if "deliberate failure" not in str(err):
            raise


def _op_train(req: dict) -> dict:
    """One incarnation of a job: CheckpointMonitor through a real Model.train, for each simulated rank."""
    _context()
    for rank in req.get("ranks", [0]):
        _train_once(req, int(rank))
    return {"ok": True}


def _op_resume(req: dict) -> dict:
    """MindFormers' legacy resume-by-meta selection (resume_ckpt.get_resume_checkpoint_by_meta, §3.1 B.4)."""
    import mindformers.tools.resume_ckpt as rc

    results = []
    for i, case in enumerate(req["cases"]):
        ckpt_dir, world, fmt = case["checkpoint_dir"], int(case["world"]), case.get("fmt", "ckpt")
        out_root = os.path.join(os.getcwd(), f"output_{i}")
        os.environ["LOCAL_DEFAULT_PATH"] = out_root  # resume_record/ goes under get_output_root_path()
        os.environ.pop("RANK_ID", None)
        record = os.path.join(out_root, "resume_record", "latest_checkpointed_iteration.txt")
        entry: dict = {"choice": None, "no_meta": False, "error": None, "record": None, "per_rank": {}}
        try:
            answer = rc.get_resume_checkpoint_by_meta(ckpt_dir, fmt)
            if answer is True:
                entry["no_meta"] = True
            else:
                entry["choice"] = answer
        except BaseException as err:  # noqa: BLE001 - MindFormers raises ValueError/RuntimeError/FileNotFoundError
            entry["error"] = f"{type(err).__name__}: {err}"
        if os.path.exists(record):
            with open(record, encoding="utf-8") as fh:
                entry["record"] = fh.read()
            for r in range(world):  # what every other rank reads back from rank 0's record
                try:
                    got = rc.get_resume_ckpt(record, r)
                    entry["per_rank"][str(r)] = None if got is True else got
                except BaseException as err:  # noqa: BLE001
                    entry["per_rank"][str(r)] = f"{type(err).__name__}: {err}"
        results.append(entry)
    return {"results": results}


def _dense_net():
    """MindFormers' reference sample network (``fc1: Dense(4,8)``, ``fc2: Dense(8,2)``) with its optimizer."""
    import mindspore as ms
    from mindspore import nn

    ms.set_seed(0)

    class ToyNet(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Dense(4, 8), nn.Dense(8, 2)

        def construct(self, x):
            return self.fc2(self.fc1(x))

    net = ToyNet()
    return net, nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3)


def _op_ckpt2_save(req: dict) -> dict:
    """Checkpoint 2.0 saves by MindFormers' own ``checkpoint.save_checkpoint`` (single rank; sync, or
    async with ``AsyncSaveManager`` and an explicit finalize), as the reference sample C does."""
    from mindformers.checkpoint.checkpoint import AsyncSaveManager, CommonInfo, save_checkpoint

    _context()
    net, opt = _dense_net()
    mgr = AsyncSaveManager(True) if req.get("async") else None
    done: list = []
    for it in req["iterations"]:
        save_checkpoint(iteration=it, network=net, optimizer=opt, async_save_manager=mgr,
                        common_info=CommonInfo(epoch_num=1, step_num=it, global_step=it, loss_scale=1.0,
                                               global_batch_size=8),
                        keep_max_num=int(req.get("keep_max", 5)), user_prefix=req["prefix"],
                        save_checkpoint_path=req["root"], current_ckpt_step_list=done)
    if mgr is not None and req.get("finalize", True):
        mgr.maybe_finalize(wait_finish=True)
    return {"ok": True}


def _op_ckpt2_metadata(req: dict) -> dict:
    """``metadata.json`` (and ``common.json``) of a simulated dp x tp job, by MindFormers' own functions
    (reference sample D): real ``mindspore.parallel.Layout`` objects, ``get_group_size`` patched to
    the world size. The caller writes the safetensors files the metadata promises."""
    import mindspore as ms
    from mindspore.parallel import Layout

    import mindformers.checkpoint.metadata as md
    from mindformers.checkpoint.checkpoint import CommonInfo
    from mindformers.checkpoint.fully_parallel import (
        BalancedShardPlan, _compute_balanced_assignment_on_rank0, save_balanced_metadata)
    from mindformers.checkpoint.sharded_tensor import get_sharded_tensor_from_strategy_metadata
    from mindformers.checkpoint.utils import FileType

    dp, tp = int(req["dp"]), int(req["tp"])
    world = dp * tp
    md.get_group_size = lambda: world
    lay = Layout((dp, tp), ("dp", "tp"))
    specs = {"tp_rows": lay("tp", "None"), "tp": lay("tp"), "tp_cols": lay("None", "tp"), "rep": lay("None")}
    infos = {name: [specs[split], ms.float32, tuple(shape)] for name, split, shape in req["params"]}
    metas = {r: get_sharded_tensor_from_strategy_metadata(infos, r) for r in range(world)}
    model_keys = {name for name, _, _ in req["params"] if not name.startswith(("adam_m.", "adam_v."))}
    for it_dir in req["plain"]:
        os.makedirs(it_dir, exist_ok=True)
        md.save_metadata(metas, md.get_total_params_file_mapping_info(metas, req["prefix"], model_keys),
                         os.path.join(it_dir, "metadata.json"))
    for root, it in req["balanced"]:
        plans = []
        for ftype, keep in ((FileType.MODEL, lambda n: n in model_keys), (FileType.OPTIMIZER, lambda n: n not in model_keys)):
            side = {r: {n: t for n, t in m.items() if keep(n)} for r, m in metas.items()}
            payloads, full = _compute_balanced_assignment_on_rank0(side, world)
            plans.append((BalancedShardPlan(total_files_num=payloads[0][3], full_assignment=full), ftype, None))
        os.makedirs(os.path.join(root, f"iteration_{it:08d}"), exist_ok=True)
        save_balanced_metadata(root, it, req["prefix"], plans, metas)
    for path, fields in req.get("common", []):
        CommonInfo(**fields).save_common(path)
    return {"ok": True}


def _op_checkpoint_path(req: dict) -> dict:
    """MindFormers' own Checkpoint 2.0 resume choice, ``get_checkpoint_path`` (LAYOUTS.md §3.2)."""
    from mindformers.checkpoint.checkpoint import get_checkpoint_path

    out = []
    for path in req["paths"]:
        try:
            out.append({"path": get_checkpoint_path(path), "error": None})
        except BaseException as err:  # noqa: BLE001 - ValueError/FileNotFoundError are its answers
            out.append({"path": None, "error": f"{type(err).__name__}: {err}"})
    return {"results": out}


def main(argv: list[str]) -> int:
    req_path, res_path = argv[1], argv[2]
    with open(req_path, encoding="utf-8") as fh:
        req = json.load(fh)
    stub_import()
    ops_ = {"train": _op_train, "resume": _op_resume, "ckpt2_save": _op_ckpt2_save,
            "ckpt2_metadata": _op_ckpt2_metadata, "checkpoint_path": _op_checkpoint_path}
    result = ops_[req["op"]](req)
    tmp = res_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(tmp, res_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
