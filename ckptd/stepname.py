"""How a step is named to people: by its global step, as users count training, never by the step
number in its file names where those differ.

``ModelCheckpoint`` (plain jobs) and MindFormers both name a save ``<prefix>-<epoch>_<S>`` with ``S``
counted *within the epoch*: global step 12 of a 6-step epoch is ``net-2_6.ckpt``. A message saying
"skipped 6" next to "resume step 8" reads as if the skipped save were the older one. So every
answer, log line and ``ckptd ls`` row names the global step, and the file name's numbers only
where they differ. Pure functions over plain values, one rule for every layout.
"""

from __future__ import annotations


def users_step(global_step: int | None, shards_step: int | None, epoch: int, name_step: int) -> int | None:
    """The global step of a save, from the best evidence there is: the step's own (checked across
    all its shards once verified), else what its verified shards say (a torn save's surviving
    shards), else the file name where it cannot differ (epoch 1 or none: the first epoch's step
    is the global step). None: not known until a shard verifies."""
    if global_step is not None:
        return global_step
    if shards_step is not None:
        return shards_step
    return name_step if epoch <= 1 else None


def filed_step(global_step: int | None, name_step: int) -> int:
    """The one number a save is filed under where a number must always exist (the oracle's
    ``latest_restorable_step``, object keys ``<run>/<step>/``): its global step, else the file
    name's step. Every such place asks here, so the keys a daemon writes and the oracle reads agree."""
    return global_step if global_step is not None else name_step


def file_name_note(epoch: int, name_step: int, step: int | None) -> str | None:
    """What to say next to a step whose file names count differently (None: nothing to say)."""
    if step is None:
        return f"files named epoch {epoch} step {name_step}; the global step is read once a shard verifies"
    if step != name_step:
        return f"files named epoch {epoch} step {name_step}"
    return None


def label(global_step: int | None, shards_step: int | None, epoch: int, name_step: int) -> str:
    """A step in one token for log lines: ``12`` or ``12(epoch 2 step 6)`` or ``epoch2_step6``."""
    step = users_step(global_step, shards_step, epoch, name_step)
    if step is None:
        return f"epoch{epoch}_step{name_step}"
    return str(step) if step == name_step else f"{step}(epoch{epoch}_step{name_step})"
