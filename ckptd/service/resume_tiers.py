"""The resume oracle over tiers: a step whole in some node's memory is restorable from there.

A step is restorable from the memory tier when every expected rank has a verified ``memory`` copy
on a node whose daemon is alive (``catalog.copies.whole_steps``): its files may be torn, missing
or still being written. The oracle lets the one resume policy choose over both tiers (a memory
step takes part as ``verified``, so marks, health records, spikes and ``max_step`` apply to it as
to files) and answers ``tier: memory`` with each rank's slot when the chosen step is whole in
memory: the restart loads from RAM. Memory answers only a job of the same world size (an elastic
restart goes through files and conversion) and only when the asker can load a slot
(``tiers`` on the resume route; MindFormers' own resume reads files).

The object tier answers last: a step whose files are gone (retention, a wiped root, a run moved)
but whose manifest committed every rank's object takes part as ``verified`` too, and is answered
``tier: object`` (each rank's object and the ``path`` its file belongs at, the step's ``manifest``)
only when neither its files nor memory hold it: the launcher downloads it before the restart
(``ckptd.launcher.objfetch``). Objects do not depend on a node being alive.
"""

from __future__ import annotations

import os
from dataclasses import replace

from sqlalchemy.orm import Session

from ckptd.catalog import copies
from ckptd.policy import StepInfo
from ckptd.states import StepState, Tier
from ckptd.storage import memslot

#: the tiers an answer may come from unless the asker says otherwise
DEFAULT_TIERS = (Tier.FILE, Tier.MEMORY, Tier.OBJECT)

MemoryCopies = dict[int, list[copies.WholeCopy]]


def other_tier_steps(s: Session, run_id: int, dead: set[str], tiers: tuple[Tier, ...], world_size: int | None,
                     ) -> tuple[MemoryCopies, MemoryCopies]:
    """(memory, object): the steps whole on each tier this asker may be answered from (one query)."""
    wanted = tuple(t for t in (Tier.MEMORY, Tier.OBJECT) if t in tiers)
    found = copies.whole_steps_on(s, run_id, wanted, dead)

    def fit(steps: MemoryCopies) -> MemoryCopies:
        return {k: v for k, v in steps.items() if world_size is None or len(v) == world_size}

    return fit(found.get(Tier.MEMORY, {})), fit(found.get(Tier.OBJECT, {}))


def with_memory(steps: list[StepInfo], mem: MemoryCopies) -> list[StepInfo]:
    """The steps as the policy sees them: one whole in memory is verified whatever its files say."""
    if not mem:
        return steps
    return [replace(i, state=StepState.VERIFIED.value, reason=None) if i.id in mem and i.state != StepState.VERIFIED.value
            else i for i in steps]


def memory_shards(entries: list[copies.WholeCopy], memory_root: str) -> list[dict]:
    """The answer's shards of a memory step: each rank's slot, on its node, at the memory root, and
    the digest its daemon verified (a loader whose slot still carries it need not hash it again)."""
    return [{"rank": c.rank, "path": memslot.path_of(memory_root, c.location), "location": c.location,
             "node": c.node, "digest": c.digest, "tier": Tier.MEMORY.value} for c in entries]


def object_answer(entries: list[copies.WholeCopy], run_name: str, run_path: str, step: int,
                  incarnation: int | None) -> dict:
    """The answer's fields for a step restored from the object tier: each rank's object, the path
    its file is fetched to (``<run>/<step>/`` of the key is the run directory), the manifest."""
    from ckptd.storage import objmanifest

    marker = f"/{objmanifest.step_dir(run_name, step, incarnation)}/"
    shards = []
    manifest = None
    for rank, loc, node, _ in entries:
        base, _, rel = loc.partition(marker)
        manifest = f"{base}{marker}{objmanifest.MANIFEST_NAME}"
        shards.append({"rank": rank, "path": os.path.join(run_path, rel), "location": loc, "node": node,
                       "tier": Tier.OBJECT.value})
    return {"tier": Tier.OBJECT.value, "shards": shards, "manifest": manifest, "unreachable_nodes": [],
            "mindformers": None, "files_whole": False}
