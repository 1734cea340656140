"""The verifier works one checkpoint at a time (issue 21, item 5).

* ``ckptd.service.workqueue.KeyedQueue``, table-tested on one thread (``take(wait=False)``): a key
  added again coalesces into its entry, at most one worker holds a key, work is handed out in
  bounded batches that keep their place, items in hand are not queued twice, a bare ``add`` asks
  for the key again, ``close`` cancels. Then with real threads: producers and workers at once.
* ``verifier.verify_one`` is a plain function over a real MindSpore file, returning an outcome.
* ``ckptd verify --run`` verifies on its own thread: it starts no worker threads.
"""

from __future__ import annotations

import json
import threading

import pytest
import xxhash

from ckptd.storage import PosixStorage
from ckptd.service.verifier import ShardRules, verify_one
from ckptd.service.workqueue import KeyedQueue
from ckptd.states import ShardState
from tests.daemon_helpers import query, save_shard, started_daemon, step_states, wait_for, write_tp_strategy

# --- the queue, one thread -------------------------------------------------------------------------

# (operation, argument, expected result); ``take`` expects (key, items) or None (nothing to take)
CASES = {
    "coalesces into the entry, merging values": [
        ("add", (1, {"a": 5}), None), ("add", (1, {"b": 1}), None), ("add", (1, {"a": 3}), None),
        ("take", None, (1, {"a": 3, "b": 1})), ("take", None, None), ("done", 1, None), ("idle", None, True),
    ],
    "keys in the order first added": [
        ("add", (2, {"x": 0}), None), ("add", (1, {"y": 0}), None), ("add", (2, {"z": 0}), None),
        ("take", None, (2, {"x": 0, "z": 0})), ("take", None, (1, {"y": 0})),
    ],
    "one worker per key": [
        ("add", (1, {"a": 0}), None), ("take", None, (1, {"a": 0})), ("add", (1, {"b": 0}), None),
        ("add", (2, {"c": 0}), None), ("take", None, (2, {"c": 0})), ("take", None, None),
        ("idle", None, False), ("done", 1, None), ("take", None, (1, {"b": 0})),
    ],
    "items in hand are not queued again": [
        ("add", (1, {"a": 0}), None), ("take", None, (1, {"a": 0})), ("add", (1, {"a": 0}), None),
        ("done", 1, None), ("take", None, None), ("idle", None, True),
    ],
    "a bare add asks for the key again, also while it is held": [
        ("add", (1, None), None), ("take", None, (1, {})), ("add", (1, None), None), ("take", None, None),
        ("done", 1, None), ("take", None, (1, {})), ("done", 1, None), ("idle", None, True),
    ],
    "batches are bounded and the rest keeps its place": [
        ("add", (1, {"a": 0, "b": 0, "c": 0}), None), ("add", (2, {"x": 0}), None),
        ("take", None, (1, {"a": 0, "b": 0})), ("add", (1, {"a": 1, "d": 0, "e": 0}), None), ("done", 1, None),
        ("take", None, (1, {"c": 0, "d": 0})), ("take", None, (2, {"x": 0})), ("done", 2, None), ("done", 1, None),
        ("take", None, (1, {"e": 0})), ("done", 1, None), ("idle", None, True),
    ],
    "drain waits for work in hand": [
        ("add", (1, {"a": 0}), None), ("drain", 0, False), ("take", None, (1, {"a": 0})), ("drain", 0, False),
        ("done", 1, None), ("drain", 0, True),
    ],
    "close cancels what is queued and ignores later adds": [
        ("add", (1, {"a": 0}), None), ("add", (2, {"b": 0}), None), ("take", None, (1, {"a": 0})),
        ("close", None, None), ("add", (3, {"c": 0}), None), ("take", None, None), ("idle", None, False),
        ("done", 1, None), ("idle", None, True), ("drain", None, True),
    ],
}


@pytest.mark.parametrize("case", CASES)
def test_keyed_queue(case):
    q: KeyedQueue[int, str, int] = KeyedQueue(batch=2, merge=min)
    for i, (op, arg, want) in enumerate(CASES[case]):
        if op == "add":
            got = q.add(*arg)
        elif op == "take":
            got = q.take(wait=False)
        elif op == "drain":
            got = q.drain(arg)
        else:
            got = getattr(q, op)(*(() if arg is None else (arg,)))
        assert got == want, f"step {i}: {op}({arg})"


def test_a_held_key_names_its_worker():
    q: KeyedQueue[int, str, int] = KeyedQueue(batch=8, merge=min)
    q.add(7, {"a": 0})
    assert q.busy() == {}
    q.take(wait=False)
    assert list(q.busy()) == [threading.current_thread().name]
    q.done(7)
    assert q.busy() == {}


def test_keyed_queue_with_real_threads():
    """Four producers add items of six keys while three workers take them: every item is worked
    on, no key is ever held by two workers, no batch exceeds the bound, and ``close`` ends every
    worker blocked in ``take``."""
    q: KeyedQueue[int, int, int] = KeyedQueue(batch=5, merge=min)
    guard = threading.Lock()
    holding: set[int] = set()
    seen: dict[int, set[int]] = {k: set() for k in range(6)}
    overlaps, sizes = [], []
    start = threading.Barrier(7)

    def produce(p: int) -> None:
        start.wait()
        for n in range(300):
            q.add(n % 6, {p * 1000 + n: n})

    def work() -> None:
        start.wait()
        while (taken := q.take()) is not None:
            key, items = taken
            with guard:
                overlaps.extend([key] if key in holding else [])
                holding.add(key)
                sizes.append(len(items))
            sum(range(2000))  # hold the key a while: other workers try to take it meanwhile
            with guard:
                holding.discard(key)
                seen[key].update(items)
            q.done(key)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(4)] + \
        [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads[:4]:
        t.join(30)
    assert q.drain(30)
    q.close()
    for t in threads[4:]:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert overlaps == []
    assert max(sizes) <= 5 and len(sizes) >= 300 * 4 // 5 // 6 * 6 // 5  # work went out in bounded batches
    assert {k: len(v) for k, v in seen.items()} == {k: 200 for k in range(6)}  # 4 producers x 50 items per key


# --- one shard, as a plain function --------------------------------------------------------------


def test_verify_one_returns_the_outcome_of_one_file(ms, root):
    path = save_shard(ms, root, "run", 0, 30)  # CRC trailer, step_num 30
    rules = ShardRules(PosixStorage(str(root)), require_crc=True)
    out = verify_one(rules, str(path))
    assert out.state == ShardState.VERIFIED and out.error is None
    assert out.digest == xxhash.xxh3_128(path.read_bytes()).hexdigest()
    assert (out.format, out.crc, out.encryption, out.global_step) == ("ckpt", "valid", None, 30)
    assert out.stat is not None and out.stat.size == path.stat().st_size

    changed = verify_one(rules, str(path), known_digest="0" * 32)  # a later verification: bytes differ from the record
    assert changed.state == ShardState.CORRUPT and changed.error_code == "content_changed"
    assert changed.digest == "0" * 32  # the evidence of what the file was is kept

    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    bad = verify_one(rules, str(path))
    assert bad.state == ShardState.CORRUPT and bad.error_code and "@ byte" in bad.error

    assert verify_one(rules, str(root / "run" / "rank_0" / "gone.ckpt")).stat is None


# --- the CLI starts no threads ---------------------------------------------------------------------


def test_cli_verify_run_verifies_on_its_own_thread(ms, root, catalog_url, capsys):
    from ckptd.cli import main

    write_tp_strategy(root / "run1")
    for rank in range(2):
        save_shard(ms, root, "run1", rank, 100)
    d = started_daemon(root, catalog_url)
    try:
        wait_for(lambda: step_states(catalog_url) == {100: "verified"}, 30, what="step 100 verified")
    finally:
        d.stop()
    started: set[str] = set()
    before = threading.gettrace()
    threading.settrace(lambda *_: started.add(threading.current_thread().name))  # runs in every new thread
    try:
        code = main(["verify", "--run", "run1", "--json", "--db", catalog_url, "--root", str(root)])
    finally:
        threading.settrace(before)
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["shards"] == {"verified": 2} and doc["bytes_verified"] > 0
    assert started == set()
    assert query(catalog_url, "SELECT count(*) FROM verification_events WHERE kind = 'shard'") == [(4,)]
