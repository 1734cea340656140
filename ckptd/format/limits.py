"""Limits on what a file may make ckptd build in memory (docs/FORMATS.md section 6).

ckptd reads files that any job on the machine can write. Sizes on disk do not bound memory: a
30 MB ``.ckpt`` of one million 4-byte tensors is one million index entries, and a few bytes of
protobuf become a Python object of a few hundred. So every reader counts what it builds and
refuses a file beyond these limits with a :class:`LimitExceededError` (checkpoints) or a
:class:`StrategyLimitError` (strategy files) naming the limit, the file and the byte offset where
it was crossed, before it has built more than the limit allows.

The defaults are far above what MindSpore writes for real models and keep the worst case of one
open file in the low hundreds of MB (per-entry costs measured in docs/FORMATS.md section 6).
Callers that need other limits pass a :class:`FormatLimits` (``open_checkpoint(..., limits=...)``,
``verify_file(..., limits=...)``, ``index_ckpt``, ``index_safetensors``) or a
:class:`StrategyLimits` (``load_strategy``, ``parse_strategy_bytes``, ``load_rank_strategies``);
nothing here reads settings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ckptd.errors import FormatError, StrategyError

#: Tensor entries per checkpoint file (``.ckpt``: protobuf records, so a tensor split into several
#: records counts each; safetensors: header entries). A Llama-2-70B rank file with its optimizer
#: state holds ~2,200; an unsharded Mixture-of-Experts model with unfused experts and Adam state
#: (~50k weights x 3) ~150k. An entry costs ~210 bytes of index (8-byte name), so ~55 MB at the limit.
MAX_ENTRIES = 1 << 18  # 262,144

#: Sum of the distinct entry names' UTF-8 bytes in one ``.ckpt`` (one name may be 64 KiB): 128
#: bytes on average at MAX_ENTRIES, twice MindFormers' longest names.
MAX_NAME_BYTES = 32 << 20  # 32 MiB

#: Dims of the shape tuples one checkpoint file's index builds (equal shapes share one tuple; in
#: safetensors those written in up to 64 characters). MindSpore's tensors have at most 8 dims and a
#: model a few hundred distinct shapes; MAX_ENTRIES distinct 64-dim shapes of 20-digit dims would
#: otherwise cost ~750 MB.
MAX_SHAPE_DIMS = 1 << 20  # 1,048,576

#: A safetensors JSON header. The format's own ceiling is 100 MB (the Rust reader refuses more,
#: so MindSpore cannot load such files); a header of MAX_ENTRIES entries of realistic length
#: (~150 bytes each) takes ~40 MB.
MAX_HEADER_BYTES = 64 << 20  # 64 MiB

#: A safetensors header that is not in serde_json's compact form (which every writer built on the
#: safetensors library emits, MindSpore included) goes through Python's JSON parser, whose objects
#: take up to ~20 times the text: such headers are read only up to this size.
MAX_JSON_HEADER_BYTES = 4 << 20  # 4 MiB

#: Problems one index or verification keeps; further ones are counted in one last problem. A
#: hostile file may have a problem per entry, and reports end up in logs and the catalog.
MAX_PROBLEMS = 100

#: A strategy file. Real ones are a few MB (a 70B model's merged file: 1-4 MB); the whole file is
#: read into memory and the catalog stores it.
MAX_STRATEGY_BYTES = 64 << 20  # 64 MiB

#: Operator items + parameter layout items of one strategy file (protobuf or JSON): real files
#: hold one layout per parameter (optimizer states included) and one item per sharded operator.
MAX_STRATEGY_ITEMS = 1 << 18  # 262,144

#: Values of one strategy file. Protobuf: every integer (dims of dev_matrix, tensor_map,
#: param_split_shape, indices_offset, operator strategies) and every such list: ~9 per parameter
#: layout and ~4 per operator, so ~200k layouts of a real model fit. JSON: the ``,`` ``:`` ``[``
#: ``{`` of the text (each value or key follows one; ~15 per layout), which also bounds the objects
#: Python's JSON parser builds (at most ~70 bytes each).
MAX_STRATEGY_VALUES = 1 << 21  # 2,097,152

#: Bytes of protobuf fields that ``mindspore.straspb`` does not define, summed over the file.
#: MindSpore never writes any; a little slack lets a future MindSpore add a field, padding is refused.
MAX_STRATEGY_UNKNOWN_BYTES = 1 << 20  # 1 MiB


#: Nesting of any JSON ckptd reads from below the root (metadata.json, common.json, health_ckpts.json,
#: JSON strategy files, safetensors headers that are not compact). MindFormers' metadata.json nests 6
#: deep, the others 3-4; Python's parser recurses once per level, so ``[[[[...`` 100k deep raised
#: RecursionError (a traceback at every rescan, the shard never judged) instead of a verdict.
MAX_JSON_DEPTH = 64

#: MindFormers Checkpoint 2.0 ``metadata.json``. Measured with MindFormers 2.1.0's own writer
#: (``save_metadata_json`` over real ``mindspore.parallel.Layout`` objects, docs/FORMATS.md section 6;
#: reproduce with bench/mf2_metadata_size.py, bench/RESULTS.md 2026-12-04) for Llama-2-70B (80 layers,
#: hidden 8192, ffn 28672, vocab 32000, GQA 8 kv heads) with Adam state. Every storage record repeats
#: its slice's rank group, so the file grows with dp squared: the largest layout of a world is tp 8,
#: pp 1, all the rest dp, moments sharded over dp (optimizer parallel):
#:   256 ranks (dp 32):  108,386,965 B = 103.4 MiB,   549,363 slices + records (tp 8 / pp 4 / dp 8: 19.0 MiB);
#:   512 ranks (dp 64):  323,710,677 B = 308.7 MiB, 1,093,971 slices + records;
#:  1024 ranks (dp 128): 1,079,544,424 B = 1029.5 MiB, 2,185,171 slices + records -- refused.
#: 512 MiB holds every measured 512-rank layout (1.66x over the largest; 4.95x over the 256-rank one,
#: which the old 64 MiB refused). The bounded parse (mf2.py) keeps ~100-200 bytes per placement:
#: measured peak growth at this bound 0.31x for a file of MindFormers' shape just under it (+159 MiB),
#: 0.46x for the 512-rank file, 1.16x (+402 MiB) for MAX_METADATA_ITEMS of the smallest records; with
#: the file's bytes, ~1 GiB per reader at worst.
MAX_METADATA_BYTES = 512 << 20
#: Tensors ``metadata.json`` describes (the 70B save above: 1,451): as many as one checkpoint file may hold.
MAX_METADATA_TENSORS = MAX_ENTRIES
#: Slices (``chunk`` entries) plus storage records of one ``metadata.json`` (512 ranks: 1,093,971, above).
#: MindFormers' files take 137-494 bytes of text per item (all 9 measured), so a real file within
#: MAX_METADATA_BYTES has < 3.9 M; each costs ~100 bytes once parsed, so ~400 MiB at the limit (measured: +402 MiB).
MAX_METADATA_ITEMS = 1 << 22  # 4,194,304
#: One value ``metadata.json`` gives Python's JSON parser at a time (a tensor's description, a slice's
#: records in a form other than MindFormers', a key ckptd does not know): real ones are ~1-3 KB, and the
#: parser's objects cost up to ~26 times the text.
MAX_METADATA_VALUE_BYTES = 1 << 20  # 1 MiB


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*+"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_CHUNK = 1 << 20


def json_too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Does the JSON text ``raw`` nest deeper than ``limit`` (brackets outside strings)? Checked
    before Python's parser sees the text, at C speed and in chunks (memory: one chunk of counters)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    import numpy as np  # here: the limits are read by every command, this check by few (start-up)

    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = 0
    for at in range(0, len(brackets), _DEPTH_CHUNK):
        piece = np.frombuffer(brackets, np.uint8, min(_DEPTH_CHUNK, len(brackets) - at), at)
        # "[" 0x5b and "{" 0x7b open (+1), "]" 0x5d and "}" 0x7d close (-1): bit 2 tells them apart
        levels = depth + np.cumsum(1 - ((piece >> 1) & 2).astype(np.int32))
        if int(levels.max()) > limit:
            return True
        depth = int(levels[-1])
    return False


@dataclass(frozen=True)
class FormatLimits:
    """The checkpoint limits in one value (defaults: the module constants)."""

    max_entries: int = MAX_ENTRIES
    max_name_bytes: int = MAX_NAME_BYTES
    max_shape_dims: int = MAX_SHAPE_DIMS
    max_header_bytes: int = MAX_HEADER_BYTES
    max_json_header_bytes: int = MAX_JSON_HEADER_BYTES
    max_problems: int = MAX_PROBLEMS


DEFAULT_LIMITS = FormatLimits()


@dataclass(frozen=True)
class StrategyLimits:
    """The strategy-file limits in one value (defaults: the module constants)."""

    max_bytes: int = MAX_STRATEGY_BYTES
    max_items: int = MAX_STRATEGY_ITEMS
    max_values: int = MAX_STRATEGY_VALUES
    max_unknown_bytes: int = MAX_STRATEGY_UNKNOWN_BYTES


DEFAULT_STRATEGY_LIMITS = StrategyLimits()


class LimitExceededError(FormatError):
    """A checkpoint file is beyond one of ckptd's limits (it may be valid; ckptd will not index it)."""

    code = "limit_exceeded"
    default_hint = (
        "no MindSpore save of a real model comes near this limit: the file is damaged or was crafted; "
        "if it is genuine, raise the limit (FormatLimits / the limits keyword)"
    )


class StrategyLimitError(StrategyError):
    """A strategy file is beyond one of ckptd's limits."""

    code = "limit_exceeded"
    default_hint = (
        "MindSpore's strategy files of real models are a few MB: the file is damaged, padded or was crafted; "
        "if it is genuine, raise the limit (StrategyLimits, the limits keyword of the strategy readers)"
    )
