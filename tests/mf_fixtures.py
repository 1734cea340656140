"""Fixture generator: the legacy on-disk layout of MindFormers 2.1.0's ``CheckpointMonitor``.

Every checkpoint file is written by the REAL ``mindspore.save_checkpoint`` (CPU) with the arguments
MindFormers passes (reference: the team's MindFormers LAYOUTS.md §1, not part of this repository; MindFormers source
``core/callback/callback.py`` ``CheckpointMonitor.save_checkpoint`` / ``remove_redundancy`` /
``save_checkpoint_network`` / ``record_last_ckpt_to_json``, MindSpore ``train/model.py``
``_save_final_ckpt``). What is reproduced exactly:

* tree ``<run>/checkpoint/rank_<r>/{P}_rank_<r>[_{k}]-{E}_{S}.{fmt}`` + ``meta.json``,
  ``<run>/checkpoint_network/rank_<r>/{P}_rank_<r>-network-{E}_{S}.{fmt}``,
  ``<run>/strategy/ckpt_strategy_rank_<r>.ckpt``, ``<run>/health_ckpts.json``;
  E/S = epoch and step *within the epoch* of the global step;
* file content and order: the train network's parameters (weights, then the optimizer's
  ``global_step``, ``learning_rate``, ``adam_m.*``, ``adam_v.*``), then the append_dict
  ``epoch_num``, ``step_num`` (= global step), ``loss_scale``, ``global_batch_size`` (0-d int64); the
  appended ``global_step`` (the optimizer's Parameter) collapses into the parameter entry as in
  MindSpore's OrderedDict; ``crc_check`` off, ``remove_redundancy`` passed through (safetensors
  header ``{"format": "ms", "remove_redundancy": "True"|"False"}``);
* modes: data files 0o400 (MindSpore), rank directory 0o750 and ``meta.json`` 0o640 (MindFormers'
  ``set_safe_mode_for_file_or_dir``), ``checkpoint_network/rank_<r>`` as ``os.makedirs`` leaves it;
* ``meta.json`` = ``{"last_epoch", "last_step" (step in epoch), "last_ckpt_file"}`` via a
  NamedTemporaryFile in the rank directory + ``os.replace`` (no fsync), like MindFormers;
* ``remove_redundancy`` (safetensors only): MindSpore's ``get_parameter_redundancy`` and
  ``remove_param_redundancy`` (``mindspore.train._utils``, the functions MindFormers imports) on the
  rank's stage layouts with ``initial_rank`` = first rank of the stage, and MindFormers' choice_func
  (parameters without a layout -- ``global_step``, ``learning_rate``, append keys -- are saved by all);
* breakpoint (``exception_save``) files as MindSpore's ``_save_final_ckpt``: prefix without the
  restart suffix, an ``_n`` from MindSpore's own ``_chg_ckpt_file_name_if_same_exist(..., True)``
  scan, always ckpt, every parameter, ``step_num`` = step *within the epoch* (MindSpore adds
  ``_current_step_num``), no ``meta.json``.

Assumptions (documented, not MindFormers behaviour we could observe in one process): tensors are
the rank's local slices under ``semi_auto_parallel`` with ``dev_matrix = (dp, tp)`` (rank within a
stage = ``dp_index * tp + tp_index``, stage = ``rank // (tp*dp)``); no optimizer sharding; the
append_dict's ``step_num`` offset from a resumed run (``_append_step_num``) is 0, so ``step_num``
is the global step; saves are synchronous (``async_save`` off, so meta.json follows its file at once);
``global_step``/``learning_rate`` have no entry in ``parameter_layout_dict`` (LAYOUTS.md §1.8); a
breakpoint follows at least one regular save of its incarnation (otherwise MindSpore would append the
initial dict: ``global_step`` 0 as int64, no ``global_batch_size``).

Use :meth:`MFJob.save` with ``ranks=[...]`` for dying-gasp subsets, :meth:`MFJob.write_meta` to make
``meta.json`` lag or lie, :func:`tear` for torn writes. :data:`RESUME_SCENARIOS` are ready-made
trees with MindFormers' own resume answer recorded (verified live by
tests/test_mindformers_crosscheck.py when MindFormers is installed; see :func:`mindformers_resume`).
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

import mf_stub

#: LAYOUTS.md §1.2 / MindFormers tools/utils.py: what resume accepts as a checkpoint name, and the rank tag.
RANK_RE = re.compile(r"_rank_(\d+)")
HIDDEN, VOCAB = 8, 16  # fixed full shapes (independent of tp/dp/pp, so jobs of different topology compare)
FILE_MODE, DIR_MODE = 0o640, 0o750  # MindFormers tools/utils.py FILE_PERMISSION / DIRECTORY_PERMISSION
CKPT_MODE = 0o400  # MindSpore chmods checkpoint data files after the rename


def ckpt_name_re(fmt: str = "ckpt") -> re.Pattern[str]:
    """``check_ckpt_file_name``'s pattern ``^[^/]+-\\d+_\\d+\\.{fmt}$``."""
    return re.compile(r"^[^/]+-\d+_\d+\." + re.escape(fmt) + r"$")


@dataclass(frozen=True)
class MFParam:
    """One network weight: ``split`` "col" = dim 0 over tp, "row" = dim 1 over tp, "rep" = replicated."""

    name: str
    shape: tuple[int, ...]
    split: str
    stage: int


def model_params(pp: int = 1) -> list[MFParam]:
    """A tiny llama in MindFormers' naming: embedding + ``max(2, pp)`` layers (``pp`` must divide them) + head.

    Stage ``s`` holds layers ``s*L/pp .. (s+1)*L/pp - 1``; the embedding is on stage 0, the final norm
    and ``lm_head`` on the last stage (pp=2: stage 0 = embedding + layer 0, stage 1 = layer 1 + head)."""
    layers = max(2, pp)
    if layers % pp:
        raise ValueError(f"pp={pp} does not divide {layers} layers")
    per = layers // pp
    out = [MFParam("model.tok_embeddings.embedding_weight", (VOCAB, HIDDEN), "col", 0)]
    for i in range(layers):
        s = i // per
        out += [
            MFParam(f"model.layers.{i}.attention.wq.weight", (HIDDEN, HIDDEN), "col", s),
            MFParam(f"model.layers.{i}.attention.wo.weight", (HIDDEN, HIDDEN), "row", s),
            MFParam(f"model.layers.{i}.attention_norm.weight", (HIDDEN,), "rep", s),
        ]
    out += [MFParam("model.norm_out.weight", (HIDDEN,), "rep", pp - 1),
            MFParam("lm_head.weight", (VOCAB, HIDDEN), "col", pp - 1)]
    return out


MOMENT_PREFIXES = ("adam_m.", "adam_v.")
#: appended after the tensors (the appended global_step collapses into the optimizer parameter's entry)
APPEND_KEYS = ("epoch_num", "step_num", "loss_scale", "global_batch_size")


def _ms():
    import mindspore

    return mindspore


def _safe_mode(path: Path) -> None:
    """MindFormers' set_safe_mode_for_file_or_dir: directories 0o750, files 0o640."""
    os.chmod(path, DIR_MODE if path.is_dir() else FILE_MODE)


@dataclass
class MFJob:
    """One incarnation of a MindFormers job writing into run_dir (= MindFormers output_dir)."""

    run_dir: Path
    tp: int = 2
    dp: int = 2
    pp: int = 1
    prefix: str = "llama"
    fmt: str = "ckpt"  # "ckpt" | "safetensors"
    steps_per_epoch: int = 1000  # file name step = step within the epoch
    # 0 = first incarnation; k -> prefix "{P}_rank_{r}_{k}" (MindSpore's _chg_ckpt_file_name_if_same_exist)
    restart: int = 0
    remove_redundancy: bool = False  # safetensors only: each rank saves only its share
    seed: int = 0
    # appended as 0-d int64; None = not appended (CheckpointMonitor(global_batch_size=None))
    global_batch_size: int | None = 8
    # int -> 0-d int64 (MindFormers' default 1); float -> 0-d float32 (a scale-sense wrapper's outputs[2])
    loss_scale: int | float = 1

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        if self.fmt not in ("ckpt", "safetensors"):
            raise ValueError(f"fmt must be 'ckpt' or 'safetensors', got {self.fmt!r}")
        if self.remove_redundancy and self.fmt != "safetensors":
            raise ValueError("remove_redundancy requires the safetensors format (MindFormers base_trainer raises)")
        if min(self.tp, self.dp, self.pp) < 1 or HIDDEN % self.tp or VOCAB % self.tp:
            raise ValueError(f"tp={self.tp} dp={self.dp} pp={self.pp}: tp must divide {HIDDEN}, all >= 1")
        if self.restart < 0 or self.steps_per_epoch < 1:
            raise ValueError("restart >= 0 and steps_per_epoch >= 1")
        if "/" in self.prefix:
            raise ValueError("MindFormers refuses a prefix containing '/'")
        model_params(self.pp)  # validates pp

    # --- topology ------------------------------------------------------------------------------

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def stage_size(self) -> int:
        return self.tp * self.dp

    def stage_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.stage_size

    def local_rank(self, rank: int) -> int:
        return rank % self.stage_size

    def dp_replicas(self, rank: int) -> list[int]:
        """Ranks holding exactly this rank's slices (same stage, same tp index), ascending."""
        stage, tp_i = self.stage_of(rank), rank % self.tp
        return [stage * self.stage_size + d * self.tp + tp_i for d in range(self.dp)]

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"rank {rank!r} outside 0..{self.world - 1}")

    # --- parameters and layouts ----------------------------------------------------------------

    def params(self, stage: int | None = None) -> list[MFParam]:
        ps = model_params(self.pp)
        return ps if stage is None else [p for p in ps if p.stage == stage]

    def tensor_map(self, p: MFParam) -> tuple[int, ...]:
        """MindSpore tensor_map for dev_matrix (dp, tp): entry 0 = the tp axis (counted from the right)."""
        if p.split == "col":
            return (0,) + (-1,) * (len(p.shape) - 1)
        if p.split == "row":
            return (-1, 0)
        return (-1,) * len(p.shape)

    def layout(self, p: MFParam):
        from ckptd.format.layout import TensorLayout

        return TensorLayout(dev_matrix=(self.dp, self.tp), tensor_map=self.tensor_map(p))

    def local_shape(self, p: MFParam) -> tuple[int, ...]:
        shape = list(p.shape)
        if p.split == "col":
            shape[0] //= self.tp
        elif p.split == "row":
            shape[1] //= self.tp
        return tuple(shape)

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full shape of every weight and moment (all stages)."""
        out = {}
        for prefix in ("",) + MOMENT_PREFIXES:
            out.update({prefix + p.name: p.shape for p in self.params()})
        return out

    def ms_parameter_layout(self, stage: int) -> dict[str, list]:
        """The stage's ``parameter_layout_dict`` as MindSpore holds it for the train network:
        ``name -> [dev_matrix, tensor_map, slice_shape, field_size, uniform_split, opt_shard_group]``
        for the weights and their moments (``global_step``/``learning_rate`` have none; LAYOUTS §1.8)."""
        out = {}
        for prefix in ("",) + MOMENT_PREFIXES:
            for p in self.params(stage):
                out[prefix + p.name] = [[self.dp, self.tp], list(self.tensor_map(p)), list(self.local_shape(p)),
                                        0, True, ""]
        return out

    def redundancy(self, rank: int) -> dict[str, tuple[tuple[int, ...], ...]]:
        """MindSpore's ``get_parameter_redundancy`` for the rank's stage, as MindFormers calls it."""
        from mindspore.train._utils import get_parameter_redundancy

        stage = self.stage_of(rank)
        return get_parameter_redundancy(self.ms_parameter_layout(stage), stage * self.stage_size)

    def saved_params(self, rank: int) -> set[str] | None:
        """``remove_param_redundancy(...)[rank]``: the layout-holding names this rank saves under
        remove_redundancy (None = every name; also None when the job does not remove redundancy)."""
        if not self.remove_redundancy or self.world == 1:  # world 1: stand_alone, MindFormers removes nothing
            return None
        from mindspore.train._utils import remove_param_redundancy

        return set(remove_param_redundancy(self.redundancy(rank)).get(rank, set()))

    def _choice(self, rank: int) -> Callable[[str], bool] | None:
        """MindFormers' choice_func of CheckpointMonitor.remove_redundancy (filter_list never matches here)."""
        if not self.remove_redundancy or self.world == 1:
            return None
        layout_names = set(self.ms_parameter_layout(self.stage_of(rank)))
        names = self.saved_params(rank)
        return lambda x: x not in layout_names or x in names

    # --- values (pure numpy) -------------------------------------------------------------------

    def _rng(self, name: str, global_step: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, zlib.crc32(name.encode()), int(global_step)])

    def full_tensors(self, global_step: int) -> dict[str, np.ndarray]:
        """Unsliced weights and moments of every stage: deterministic in (seed, name, global_step)."""
        out: dict[str, np.ndarray] = {}
        for p in self.params():
            out[p.name] = self._rng(p.name, global_step).standard_normal(p.shape).astype(np.float32)
        for p in self.params():
            n = "adam_m." + p.name
            out[n] = (self._rng(n, global_step).standard_normal(p.shape) * 1e-2).astype(np.float32)
        for p in self.params():
            n = "adam_v." + p.name
            out[n] = (self._rng(n, global_step).random(p.shape) * 1e-4).astype(np.float32)
        return out

    @staticmethod
    def learning_rate(global_step: int) -> np.ndarray:
        return np.array(1e-3 / (1.0 + 1e-3 * global_step), dtype=np.float32)

    def _slice(self, p: MFParam, full: np.ndarray, rank: int) -> np.ndarray:
        t = self.local_rank(rank) % self.tp
        if p.split == "col":
            n = p.shape[0] // self.tp
            return np.ascontiguousarray(full[t * n:(t + 1) * n])
        if p.split == "row":
            n = p.shape[1] // self.tp
            return np.ascontiguousarray(full[:, t * n:(t + 1) * n])
        return full

    def tensors(self, rank: int, global_step: int) -> dict[str, np.ndarray]:
        """The rank's local slices in the train network's order: weights of its stage, the optimizer's
        ``global_step`` int32[1] and ``learning_rate`` float32 0-d, then ``adam_m.*`` and ``adam_v.*``."""
        self._check_rank(rank)
        full = self.full_tensors(global_step)
        mine = self.params(self.stage_of(rank))
        out = {p.name: self._slice(p, full[p.name], rank) for p in mine}
        out["global_step"] = np.array([global_step], dtype=np.int32)
        out["learning_rate"] = self.learning_rate(global_step)
        for prefix in MOMENT_PREFIXES:
            out.update({prefix + p.name: self._slice(p, full[prefix + p.name], rank) for p in mine})
        return out

    def append_values(self, global_step: int, *, breakpoint: bool = False) -> dict[str, np.ndarray]:
        """The appended scalars as they come back from the file (``global_step`` lives in :meth:`tensors`)."""
        epoch, step = self.epoch_step(global_step)
        loss = (np.array(self.loss_scale, np.float32) if isinstance(self.loss_scale, float)
                else np.array(self.loss_scale, np.int64))
        out = {"epoch_num": np.array(epoch, np.int64),
               "step_num": np.array(step if breakpoint else global_step, np.int64), "loss_scale": loss}
        if self.global_batch_size is not None:
            out["global_batch_size"] = np.array(self.global_batch_size, np.int64)
        return out

    def expected_keys(self, rank: int, *, network: bool = False) -> list[str]:
        """Keys of the rank's checkpoint file in file order (ckpt; safetensors files sort them)."""
        choice = self._choice(rank) or (lambda _x: True)
        if network:
            return [p.name for p in self.params(self.stage_of(rank)) if choice(p.name)]
        return [k for k in self.tensors(rank, 1) if choice(k)] + list(self.append_values(1))

    # --- names ---------------------------------------------------------------------------------

    def epoch_step(self, global_step: int) -> tuple[int, int]:
        if global_step < 1:
            raise ValueError("global_step starts at 1")
        return (global_step - 1) // self.steps_per_epoch + 1, (global_step - 1) % self.steps_per_epoch + 1

    def rank_prefix(self, rank: int) -> str:
        return f"{self.prefix}_rank_{rank}" + (f"_{self.restart}" if self.restart else "")

    def file_name(self, rank: int, global_step: int) -> str:
        epoch, step = self.epoch_step(global_step)
        return f"{self.rank_prefix(rank)}-{epoch}_{step}.{self.fmt}"

    def rank_dir(self, rank: int) -> Path:
        return self.run_dir / "checkpoint" / f"rank_{rank}"

    def path(self, rank: int, global_step: int) -> Path:
        return self.rank_dir(rank) / self.file_name(rank, global_step)

    def meta_path(self, rank: int) -> Path:
        return self.rank_dir(rank) / "meta.json"

    @property
    def strategy_dir(self) -> Path:
        return self.run_dir / "strategy"

    # --- writers -------------------------------------------------------------------------------

    def strategy(self, stage: int):
        """The stage's strategy (weights + moments share the weight's layout), as its ranks save it."""
        from ckptd.format.strategy import OpItem, ParamStrategy, Strategy

        entries = [ParamStrategy(prefix + p.name, self.layout(p), stage)
                   for prefix in ("",) + MOMENT_PREFIXES for p in self.params(stage)]
        ops = [OpItem(f"Default/network-MFPipelineWithLossScaleCell/stage{stage}/MatMul-op{stage}", stage,
                      ((self.dp, self.tp), (self.tp, 1)))]
        return Strategy.build(entries, op_items=ops)

    def strategy_files(self) -> list[Path]:
        """``<run>/strategy/ckpt_strategy_rank_<r>.ckpt`` for every rank (each holds only its stage)."""
        from ckptd.format.strategy import save_strategy

        self.strategy_dir.mkdir(parents=True, exist_ok=True)
        out = []
        for r in range(self.world):
            path = self.strategy_dir / f"ckpt_strategy_rank_{r}.ckpt"
            save_strategy(self.strategy(self.stage_of(r)), path, overwrite=True)
            out.append(path)
        return out

    def _make_rank_dir(self, rank: int) -> Path:
        d = self.rank_dir(rank)
        if not d.exists():  # CheckpointMonitor._save_ckpt: makedirs + set_safe_mode, just before the first save
            d.mkdir(parents=True, exist_ok=True)
            _safe_mode(d)
        return d

    def _write(self, path: Path, tensors: dict[str, np.ndarray], append: dict | None, *,
               choice: Callable[[str], bool] | None, fmt: str, remove_redundancy: bool | None) -> None:
        ms = _ms()
        items = [{"name": n, "data": ms.Tensor(a)} for n, a in tensors.items()]
        kwargs = {} if remove_redundancy is None else {"remove_redundancy": remove_redundancy}
        # ms.save_checkpoint deletes a stale final/.tmp file, writes <stem>.tmp, renames, chmods 0o400.
        ms.save_checkpoint(items, str(path), False, False, append, None, "AES-GCM", format=fmt,
                           choice_func=choice, **kwargs)

    def _append_dict(self, global_step: int, *, breakpoint: bool = False) -> dict:
        ms = _ms()
        epoch, step = self.epoch_step(global_step)
        loss = float(self.loss_scale) if isinstance(self.loss_scale, float) else int(self.loss_scale)
        # MindFormers' dict: epoch_num, step_num, global_step (the optimizer's Parameter), loss_scale,
        # global_batch_size. MindSpore turns each non-Tensor into Tensor(value): int -> int64, float -> float32.
        out = {"epoch_num": epoch, "step_num": step if breakpoint else global_step,
               "global_step": ms.Tensor(np.array([global_step], np.int32)),
               "loss_scale": ms.Tensor(np.array(loss, np.float32)) if isinstance(loss, float) else loss}
        if self.global_batch_size is not None:
            out["global_batch_size"] = int(self.global_batch_size)
        return out

    def save(self, global_step: int, ranks: Iterable[int] | None = None, *, breakpoint: bool = False,
             meta: bool = True, peer_writes: dict[int, int] | None = None) -> dict[int, Path]:
        """One save of ``global_step`` by ``ranks`` (default all). Returns rank -> written path.

        ``breakpoint``: the exception_save file instead (no meta.json). ``peer_writes={peer: saver}``:
        MindFormers' TFT dying gasp with remove_redundancy (``_do_remove_redundancy_for_tft``): the saver
        writes the peer's redundancy-removed share into ``rank_<peer>/`` under the peer's name (and the
        peer's meta.json); the saver, a dp replica of the peer, also writes its own file."""
        ranks = list(range(self.world)) if ranks is None else [int(r) for r in ranks]
        for r in ranks:
            self._check_rank(r)
        peer_writes = dict(peer_writes or {})
        if peer_writes:
            if not self.remove_redundancy:
                raise ValueError("MindFormers writes into peer directories only with remove_redundancy "
                                 "(without it a TFT save leaves files in the saver's directory only)")
            if breakpoint:
                raise ValueError("peer_writes are TFT saves, not exception_save breakpoints")
            for peer, saver in peer_writes.items():
                self._check_rank(peer)
                if peer not in self.dp_replicas(saver):
                    raise ValueError(f"rank {saver} is no dp replica of rank {peer} ({self.dp_replicas(peer)})")
                if saver not in ranks:
                    ranks.append(saver)
        out: dict[int, Path] = {}
        for r in ranks:
            out[r] = self._save_breakpoint(r, global_step) if breakpoint else self._save_one(r, r, global_step, meta)
        for peer, saver in peer_writes.items():
            out[peer] = self._save_one(peer, saver, global_step, meta)
        return out

    def _save_one(self, rank: int, data_rank: int, global_step: int, meta: bool) -> Path:
        d = self._make_rank_dir(rank)
        path = d / self.file_name(rank, global_step)
        self._write(path, self.tensors(data_rank, global_step), self._append_dict(global_step),
                    choice=self._choice(rank), fmt=self.fmt, remove_redundancy=self.remove_redundancy)
        if meta:
            epoch, step = self.epoch_step(global_step)
            self.write_meta(rank, epoch, step, path.name)
        return path

    def _save_breakpoint(self, rank: int, global_step: int) -> Path:
        from mindspore.train.callback._checkpoint import _chg_ckpt_file_name_if_same_exist

        d = self._make_rank_dir(rank)
        epoch, step = self.epoch_step(global_step)
        prefix = _chg_ckpt_file_name_if_same_exist(str(d), f"{self.prefix}_rank_{rank}", True)
        path = d / f"{prefix}-{epoch}_{step}_breakpoint.ckpt"
        # model.py _save_final_ckpt: save_checkpoint(train_network, file, integrated_save, async_save,
        # append_dict, enc_key, enc_mode) -- no format (ckpt), no choice_func, no remove_redundancy.
        self._write(path, self.tensors(rank, global_step), self._append_dict(global_step, breakpoint=True),
                    choice=None, fmt="ckpt", remove_redundancy=None)
        return path

    def write_meta(self, rank: int, epoch: int, step: int, file_name: str) -> Path:
        """``record_last_ckpt_to_json``: NamedTemporaryFile in the rank dir, os.replace, chmod 0o640."""
        d = self._make_rank_dir(rank)
        with tempfile.NamedTemporaryFile("w", delete=False, dir=d) as tmp:
            json.dump({"last_epoch": epoch, "last_step": step, "last_ckpt_file": file_name}, tmp)
            tmp_path = tmp.name
        os.replace(tmp_path, d / "meta.json")
        _safe_mode(d / "meta.json")
        return d / "meta.json"

    def network_copy(self, global_step: int, ranks: Iterable[int] | None = None) -> list[Path]:
        """``save_network_params=True``: ``checkpoint_network/rank_<r>/{P}_rank_<r>-network-{E}_{S}.{fmt}``
        with the network weights only (``save_obj.network``, empty append_dict). The prefix carries the
        restart suffix like the main files. Under remove_redundancy it is the rank's share as well."""
        epoch, step = self.epoch_step(global_step)
        out = []
        for r in (range(self.world) if ranks is None else ranks):
            d = self.run_dir / "checkpoint_network" / f"rank_{r}"
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"{self.rank_prefix(r)}-network-{epoch}_{step}.{self.fmt}"
            local = self.tensors(r, global_step)
            weights = {p.name: local[p.name] for p in self.params(self.stage_of(r))}
            self._write(path, weights, {}, choice=self._choice(r), fmt=self.fmt,
                        remove_redundancy=self.remove_redundancy)
            out.append(path)
        return out


def write_health(run_dir: Path, records: list[tuple[str, int]]) -> Path:
    """``<run>/health_ckpts.json`` = ``[{"is_health": flag, "ckpt_name": name}]`` (1 = ABNORMAL,
    MindFormers' inverted key). ``records`` are ``(ckpt_name, flag)``. Plain open('w') + json indent 4,
    then chmod 0o640, as CheckpointMonitor does (not atomic)."""
    path = Path(run_dir) / "health_ckpts.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump([{"is_health": int(flag), "ckpt_name": name} for name, flag in records], fh, indent=4)
    _safe_mode(path)
    return path


def tear(path: Path, keep: float = 0.5) -> None:
    """Truncate a (0o400) checkpoint in place to ``keep`` of its size: a torn write that still carries
    its final name (MindSpore renames without fsync). The file's mode is restored afterwards."""
    path = Path(path)
    mode = stat.S_IMODE(path.stat().st_mode)
    size = path.stat().st_size
    os.chmod(path, mode | stat.S_IWUSR)
    try:
        os.truncate(path, int(size * keep))
    finally:
        os.chmod(path, mode)


# --------------------------------------------------------------------------------------------------
# MindFormers' own code (child process, see mf_stub.py)


def mindformers_available() -> bool:
    return mf_stub.available()


def mindformers_resume_many(cases: list[tuple[Path, int, str]], work_dir: Path | None = None) -> list[dict]:
    """MindFormers' ``get_resume_checkpoint_by_meta`` (LAYOUTS.md §3.1 B.4) on several checkpoint dirs.

    ``cases`` = ``[(checkpoint_dir, world, fmt)]``. Each result: ``choice`` (rank 0's file name, or None),
    ``no_meta`` (MindFormers found no usable meta.json and falls back to each rank's newest file),
    ``error`` (what MindFormers raised), ``record`` (its resume_record/latest_checkpointed_iteration.txt)
    and ``per_rank`` (what ranks 0..world-1 read back from that record). MindFormers itself ignores
    ``world``: it counts the ``rank_*`` directories (weakness 2)."""
    req = {"op": "resume", "cases": [{"checkpoint_dir": str(Path(d).resolve()), "world": int(w), "fmt": f}
                                     for d, w, f in cases]}
    return mf_stub.run(req, work_dir)["results"]


def mindformers_resume(checkpoint_dir: Path, world: int, fmt: str = "ckpt") -> dict:
    return mindformers_resume_many([(checkpoint_dir, world, fmt)])[0]


def mindformers_resume_choice(checkpoint_dir: Path, world: int) -> str | None:
    """The file name MindFormers 2.1.0 resumes rank 0 from, or None when it picks none by meta.json
    (it raised, or found no meta.json and falls back to newest-mtime per rank). Format from the tree."""
    fmt = "safetensors" if any(Path(checkpoint_dir).glob("rank_*/*.safetensors")) else "ckpt"
    return mindformers_resume(checkpoint_dir, world, fmt)["choice"]


def mindformers_train(run_dir: Path, params: list[tuple[str, tuple[int, ...]]], *, prefix: str = "toy",
                      steps_per_epoch: int = 6, epochs: int = 1, save_steps: int = 2, ranks=(0,),
                      fmt: str = "ckpt", network: bool = False, global_batch_size: int | None = None,
                      raise_at: int | None = None, keep_max: int = 1000, work_dir: Path | None = None) -> None:
    """One incarnation (a fresh process) of MindFormers' CheckpointMonitor(directory=run_dir) through a
    real ``Model.train`` on a toy net whose parameters have exactly ``params``' names and shapes, for
    each simulated rank in turn ($RANK_ID). ``raise_at`` = global step to fail at (exception_save on)."""
    mf_stub.run({"op": "train", "directory": str(Path(run_dir).resolve()), "params": [[n, list(s)] for n, s in params],
                 "prefix": prefix, "steps_per_epoch": steps_per_epoch, "epochs": epochs, "save_steps": save_steps,
                 "ranks": list(ranks), "fmt": fmt, "network": network, "global_batch_size": global_batch_size,
                 "raise_at": raise_at, "keep_max": keep_max}, work_dir)


# --------------------------------------------------------------------------------------------------
# Resume scenarios with MindFormers' recorded answer


@dataclass(frozen=True)
class ResumeScenario:
    """A legacy tree and what MindFormers 2.1.0 resumes from it (rank 0's file).

    ``outcome``: "file" (``mindformers`` is the name), "no_meta" (newest file per rank, no choice by
    meta) or "error". Build with ``job = scenario.build(run_dir)``; the checkpoint dir is
    ``run_dir / "checkpoint"``, the intended world ``job.world``."""

    name: str
    build: Callable[[Path], MFJob]
    mindformers: str | None
    outcome: str = "file"
    note: str = ""
    fmt: str = "ckpt"

    def checkpoint_dir(self, run_dir: Path) -> Path:
        return Path(run_dir) / "checkpoint"


def _complete(run):
    job = MFJob(run)
    job.save(100), job.save(200)
    return job


def _rank_missing_newest(run):
    job = MFJob(run)
    job.save(100), job.save(200), job.save(300, ranks=[0, 1, 3])
    return job


def _meta_lags(run):
    job = MFJob(run)
    job.save(100), job.save(200, ranks=[0, 1, 2]), job.save(200, ranks=[3], meta=False)
    return job


def _torn_newest(run):
    job = MFJob(run)
    job.save(100)
    tear(job.save(200)[1])
    return job


def _dying_gasp(run):
    job = MFJob(run)
    job.save(100), job.save(200, ranks=[0, 1])
    return job


def _no_meta(run):
    job = MFJob(run)
    job.save(100, meta=False), job.save(200, meta=False)
    return job


def _corrupt_meta(run):
    job = MFJob(run)
    job.save(100), job.save(200)
    meta = job.meta_path(3)
    os.chmod(meta, 0o640)
    meta.write_text("{")
    return job


def _restart_resumed(run):
    MFJob(run).save(100), MFJob(run).save(200), MFJob(run).save(300, ranks=[0, 1])
    job = MFJob(run, restart=1)
    job.save(250)
    return job


def _restart_from_scratch(run):
    first = MFJob(run)
    first.save(100), first.save(200), first.save(300)
    job = MFJob(run, restart=1)
    job.save(50)
    return job


def _missing_top_rank_dir(run):
    job = MFJob(run)
    job.save(100, ranks=[0, 1, 2]), job.save(200, ranks=[0, 1, 2])
    return job


def _peer_writes(run):
    job = MFJob(run, fmt="safetensors", remove_redundancy=True)
    job.save(100), job.save(200, ranks=[0, 1], peer_writes={2: 0, 3: 1})
    return job


def _epochs(run):
    job = MFJob(run, steps_per_epoch=100)
    job.save(100), job.save(150)
    return job


def _meta_lies(run):
    job = MFJob(run)
    job.save(100, ranks=[0, 1, 2])
    job.write_meta(3, 1, 100, "llama_rank_3-1_100.ckpt")
    return job


def _resume_demo(run):
    """The synthetic tree of the committed fixtures/mindformers/resume_demo (make_samples.py part E)."""
    job = MFJob(run, prefix="toy")
    job.save(2), job.save(4), job.save(6, ranks=[0, 1, 3])
    job.write_meta(2, 1, 6, "toy_rank_2-1_6.ckpt")  # rank 2 lost its step-6 file, its meta.json says 6
    job.write_meta(3, 1, 4, "toy_rank_3-1_4.ckpt")  # rank 3's meta.json lags (async)
    return job


def _pp_missing(run):
    job = MFJob(run, tp=2, dp=1, pp=2)
    job.strategy_files()
    job.save(100), job.save(200, ranks=[0, 1, 2])
    return job


RESUME_SCENARIOS: tuple[ResumeScenario, ...] = (
    ResumeScenario("complete", _complete, "llama_rank_0-1_200.ckpt"),
    ResumeScenario("rank_missing_newest", _rank_missing_newest, "llama_rank_0-1_200.ckpt",
                   note="rank 2 never wrote 300, its meta.json stays at 200 = the minimum"),
    ResumeScenario("meta_lags", _meta_lags, "llama_rank_0-1_100.ckpt",
                   note="every rank wrote 200 but rank 3's meta.json still says 100: MindFormers takes the minimum"),
    ResumeScenario("torn_newest", _torn_newest, "llama_rank_0-1_200.ckpt",
                   note="rank 1's 200 is truncated; MindFormers checks names only and still picks it"),
    ResumeScenario("dying_gasp", _dying_gasp, "llama_rank_0-1_100.ckpt",
                   note="only ranks 0,1 wrote 200 (no remove_redundancy: peers get nothing)"),
    ResumeScenario("no_meta", _no_meta, None, "no_meta",
                   note="no meta.json at all: every rank loads its newest-mtime file"),
    ResumeScenario("corrupt_meta", _corrupt_meta, "llama_rank_0-1_200.ckpt",
                   note="rank 3's meta.json is not JSON: skipped with a warning"),
    ResumeScenario("restart_resumed", _restart_resumed, "llama_rank_0_1-1_250.ckpt",
                   note="restart wrote llama_rank_r_1-1_250; selection only looks at the new prefix"),
    ResumeScenario("restart_from_scratch", _restart_from_scratch, "llama_rank_0_1-1_50.ckpt",
                   note="a restart's meta.json overwrites the old run's; the older-step _1 file wins (weakness 5)"),
    ResumeScenario("missing_top_rank_dir", _missing_top_rank_dir, "llama_rank_0-1_200.ckpt",
                   note="rank_3/ never existed: MindFormers counts 3 rank dirs and resumes a 3-rank set (weakness 2)"),
    ResumeScenario("peer_writes", _peer_writes, "llama_rank_0-1_200.safetensors", fmt="safetensors",
                   note="TFT + remove_redundancy: ranks 0,1 wrote 2,3's shares and meta.json"),
    ResumeScenario("epochs", _epochs, "llama_rank_0-2_50.ckpt", note="global step 150 = epoch 2 step 50"),
    ResumeScenario("meta_lies", _meta_lies, None, "error",
                   note="rank 3 has a meta.json naming 100 but no file: no complete set, MindFormers raises"),
    ResumeScenario("resume_demo", _resume_demo, "toy_rank_0-1_4.ckpt",
                   note="LAYOUTS.md §3.1 [run]; the committed resume_record holds MindFormers' answer"),
    ResumeScenario("pp_missing", _pp_missing, "llama_rank_0-1_100.ckpt",
                   note="pp=2: rank 3 (stage 1) did not write 200"),
)
