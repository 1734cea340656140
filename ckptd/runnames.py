"""The grammar of names in a checkpoint root, and the bounds of every number a name holds.

:mod:`ckptd.runlayout` is the front door (it re-exports what callers use); this module holds the
one rule for each name: shard files ``<file prefix>-<epoch>_<step>[_breakpoint].(ckpt|safetensors)``
with ``<file prefix> = <P>[_rank_<r>][_<k>]``, Checkpoint 2.0 files, ``rank_<r>`` and
``iteration_<it>`` directories, per-rank strategy files.

Every number read off a name goes through :func:`_number`, which checks it against its bound
before anything reaches the catalog (whose columns are 64-bit, migration 0007): a name beyond a
bound is refused — one file, with the reason (:func:`unusable_file_name`, :func:`unusable_dir`) —
never a failed insert that stops the rescan of every other file.
"""

from __future__ import annotations

import re
from typing import Literal

Role = Literal["metadata", "common", "model", "opt"]

MAX_RANK = 1 << 20  # ranks, file numbers: far above any job (a 1M-rank directory is a planted name)
MAX_STEP = (1 << 63) - 1  # epochs, steps, iterations: the catalog's BIGINT
#: a restart suffix ``_k``: MindSpore adds one per restart that finds files in the directory, so a
#: million is no job's; a rank-tagged name beyond it is refused, a plain one's is its user prefix
MAX_INCARNATION = 1 << 20

SHARD_SUFFIXES = (".ckpt", ".safetensors")
_RANK_DIR = re.compile(r"^rank_(0|[1-9][0-9]*)$")
_SHARD_NAME = re.compile(
    r"^(?P<prefix>.+)-(?P<epoch>\d+)_(?P<step>\d+)(?P<bp>_breakpoint)?\.(?P<ext>ckpt|safetensors)$")
# greedy prefix: the *last* ``_rank_<r>`` is the tag ("a_rank_b_rank_0" has base "a_rank_b")
_RANK_TAG = re.compile(r"^(?P<base>.+)_rank_(?P<rank>0|[1-9][0-9]*)(?:_(?P<k>[1-9][0-9]*))?$")
# MindSpore's restart suffixes are ``_<k>``, k >= 1 without leading zero (_chg_ckpt_file_name_if_same_exist)
_TRAILING_K = re.compile(r"^(?P<stem>.+)_(?P<k>[1-9][0-9]*)$")
# MindFormers names per-rank strategy files after strategy_ckpt_save_file, ".ckpt" -> "_rank_<r>.ckpt";
# the greedy ".+" makes the *last* "_rank_<r>" the tag; merge_pipeline_strategys' output is not one
_RANK_STRATEGY = re.compile(r"^(?!merged_).+_rank_(0|[1-9][0-9]*)\.(?:ckpt|json)$")
_ITERATION_DIR = re.compile(r"^iteration_(\d{8,})$")  # f"iteration_{it:08d}": more digits past 99,999,999
_ITERATION_FILE = re.compile(
    r"^(?:(?P<prefix>.+)-)?(?P<role>model|opt)-(?P<index>\d{7,})-(?P<total>\d{7,})\.safetensors$")

_STEPS = (MAX_STEP, "the catalog's 64-bit integers")
_RANKS = (MAX_RANK, "far more ranks than any job has")
_RESTARTS = (MAX_INCARNATION, "far more restarts than any job makes")


class _Beyond(Exception):
    """A number in a name beyond what it can be (internal: the parsers turn it into a reason)."""


def _number(digits: str, bound: tuple[int, str], what: str) -> int:
    """The value of a run of digits from a name, at most ``bound``: the one range check of every
    number a name holds (what passes fits the catalog's columns). Raises :class:`_Beyond`."""
    limit, why = bound
    # lengths first: a planted name of thousands of digits is never converted
    if len(digits.lstrip("0")) > len(str(limit)) or int(digits) > limit:
        shown = digits if len(digits) <= 40 else digits[:20] + "..."
        raise _Beyond(f"{what} {shown} is beyond {limit} ({why})")
    return int(digits)


def _bounded_match(pattern: re.Pattern[str], name: str, bound: tuple[int, str]) -> int | None:
    """The number ``pattern``'s group 1 takes from ``name``; None: no match, or beyond ``bound``."""
    m = pattern.match(name)
    if m is None:
        return None
    try:
        return _number(m.group(1), bound, "")
    except _Beyond:
        return None


# --- shard files --------------------------------------------------------------------------------


def _restart_suffixes(prefix: str) -> int:
    """The incarnation of a prefix without a rank tag: its trailing ``_<k>`` components added up.

    A name cannot tell a restart suffix from a user prefix ending in digits (``resnet_50``), so
    every trailing ``_<k>`` counts, and a step's identity never depends on the reading (its prefix
    is kept whole). Adding them up keeps MindSpore's order whatever the user's prefix: ``U``,
    ``U_1``, ``U_2`` ... increase for *any* ``U`` (``resnet_50``: 50, 51, 52; reading only the
    last ``_k`` would put ``resnet_50`` (50) after its restart ``resnet_50_1`` (1)), so the newer
    save of a tied step wins. A ``_k`` beyond :data:`MAX_INCARNATION` is part of the user's prefix
    (``run_20240101``: 0, 1, 2). Exact when the user's prefix does not end in ``_<digits>``,
    offset by a constant when it does."""
    total = 0
    while (m := _TRAILING_K.match(prefix)) is not None and int(m.group("k")) <= MAX_INCARNATION:
        total, prefix = total + int(m.group("k")), m.group("stem")
    return total


def prefix_incarnation(prefix: str) -> int | None:
    """The incarnation a step's prefix (:func:`parse_shard_name`'s, rank tag removed) stands for
    when its names have no rank tag of their own: :func:`_restart_suffixes`; None when the prefix
    still holds a rank tag (another rank's: a misplaced file). Migration 0007 fills the rows of
    older catalogs with it."""
    return None if _RANK_TAG.match(prefix) else _restart_suffixes(prefix)


def _read_shard_name(name: str, rank: int | None) -> tuple[str, int, int, bool, str, int | None] | None:
    """:func:`parse_shard_name`'s answer; raises :class:`_Beyond` for a number no step has.
    ``rank`` None: the directory is not known (a rank tag is then read as the file's own)."""
    m = _SHARD_NAME.match(name)
    if m is None:
        return None
    epoch, step = _number(m.group("epoch"), _STEPS, "epoch"), _number(m.group("step"), _STEPS, "step")
    prefix, breakpoint = m.group("prefix"), bool(m.group("bp"))
    tag = _RANK_TAG.match(prefix)
    if tag is None:  # no rank tag (plain MindSpore): trailing _<k> are restart suffixes
        incarnation = None if breakpoint else _restart_suffixes(prefix)
    elif rank is None or int(tag.group("rank")) == rank:
        k = _number(tag.group("k"), _RESTARTS, "restart suffix") if tag.group("k") else 0
        prefix, incarnation = tag.group("base") + (f"_{k}" if k else ""), None if breakpoint else k
    else:
        incarnation = None  # another rank's tag: a misplaced file, kept apart by its whole prefix
    fmt = "ckpt" if m.group("ext") == "ckpt" else "safetensors"
    return prefix, epoch, step, breakpoint, fmt, incarnation


def parse_shard_name(name: str, rank: int) -> tuple[str, int, int, bool, str, int | None] | None:
    """``(prefix, epoch, step, breakpoint, format, incarnation)`` of a shard file name found in
    ``rank``'s directory, or None when it is not a checkpoint name ckptd can catalogue
    (:func:`unusable_file_name` says why).

    The prefix is the name's without its rank tag, restart suffix kept: a step's identity across
    ranks (``toy_rank_0_1`` -> ``toy_1``; a plain ``net_1`` stays ``net_1``). The incarnation is
    the restart suffix, 0 for the first: after a rank tag exactly (``toy_rank_0_1`` is 1); without
    one, every trailing ``_<k>`` (:func:`_restart_suffixes`); a tag of another rank than the
    directory: None (the file is misplaced, its whole prefix keeps it apart).

    A ``_breakpoint`` file's incarnation is None (unknown): ``exception_save`` names it with the
    prefix *without* the restart suffix, and the ``_<n>`` after its rank tag is MindSpore's
    same-name counter over earlier breakpoint files of that directory, not the restart
    (``toy_rank_0_1-1_4_breakpoint.ckpt`` is the second breakpoint, written by any incarnation).
    Its prefix keeps that counter, so two breakpoints of one position stay apart."""
    try:
        return _read_shard_name(name, rank)
    except _Beyond:
        return None


# --- Checkpoint 2.0 files -----------------------------------------------------------------------


def _read_iteration_file(name: str) -> tuple[Role, int, int] | None:
    """``(side, index, total)`` of a model/opt file name (None: not one); raises :class:`_Beyond`
    when its numbers are beyond any job or the index is not below the count."""
    m = _ITERATION_FILE.match(name)
    if m is None:
        return None
    total = _number(m.group("total"), _RANKS, "the file count")
    index = _number(m.group("index"), _RANKS, "the file number")
    if not index < total:
        raise _Beyond(f"the file number {index} is not below the file count {total}")
    return ("model" if m.group("role") == "model" else "opt"), index, total


def read_iteration_file(name: str) -> tuple[Role, int, int] | None:
    """``(side, index, total)`` of a Checkpoint 2.0 model/opt file name; None when it is not one
    or its numbers are not a job's."""
    try:
        return _read_iteration_file(name)
    except _Beyond:
        return None


# --- why a name is refused ----------------------------------------------------------------------


def unusable_file_name(name: str, *, iteration: bool = False) -> str | None:
    """Why a directory entry that looks like ours cannot be catalogued (None: nothing wrong);
    ``iteration``: it is in a Checkpoint 2.0 iteration directory (files are named otherwise)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "the name is not valid UTF-8"
    if not name.endswith(SHARD_SUFFIXES):
        return None
    if iteration and _ITERATION_FILE.match(name) is None:
        return "not a Checkpoint 2.0 file name (<prefix>-model|opt-<i:07d>-<n:07d>.safetensors)"
    if not iteration and _SHARD_NAME.match(name) is None:
        return "not a checkpoint name MindSpore writes (<prefix>-<epoch>_<step>.ckpt|.safetensors)"
    try:
        _read_iteration_file(name) if iteration else _read_shard_name(name, None)
    except _Beyond as err:
        return str(err)
    return None


def unusable_dir(name: str) -> str | None:
    """Why a directory named like a ``rank_<r>`` or ``iteration_<it>`` one is not one (None: it is,
    or it is not named so): its number is beyond any job's. A rescan skips it, said once."""
    for pattern, bound, what in ((_RANK_DIR, _RANKS, "rank"), (_ITERATION_DIR, _STEPS, "iteration")):
        if (m := pattern.match(name)) is not None:
            try:
                _number(m.group(1), bound, what)
            except _Beyond as err:
                return f"{err}: nothing in it is catalogued"
    return None


# --- directories and strategy files -------------------------------------------------------------


def parse_rank_dir(name: str) -> int | None:
    """The rank of a ``rank_<r>`` directory name (None: not one, or beyond any job)."""
    return _bounded_match(_RANK_DIR, name, _RANKS)


def parse_iteration_dir(name: str) -> int | None:
    """The iteration of an ``iteration_<it>`` directory name (None: not one, or beyond any step)."""
    return _bounded_match(_ITERATION_DIR, name, _STEPS)


def rank_strategy_rank(name: str) -> int | None:
    """The rank of a per-rank strategy file name in ``strategy/`` (``<base>_rank_<r>.ckpt|json``;
    None: not one, e.g. ``merged_ckpt_strategy*``, a run-wide file, or a rank beyond any job)."""
    return _bounded_match(_RANK_STRATEGY, name, _RANKS)


def is_rank_strategy_name(name: str) -> bool:
    """Named like a per-rank strategy file, whatever its rank."""
    return _RANK_STRATEGY.match(name) is not None


#: what is left of a shard save's temp name without its temp suffix and extension: ``<prefix>-<e>_<s>``
_TEMP_STEM = re.compile(r"^.+-\d+_\d+(?:_breakpoint)?$")


def is_torn_temp_name(name: str) -> bool:
    """A shard save's temp file (MindSpore's async writer: ``net-2_6.tmp``; also
    ``<shard>.ckpt.tmp`` / ``.part``): what a rank killed mid-save leaves behind. ckptd's own
    temp trees (``.ckptd-tmp``) have their own cleaner."""
    for suffix in (".tmp", ".part"):
        if name.endswith(suffix):
            stem = name[:-len(suffix)]
            for ext in SHARD_SUFFIXES:
                stem = stem[:-len(ext)] if stem.endswith(ext) else stem
            return _TEMP_STEM.match(stem) is not None
    return False
