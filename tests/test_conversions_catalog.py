"""Conversions of catalogued steps: API job, lineage, the resume oracle's converted copy, retention."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import xxhash

from ckptd.format.checkpoint import open_checkpoint
from ckptd.settings import Settings
from tests.api_helpers import Server
from tests.daemon_helpers import query, rank_tensors, save_shard, write_tp_strategy

TOKENS = {"a-token": "admin"}


def _job(ms, root, steps=(100, 200)):
    write_tp_strategy(root / "run1")
    for step in steps:
        for rank in range(2):
            save_shard(ms, root, "run1", rank, step)


def _wait(c, job_id):
    import time

    deadline = time.monotonic() + 60
    while (job := c.get(f"/v1/jobs/{job_id}").json())["state"] not in ("done", "failed"):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    return job


def test_api_conversion_is_catalogued_and_served_for_the_target_world_size(ms, root, catalog_url):
    _job(ms, root)
    with Server(Settings(root=root, db=catalog_url, settle_seconds=0.2, tokens=TOKENS)) as srv:
        srv.settle()
        c = srv.client("a-token")
        job = c.post("/v1/runs/run1/conversions", json={"step": 100, "to_strategy": "none"})
        assert job.status_code == 202, job.text
        done = _wait(c, job.json()["id"])
        assert done["state"] == "done", done
        conv = c.get("/v1/runs/run1/conversions").json()
        assert conv[0]["state"] == "done" and conv[0]["source_step"] == 100 and conv[0]["target_strategy_hash"] == "none"
        metrics = c.get("/metrics").text  # the conversion's throughput on this node
        (rate,) = re.findall(r'^ckptd_conversion_bytes_per_second\{node="[^"]+"\} (\S+)$', metrics, re.M)
        (written,) = re.findall(r"^ckptd_conversion_bytes_total (\S+)$", metrics, re.M)
        assert float(rate) > 0 and float(written) > 0
        # the newest step has no copy yet; asking at or before 150 finds the converted one
        assert c.get("/v1/runs/run1/resume", params={"world_size": 1}).json()["conversion"]["existing"] is None
        answer = c.get("/v1/runs/run1/resume", params={"world_size": 1, "max_step": 150, "lease": False}).json()
        assert answer["step"] == 100 and answer["conversion"]["needed"]
        (shard,) = answer["conversion"]["existing"]["shards"]
        copy_dir = os.path.dirname(os.path.dirname(shard["path"]))
        assert copy_dir.startswith(str(root / "run1" / "converted"))
        with open_checkpoint(shard["path"]) as ck:
            full = np.concatenate([rank_tensors(0, 100)["w"], rank_tensors(1, 100)["w"]])
            np.testing.assert_array_equal(ck.array("w"), full)
            assert ck.value("step_num") == 100
        srv.settle()  # the watcher leaves converted copies alone
        assert dict(query(catalog_url, "SELECT kind, count(*) FROM checkpoints GROUP BY kind")) == {"trained": 2, "converted": 1}
        lineage = query(catalog_url, "SELECT derived_from_id IS NOT NULL, state FROM checkpoints WHERE kind = 'converted'")
        assert lineage == [(True, "verified")]
        bad = c.post("/v1/runs/run1/conversions", json={"step": 100, "to_strategy": "/etc/passwd"})
        assert bad.status_code == 400 and "inside the checkpoint root" in bad.json()["detail"]["message"]
        assert c.post("/v1/runs/run1/conversions", json={"step": 999, "to_strategy": "none"}).status_code == 404
        bad = c.post("/v1/runs/run1/conversions", json={"step": 100, "to_layout": "tp=1; rm -rf /"})  # the job's parser: 400
        assert bad.status_code == 400 and "bad to_layout item" in bad.json()["detail"]["message"], bad.text
        # asked with the job's split, ckptd derives the target itself (the launcher derives nothing)
        same = c.get("/v1/runs/run1/resume", params={"split": "tp=2,dp=1", "lease": False}).json()
        assert same["step"] == 200 and same["conversion"] is None  # saved in that split: use it as it is
        other = c.get("/v1/runs/run1/resume", params={"split": "tp=1,dp=1", "max_step": 150, "lease": False}).json()
        conv = other["conversion"]
        assert conv["needed"] and conv["impossible"] is None and conv["to_world_size"] == 1
        assert conv["target_strategy_hash"].startswith("sha256:") and conv["existing"] is None  # the copy is "none"'s
        stages = c.get("/v1/runs/run1/resume", params={"split": "tp=2,dp=1,pp=2", "lease": False}).json()
        assert stages["conversion"]["needed"] and "pp" in stages["conversion"]["impossible"], stages["conversion"]
        assert c.get("/v1/runs/run1/resume", params={"split": "tp=1"}).status_code == 422  # not the grammar
        bad = c.get("/v1/runs/run1/resume", params={"split": "tp=1024,dp=2048"})
        assert bad.status_code == 400 and "more than 1048576 ranks" in bad.json()["detail"]["message"], bad.text
        # retention deleting the source step removes its converted copy with it
        gc = c.post("/v1/runs/run1/gc", json={"keep_last": 1, "dry_run": False}).json()
        assert gc.get("deleted_steps") == 1, gc and not os.path.exists(copy_dir)
        assert dict(query(catalog_url, "SELECT kind, count(*) FROM checkpoints GROUP BY kind")) == {"trained": 1}


def test_cli_convert_from_the_catalog(ms, root, catalog_url):
    _job(ms, root, steps=(100,))
    with Server(Settings(root=root, db=catalog_url, settle_seconds=0.2)) as srv:
        srv.settle()
    env = dict(os.environ, CKPTD_DB=catalog_url, CKPTD_ROOT=str(root))
    out = subprocess.run([sys.executable, "-m", "ckptd", "convert", "--run", "run1", "--step", "100", "--to-strategy", "none",
                          "--json"], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["state"] == "done" and doc["report"]["verified"]
    out_file = doc["report"]["ranks"][0]["path"] if "ranks" in doc["report"] else None
    # catalogued from the set's manifest (the digests taken while writing), true of the bytes on disk
    from ckptd.convert.manifest import MANIFEST_NAME, parse_manifest

    manifest = parse_manifest((Path(doc["out_dir"]) / MANIFEST_NAME).read_bytes(), doc["out_dir"])
    rows = query(catalog_url, "SELECT rank, path, size, digest FROM shards WHERE checkpoint_id = :c",
                 c=doc["output_checkpoint_id"])
    assert sorted((r, os.path.relpath(p, doc["out_dir"]), size, d) for r, p, size, d in rows) == \
        sorted((r, f.path, f.size, f.xxh3_128) for r, f in manifest.rank_files().items())
    assert all(xxhash.xxh3_128_hexdigest(Path(p).read_bytes()) == d for _, p, _, d in rows)
    before = os.stat(out_file) if out_file else None
    # the same conversion again is done already: the intact copy is returned, nothing rewritten
    again = subprocess.run([sys.executable, "-m", "ckptd", "convert", "--run", "run1", "--step", "100", "--to-strategy",
                            "none", "--json"], capture_output=True, text=True, env=env)
    assert again.returncode == 0, again.stderr
    redo = json.loads(again.stdout)
    assert redo["reused"] is True and redo["id"] == doc["id"] and redo["out_dir"] == doc["out_dir"]
    if out_file:
        assert os.stat(out_file).st_mtime_ns == before.st_mtime_ns
    assert query(catalog_url, "SELECT count(*) FROM conversion_jobs")[0][0] == 1
    # a copy changed on disk is not reused; converting again refuses to overwrite it
    victim = next(os.path.join(d, f) for d, _, fs in os.walk(doc["out_dir"]) for f in fs if f.endswith(".ckpt"))
    os.chmod(victim, 0o600)
    with open(victim, "ab") as fh:
        fh.write(b"x")
    refused = subprocess.run([sys.executable, "-m", "ckptd", "convert", "--run", "run1", "--step", "100", "--to-strategy",
                              "none"], capture_output=True, text=True, env=env)
    assert refused.returncode == 1 and "refusing to overwrite" in refused.stderr and "Traceback" not in refused.stderr
    gc = subprocess.run([sys.executable, "-m", "ckptd", "gc", "--run", "run1", "--keep-last", "1", "--json"],
                        capture_output=True, text=True, env=env)
    assert json.loads(gc.stdout)["deleted_steps"] == 0  # the only step is the newest restorable one


def test_resume_by_strategy_hash_tells_apart_layouts_of_one_world_size(ms, root, catalog_url):
    """tp=2 and 'replicated on 2 ranks' are both world size 2: only the strategy hash tells them
    apart, and the oracle must not hand a job the other layout's shards or copy."""
    from ckptd.format.layout import TensorLayout
    from ckptd.format.strategy import ParamStrategy, Strategy, save_strategy

    _job(ms, root, steps=(100,))
    replicated = Strategy.build((
        ParamStrategy("w", TensorLayout(dev_matrix=(2,), tensor_map=(-1, -1))),
        ParamStrategy("b", TensorLayout(dev_matrix=(2,), tensor_map=(-1,))),
    ))
    target = root / "run1" / "targets" / "replicated.ckpt"
    target.parent.mkdir()
    save_strategy(replicated, target)
    want = replicated.content_hash()
    with Server(Settings(root=root, db=catalog_url, settle_seconds=0.2, tokens=TOKENS)) as srv:
        srv.settle()
        c = srv.client("a-token")
        own = c.get("/v1/runs/run1/resume", params={"lease": False}).json()
        assert own["world_size"] == 2 and own["strategy_hash"] != want
        same = c.get("/v1/runs/run1/resume", params={"strategy_hash": own["strategy_hash"], "world_size": 2}).json()
        assert same["conversion"] is None
        before = c.get("/v1/runs/run1/resume", params={"strategy_hash": want, "world_size": 2}).json()
        assert before["conversion"]["needed"] and before["conversion"]["existing"] is None
        job = c.post("/v1/runs/run1/conversions", json={"step": 100, "to_strategy": str(target)})
        assert _wait(c, job.json()["id"])["state"] == "done"
        after = c.get("/v1/runs/run1/resume", params={"strategy_hash": want, "world_size": 2}).json()
        existing = after["conversion"]["existing"]
        assert existing["strategy_hash"] == want and len(existing["shards"]) == 2
        with open_checkpoint(existing["shards"][1]["path"]) as ck:  # every rank now holds all of w
            np.testing.assert_array_equal(ck.array("w"), np.concatenate([rank_tensors(0, 100)["w"], rank_tensors(1, 100)["w"]]))
        assert c.get("/v1/runs/run1/resume", params={"strategy_hash": "tp=4"}).status_code == 422


def test_converting_a_step_that_is_not_verified_says_what_it_is(ms, root, catalog_url):
    """Issue 15, finding 11: converting an ``incomplete`` step said "is corrupt" — step 100 had an
    older corrupt save (verified once, so it carries global step 100) and the newest save, the one
    ``ls`` lists first, was incomplete; the refusal named the older save's state only."""
    from tests.daemon_helpers import rank_tensors

    _job(ms, root, steps=(100,))
    save_shard(ms, root, "run1", 0, 300)  # rank 1 never wrote step 300
    with Server(Settings(root=root, db=catalog_url, settle_seconds=0.2, tokens=TOKENS)) as srv:
        srv.settle()
        c = srv.client("a-token")
        shard = root / "run1" / "rank_1" / "net-1_100.ckpt"
        data = bytearray(shard.read_bytes())
        data[-20] ^= 0xFF
        shard.write_bytes(bytes(data))
        srv.settle()
        # the job restarted and saves step 100 again, as epoch 2; rank 1 has not written it yet
        ms.save_checkpoint([{"name": n, "data": ms.Tensor(a)} for n, a in rank_tensors(0, 100).items()],
                           str(root / "run1" / "rank_0" / "net-2_100.ckpt"), append_dict={"step_num": 100, "rank_id": 0})
        srv.settle()
        listed = [(s["step"], s["epoch"], s["state"]) for s in c.get("/v1/runs/run1/steps").json()]
        assert listed[0] == (100, 2, "incomplete") and sorted(listed) == [(100, 1, "corrupt"), (100, 2, "incomplete"),
                                                                           (300, 1, "incomplete")]
        single = c.post("/v1/runs/run1/conversions", json={"step": 300, "to_strategy": "none"})
        assert single.status_code == 400
        assert single.json()["detail"]["message"] == "step 300 of run 'run1' is incomplete, not verified: ranks [1] of 2 have no file"
        both = c.post("/v1/runs/run1/conversions", json={"step": 100, "to_strategy": "none"})
        assert both.status_code == 400
        message = both.json()["detail"]["message"]
        assert message.startswith("step 100 of run 'run1' has 2 saves and none is verified: the newest save (epoch 2) is "
                                  "incomplete: ranks [1] of 2 have no file; the save (epoch 1) is corrupt: rank 1: CRC mismatch")
    env = dict(os.environ, CKPTD_DB=catalog_url, CKPTD_ROOT=str(root))
    cli = subprocess.run([sys.executable, "-m", "ckptd", "convert", "--run", "run1", "--step", "100", "--to-strategy", "none"],
                         capture_output=True, text=True, env=env)
    assert cli.returncode == 1 and "the newest save (epoch 2) is incomplete: ranks [1] of 2 have no file" in cli.stderr
    assert "Traceback" not in cli.stderr
