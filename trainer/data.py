"""Deterministic byte-level corpus and a resumable sampler whose whole state is checkpointable.

The corpus is generated (no download): sentences from a tiny fixed grammar, so a small model's loss
visibly drops. The sampler draws window offsets for the *global* batch from a PCG64 generator; each
dp rank takes its contiguous share. Its state -- samples consumed and the generator's exact state
-- goes into every checkpoint's ``append_dict``, so a resumed job sees the same batches. Because the
draw is global, any (tp, dp) layout with the same global batch sees the same data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_SUBJECTS = ["the cat", "a dog", "my friend", "the old sailor", "a small robot", "the teacher", "our team"]
_VERBS = ["sees", "likes", "builds", "paints", "finds", "carries", "remembers", "follows"]
_OBJECTS = ["a red ball", "the river", "three apples", "the blue door", "a long story", "the mountain"]
_ENDS = [".", "!", " today.", " again.", " at night.", " slowly."]


def make_corpus(n_bytes: int = 1 << 16, seed: int = 1234) -> np.ndarray:
    """``n_bytes`` tokens (uint8 values as int32) of grammar text; a pure function of its arguments."""
    rng = np.random.default_rng(seed)
    parts: list[str] = []
    size = 0
    while size < n_bytes:
        s = (f"{_SUBJECTS[rng.integers(len(_SUBJECTS))]} {_VERBS[rng.integers(len(_VERBS))]} "
             f"{_OBJECTS[rng.integers(len(_OBJECTS))]}{_ENDS[rng.integers(len(_ENDS))]} ")
        parts.append(s)
        size += len(s)
    return np.frombuffer("".join(parts).encode()[:n_bytes], np.uint8).astype(np.int32)


@dataclass(frozen=True)
class Batch:
    ids: np.ndarray  # (micro_batch, seq) int32
    targets: np.ndarray  # (micro_batch, seq) int32

    def onehot(self, vocab: int) -> np.ndarray:
        """(micro_batch * seq, vocab) float32 one-hot targets (what the loss consumes)."""
        return np.eye(vocab, dtype=np.float32)[self.targets.reshape(-1)]


class Sampler:
    """Global-batch window sampler; ``state()`` / ``restore()`` round-trip it exactly."""

    def __init__(self, corpus: np.ndarray, seq: int, micro_batch: int, dp: int, dp_index: int, seed: int) -> None:
        if len(corpus) <= seq + 1:
            raise ValueError("corpus shorter than one window")
        self.corpus, self.seq, self.mb, self.dp, self.dp_index = corpus, seq, micro_batch, dp, dp_index
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.samples = 0  # global samples consumed

    @property
    def samples_per_epoch(self) -> int:
        return len(self.corpus) // (self.seq + 1)

    @property
    def epoch(self) -> int:
        """1-based epoch counter derived from the position (what ``epoch_num`` records)."""
        return 1 + self.samples // self.samples_per_epoch

    def next(self) -> Batch:
        offsets = self.rng.integers(0, len(self.corpus) - self.seq - 1, size=self.mb * self.dp)
        self.samples += self.mb * self.dp
        mine = offsets[self.dp_index * self.mb:(self.dp_index + 1) * self.mb]
        win = np.stack([self.corpus[o:o + self.seq + 1] for o in mine])
        return Batch(np.ascontiguousarray(win[:, :-1]), np.ascontiguousarray(win[:, 1:]))

    def state(self) -> dict[str, int]:
        """Plain ints for ``append_dict`` (each becomes an Int64 scalar entry).

        Not a JSON string: ``mindspore.transform_checkpoints`` crashes on ``str`` entries
        ("'str' object has no attribute 'data'"), and ckptd must be able to re-shard these files.
        PCG64's two 128-bit integers are split into signed 64-bit halves.
        """
        st = self.rng.bit_generator.state
        out = {"data_samples": int(self.samples)}
        for key in ("state", "inc"):
            hi, lo = divmod(int(st["state"][key]), 1 << 64)
            out[f"rng_{key}_hi"], out[f"rng_{key}_lo"] = _signed64(hi), _signed64(lo)
        out["rng_has_uint32"] = int(st["has_uint32"])
        out["rng_uinteger"] = int(st["uinteger"])
        return out

    def restore(self, saved: dict[str, int]) -> None:
        """Inverse of :meth:`state` (``saved`` holds at least its keys)."""
        self.samples = int(saved["data_samples"])
        st = {"bit_generator": "PCG64", "has_uint32": int(saved["rng_has_uint32"]),
              "uinteger": int(saved["rng_uinteger"]), "state": {}}
        for key in ("state", "inc"):
            st["state"][key] = (_unsigned64(saved[f"rng_{key}_hi"]) << 64) | _unsigned64(saved[f"rng_{key}_lo"])
        self.rng.bit_generator.state = st


STATE_KEYS = ("data_samples", "rng_state_hi", "rng_state_lo", "rng_inc_hi", "rng_inc_lo", "rng_has_uint32",
              "rng_uinteger")


def _signed64(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _unsigned64(s: int) -> int:
    return int(s) & ((1 << 64) - 1)
