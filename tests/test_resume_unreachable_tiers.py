"""exclude_unreachable over tiers: a step whose files sit on a silent node but whose objects are
whole is answered from the object tier -- never as a file answer naming the silent node's files
(the policy's view of the files decides the tier, not the step row's state)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import update
from sqlalchemy.orm import sessionmaker

from ckptd.catalog import nodes as node_registry, objrows
from ckptd.catalog.db import make_engine
from ckptd.catalog.models import Checkpoint, Node, Shard
from ckptd.settings import Settings
from tests.api_helpers import Server
from tests.daemon_helpers import TP, save_tp_step, wait_for


def test_a_silent_nodes_step_whole_on_objects_is_an_object_answer(ms, root, catalog_url):
    save_tp_step(ms, root, "run1", 100)
    with Server(Settings(root=root, db=catalog_url, node_timeout=5.0)) as srv:
        import httpx

        with httpx.Client(base_url=srv.url, timeout=30) as c:
            wait_for(lambda: c.get("/v1/runs/run1/resume", params={"lease": "false"}).status_code == 200,
                     timeout=60, what="step 100 restorable")
            sessions = sessionmaker(make_engine(catalog_url), expire_on_commit=False)
            with sessions.begin() as s:  # the step's files are node far's, and far went silent an hour ago
                node_registry.register(s, "far", str(root))
                s.execute(update(Node).where(Node.name == "far")
                          .values(heartbeat_at=datetime.now(timezone.utc) - timedelta(hours=1)))
                ckpt_id = s.query(Checkpoint.id).filter(Checkpoint.step == 100).scalar()
                s.execute(update(Shard).where(Shard.checkpoint_id == ckpt_id).values(node="far"))
            with sessions.begin() as s:  # ... and every rank's object is up and committed
                for rank in range(TP):
                    objrows.record_uploaded(s, ckpt_id, rank, f"s3://b/p/run1/100/rank_{rank}/net-1_100.ckpt",
                                            10, "0" * 32, "far")
                assert objrows.commit(s, ckpt_id) == TP
            seen = c.get("/v1/runs/run1/resume", params={"lease": "false"}).json()
            assert seen["tier"] == "file" and seen["unreachable_nodes"] == ["far"], seen  # files, the node named
            answer = c.get("/v1/runs/run1/resume", params={"lease": "false", "exclude_unreachable": "true"}).json()
            assert answer["step"] == 100 and answer["tier"] == "object" and answer["unreachable_nodes"] == [], answer
            assert answer["manifest"].startswith("s3://b/p/run1/100/") and all(
                sh["location"].startswith("s3://") for sh in answer["shards"]), answer
            only_files = c.get("/v1/runs/run1/resume", params={"lease": "false", "exclude_unreachable": "true",
                                                               "tiers": "file"})
            assert only_files.status_code == 404 and "far" in only_files.json()["detail"]["skipped"][0]["reason"]
