"""What a conversion plan is made of, and what it costs: the planner's frozen inputs and outputs.

:mod:`ckptd.convert.plan` computes these (pure overlap math); the executor consumes them; the CLI,
the daemon and ``--plan`` render them with :meth:`ConversionPlan.to_dict`. The memory estimate
(:func:`estimate_peak`) lives here because it must follow how the executor buffers tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from ckptd.errors import CkptdError
from ckptd.format.dtypes import MS_DTYPES, STR_TYPE, itemsize
from ckptd.format.layout import Slice

RANK_ID_ENTRY = "rank_id"
MAP_TENSOR_TYPE = "MapTensor"
#: the executor reads source rows in chunks of about this many bytes (mapped pages are released
#: after each chunk), so reading adds about this much to the resident memory.
CHUNK_BYTES = 16 << 20
#: a destination tensor is produced, written and re-read in bands of about this many bytes
#: (whole rows of dim 0); the band is the unit of the per-rank pipeline (ckptd/convert/assemble.py).
BAND_BYTES = 16 << 20
#: bands one destination rank holds at once: being written, queued, being assembled (+ spare).
PIPELINE_BANDS = 4


class ConvertError(CkptdError):
    """A conversion that cannot be done exactly; raised before any output is written."""

    code = "convert_impossible"
    default_hint = "check that --src-strategy describes the source files and --to-strategy the target job"


# --- inputs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardEntry:
    """One entry of a source file, as indexed (no data)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    #: digest of the first bytes of the payload (``consistency.PROBE_BYTES``; None = not read, e.g.
    #: encrypted): lets the planner tell replicas from different slices (ckptd/convert/consistency.py)
    probe: bytes | None = field(default=None, compare=False)
    constant: bool = field(default=False, compare=False)  # the probed bytes repeat one element


@dataclass(frozen=True)
class SourceShard:
    """What one source rank's checkpoint file holds, in file order."""

    rank: int
    path: str | tuple[str, ...]  # a Checkpoint 2.0 rank: its model file and its optimizer file
    entries: tuple[ShardEntry, ...]

    def get(self, name: str) -> ShardEntry | None:
        for e in self.entries:
            if e.name == name:
                return e
        return None


# --- outputs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """Copy ``src_region`` of source rank ``src_rank``'s shard into ``dst_region`` of the slice.

    Both regions are in *local* coordinates (of the source shard and of the destination slice).
    """

    src_rank: int
    src_region: Slice
    dst_region: Slice
    src_shape: tuple[int, ...]  # shape of the source shard (for byte-span estimates)


TaskKind = Literal["reshard", "copy", "rank_id"]


@dataclass(frozen=True)
class TensorTask:
    """One entry of a destination file. ``dst_slice`` is in full-tensor coordinates."""

    name: str
    dtype: str
    kind: TaskKind
    full_shape: tuple[int, ...]
    dst_slice: Slice
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return self.dst_slice.numel * self._itemsize

    @property
    def bytes_read(self) -> int:
        return sum(p.src_region.numel for p in self.pieces) * self._itemsize

    @property
    def _itemsize(self) -> int:
        """Bytes per element; 0 for strings and unknown types (they are not sized by shape)."""
        return 0 if self.dtype == STR_TYPE or self.dtype not in MS_DTYPES else itemsize(self.dtype)


@dataclass(frozen=True)
class RankPlan:
    """Everything destination rank ``rank`` will hold and where it comes from."""

    rank: int
    stage: int
    local_rank: int
    tasks: tuple[TensorTask, ...]
    src_ranks: tuple[int, ...]
    bytes_out: int
    bytes_read: int
    peak_bytes: int  # estimated extra memory to convert this rank (estimate_peak)


@dataclass(frozen=True)
class ConversionPlan:
    src_world: int
    src_stage_devices: int
    dst_world: int  # ranks of the whole destination layout (1 when unsharded)
    dst_stage_devices: int
    ranks: tuple[RankPlan, ...]  # the ranks to convert (all, or the ones asked for)
    src_files: Mapping[int, str | tuple[str, ...]]
    notes: tuple[str, ...] = ()
    src_strategy_hash: str | None = None
    dst_strategy_hash: str | None = None
    layout_params: tuple[str, ...] = field(default=())

    @property
    def bytes_out(self) -> int:
        return sum(r.bytes_out for r in self.ranks)

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.ranks)

    @property
    def peak_bytes(self) -> int:
        return max((r.peak_bytes for r in self.ranks), default=0)

    def to_dict(self) -> dict[str, object]:
        return {
            "src_world": self.src_world,
            "dst_world": self.dst_world,
            "src_strategy_hash": self.src_strategy_hash,
            "dst_strategy_hash": self.dst_strategy_hash,
            "bytes_out": self.bytes_out,
            "bytes_read": self.bytes_read,
            "peak_bytes_per_worker": self.peak_bytes,
            "notes": list(self.notes),
            "ranks": [
                {
                    "rank": r.rank,
                    "stage": r.stage,
                    "src_ranks": list(r.src_ranks),
                    "src_files": [self.src_files[s] for s in r.src_ranks],
                    "tensors": len(r.tasks),
                    "bytes_out": r.bytes_out,
                    "bytes_read": r.bytes_read,
                    "peak_bytes": r.peak_bytes,
                }
                for r in self.ranks
            ],
        }


def span_bytes(region: Slice, shape: tuple[int, ...], isize: int) -> int:
    """Bytes between the first and last element of ``region`` in a C-order array of ``shape``."""
    if region.numel == 0:
        return 0
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    first = sum(o * s for o, s in zip(region.offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(region.offsets, region.sizes, strides))
    return (last - first + 1) * isize


def band_rows(shape: tuple[int, ...], isize: int) -> int:
    """Rows of dim 0 per band of a tensor of ``shape`` (at least one row)."""
    row_bytes = isize
    for n in shape[1:]:
        row_bytes *= n
    return max(1, BAND_BYTES // max(row_bytes, 1))


def band_bytes(shape: tuple[int, ...], isize: int) -> int:
    """Bytes of the largest band of a tensor of ``shape``."""
    if not shape:
        return isize
    rows = min(shape[0], band_rows(shape, isize))
    for n in shape[1:]:
        rows *= n
    return rows * isize


def estimate_peak(tasks: Iterable[TensorTask]) -> int:
    """Extra memory converting one destination rank needs: the pipeline's band buffers (each as
    large as the largest band) and the source chunks being read (mapped
    pages are released after each chunk): bounded by the band size, not by tensor or checkpoint
    sizes (except for single rows wider than a band)."""
    band = reads = 0
    for t in tasks:
        if t.dtype == STR_TYPE or t.dtype not in MS_DTYPES:
            continue
        isz = itemsize(t.dtype)
        band = max(band, band_bytes(t.dst_slice.sizes, isz))
        for p in t.pieces:
            span = span_bytes(p.src_region, p.src_shape, isz)
            row = band_bytes((1,) + tuple(p.src_shape[1:]), isz) if p.src_shape else isz
            reads = max(reads, min(span, max(row, CHUNK_BYTES)))
    return PIPELINE_BANDS * band + 2 * reads
