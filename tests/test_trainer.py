"""The trainer/ side: genuine tp/dp sharding under msrun, exact resume after SIGKILL / hang / death
mid-async-save, per-rank shards that are exactly what the strategy file says (checked against
``mindspore.transform_checkpoints``), and the launcher's supervision + automatic restart.

Every multi-rank case runs the real ``msrun`` on CPU. Layouts share one global batch (4 sequences)
and schedule, so all of them train on the same data: losses/params agree across layouts to float
rounding, and *bitwise* between an uninterrupted run and a killed-and-resumed run of one layout.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tests import trainer_helpers as th
from trainer.config import ModelConfig, OptimConfig, full_init, lr_at, param_specs
from trainer.data import Sampler, make_corpus
from trainer.faults import Fault
from trainer.health import HealthReporter
from trainer.oracle import OracleError, interpret_answer
from trainer.scan_resume import scan
from trainer.topology import Topology, layout_for

STEPS = ["--steps", "8", "--save-every", "3"]  # checkpoints at steps 3, 6, 8
CFG = ModelConfig(hidden=32, heads=4, ffn=64, layers=2, seq=16)


# --- pure pieces --------------------------------------------------------------------------------


def test_topology_rank_order_matches_dev_matrix():
    for tp, dp in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]:
        for r in range(tp * dp):
            t = Topology(tp, dp, r)
            assert r == t.dp_index * tp + t.tp_index  # row-major in dev_matrix (dp, tp)
            assert r in t.tp_ranks and r in t.dp_ranks
            assert len(set(t.tp_ranks) & set(t.dp_ranks)) == 1


def test_megatron_layouts_split_the_right_dims():
    from ckptd.format.layout import slice_for_rank

    topo = Topology(2, 2, 0)
    col, row, rep = layout_for("col", 2, topo), layout_for("row", 2, topo), layout_for("rep", 1, topo)
    assert col.tensor_map == (0, -1) and row.tensor_map == (-1, 0) and rep.tensor_map == (-1,)
    for r in range(4):
        t = Topology(2, 2, r)
        s = slice_for_rank(col, (8, 6), r)
        assert s.offsets == (4 * t.tp_index, 0) and s.sizes == (4, 6)  # same slice on both dp replicas
        s = slice_for_rank(row, (8, 6), r)
        assert s.offsets == (0, 3 * t.tp_index) and s.sizes == (8, 3)
        assert slice_for_rank(rep, (8,), r).sizes == (8,)


def test_sampler_state_roundtrip_and_layout_independence():
    corpus = make_corpus(4096)
    a = Sampler(corpus, 16, 4, 1, 0, seed=3)
    for _ in range(5):
        a.next()
    state = a.state()
    assert all(isinstance(v, int) and -(1 << 63) <= v < (1 << 63) for v in state.values())  # Int64 entries
    b = Sampler(corpus, 16, 4, 1, 0, seed=99)
    b.restore(state)
    halves = [Sampler(corpus, 16, 2, 2, i, seed=3) for i in range(2)]
    for h in halves:
        for _ in range(5):
            h.next()
    for _ in range(4):
        full = a.next()
        assert np.array_equal(full.ids, b.next().ids)
        assert np.array_equal(full.ids, np.concatenate([h.next().ids for h in halves]))  # dp shares = global batch


def test_lr_schedule_warmup_then_cosine():
    oc = OptimConfig(lr=1.0, min_lr=0.1, warmup=4, total_steps=20)
    assert [lr_at(s, oc) for s in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert lr_at(20, oc) == pytest.approx(0.1)
    assert all(lr_at(s, oc) >= lr_at(s + 1, oc) for s in range(4, 20))


def test_fault_and_oracle_parsing():
    assert Fault.parse("kill-in-save:1:6") == Fault("kill-in-save", 1, 6)
    for bad in ("kill:1", "explode:0:1", "kill:x:1"):
        with pytest.raises(ValueError):
            Fault.parse(bad)
    assert interpret_answer({"detail": {"code": "no_restorable_step"}}, 2, "t").step is None
    ok = interpret_answer({"step": 6, "shards": [{"rank": 1, "path": "b"}, {"rank": 0, "path": "a"}]}, 2, "t")
    assert ok.step == 6
    with pytest.raises(OracleError):
        interpret_answer({"step": 6, "shards": [{"rank": 0, "path": "a"}]}, 2, "t")  # a rank is missing
    with pytest.raises(OracleError):
        interpret_answer({"shards": []}, 1, "t")


@contextlib.contextmanager
def _health_server(statuses: list[int]) -> Iterator[tuple[str, list]]:
    """A real HTTP server answering POSTs with ``statuses`` in turn (then 204); yields its URL and
    the (path, body, Authorization) of every request it got."""
    got: list[tuple[str, dict, str | None]] = []
    answers = list(statuses)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.append((self.path, body, self.headers.get("Authorization")))
            self.send_response(answers.pop(0) if answers else 204)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}", got
    finally:
        srv.shutdown()


def test_health_reports_are_posted_and_never_block():
    with _health_server([]) as (url, got):
        rep = HealthReporter(url, "run1", "tok")
        rep.report(5, 2.5, 0.75, False)
        deadline = time.time() + 10
        while not got and time.time() < deadline:
            time.sleep(0.02)
        assert got == [("/v1/runs/run1/health", {"step": 5, "loss": 2.5, "grad_norm": 0.75, "overflow": False},
                        "Bearer tok")]
    down = HealthReporter("http://127.0.0.1:9", "run1", None, timeout=0.2)  # nothing listens on port 9
    # 500 reports against a dead ckptd must return without waiting on the network: a hang check
    # (generous join), not a speed threshold; the bounded queue drops what cannot be sent
    caller = threading.Thread(target=lambda: [down.report(i, 1.0, 1.0, False) for i in range(500)])
    caller.start()
    caller.join(timeout=60)
    assert not caller.is_alive() and down.dropped > 0


@pytest.mark.parametrize(("answers", "tries", "sent"), [
    ([503, 204], 2, 1),        # a busy ckptd: the report is sent again
    ([500, 502, 204], 3, 1),   # three tries in all
    ([503, 503, 503], 3, 0),   # then it is given up (best effort)
    ([404, 204], 1, 0),        # a refusal is final: the run is not catalogued, sending again is pointless
])
def test_health_reports_are_retried_on_server_errors_but_not_on_refusals(answers, tries, sent):
    with _health_server(answers) as (url, got):
        rep = HealthReporter(url, "run1", None)
        rep.report(3, 1.5, None, False)
        assert rep.flush(timeout=30)
        assert [body for _, body, _ in got] == [{"step": 3, "loss": 1.5, "grad_norm": None, "overflow": False}] * tries
        assert (rep.sent, rep.failed) == (sent, 1 - sent)


# --- one rank (no msrun) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ref1(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref1")
    th.train(d, *STEPS, "--micro-batch", "4", "--save-initial")
    return d


def test_exact_resume_one_rank_after_sigkill(ref1, tmp_path, ms):
    d = tmp_path / "run"
    proc = th.train(d, *STEPS, "--micro-batch", "4", "--save-initial", "--fault", "kill:0:8", check=False)
    assert proc.returncode == -9
    answer = scan(str(d), 1)
    assert answer["step"] == 6 and answer["shards"] == [{"rank": 0, "path": th.shard(d, 0, 6)}]
    (tmp_path / "resume.json").write_text(json.dumps(answer))
    th.train(d, *STEPS, "--micro-batch", "4", "--resume-from", str(tmp_path / "resume.json"))
    ref, got = th.losses(ref1), th.losses(d)
    assert sorted(got) == list(range(1, 9))
    for step, entries in got.items():
        assert {hexloss for _, hexloss in entries} == {ref[step][0][1]}, f"step {step}"
    assert th.read(th.shard(d, 0, 8)) == th.read(th.shard(ref1, 0, 8))  # bitwise, incl. moments


def test_resume_refuses_a_shard_of_another_model(ref1, tmp_path):
    answer = {"step": 6, "shards": [{"rank": 0, "path": th.shard(ref1, 0, 6)}]}
    (tmp_path / "resume.json").write_text(json.dumps(answer))
    proc = th.train(tmp_path / "run", *STEPS, "--hidden", "32", "--resume-from", str(tmp_path / "resume.json"),
                    "--layers", "1", check=False)
    assert proc.returncode != 0 and "does not match this model" in proc.stderr


def test_encrypted_checkpoints_resume(tmp_path, ms):
    key = tmp_path / "key"
    key.write_bytes(bytes(range(32)))
    d = tmp_path / "run"
    th.train(d, "--steps", "3", "--save-every", "2", "--enc-key-file", str(key))
    raw = th.read(th.shard(d, 0, 2))
    assert raw[:4] == bytes.fromhex("d85e3a7f") and b"crc_num" not in raw[-17:]  # AES-GCM, no CRC trailer
    answer = scan(str(d), 1)
    assert answer["step"] == 3
    (tmp_path / "r.json").write_text(json.dumps(answer))
    th.train(d, "--steps", "4", "--save-every", "2", "--enc-key-file", str(key), "--resume-from", str(tmp_path / "r.json"))
    assert ms.load_checkpoint(th.shard(d, 0, 4), dec_key=key.read_bytes())["step_num"].asnumpy() == 4


# --- msrun: tp=2, dp=2, tp=2 x dp=2 ---------------------------------------------------------------


def _assert_same_run(ref_dir, got_dir, world: int, final: int = 8) -> None:
    ref, got = th.losses(ref_dir), th.losses(got_dir)
    assert sorted(got) == list(range(1, final + 1))
    for step, entries in got.items():
        assert {h for _, h in entries} == {ref[step][0][1]}, f"loss of step {step} differs after resume"
    for r in range(world):
        assert th.read(th.shard(got_dir, r, final)) == th.read(th.shard(ref_dir, r, final))


@pytest.mark.slow
def test_tp2_exact_resume_after_death_mid_async_save(uninterrupted_tp2, tmp_path):
    assert [*STEPS, "--micro-batch", "4"] == th.SAVES_3_6_8  # the shared reference is of this job
    rc, log = th.launch(tmp_path / "run", 2, 1, *STEPS, "--micro-batch", "4", faults=("kill-in-save:1:6",))
    assert rc == 0, log
    assert "event=rank_failed rank=1 step=6" in log and "SIGKILL" in log
    assert "event=resume step=3" in log  # rank 1's step-6 shard never committed -> step 6 skipped
    assert "event=finished" in log
    _assert_same_run(uninterrupted_tp2, tmp_path / "run", 2)


@pytest.mark.slow
def test_dp2_hung_rank_is_detected_and_resumed_exactly(tmp_path):
    rc, log = th.launch(tmp_path / "ref", 1, 2, *STEPS, "--micro-batch", "2")
    assert rc == 0, log
    rc, log = th.launch(tmp_path / "run", 1, 2, *STEPS, "--micro-batch", "2", faults=("hang:1:5",),
                        launch_args=("--heartbeat-timeout", "6"))
    assert rc == 0, log
    assert "event=rank_failed rank=1 step=5" in log and "heartbeat stale" in log
    assert "event=resume step=3" in log
    _assert_same_run(tmp_path / "ref", tmp_path / "run", 2)


@pytest.fixture(scope="module")
def ref4(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref4")
    rc, log = th.launch(d, 2, 2, *STEPS, "--micro-batch", "2", "--save-initial")
    assert rc == 0, log
    return d


@pytest.mark.slow
def test_tp2_dp2_exact_resume_after_sigkill(ref4, tmp_path):
    rc, log = th.launch(tmp_path / "run", 2, 2, *STEPS, "--micro-batch", "2", "--save-initial",
                        faults=("kill:2:8",))
    assert rc == 0, log
    assert "event=rank_failed rank=2 step=8" in log and "event=resume step=6" in log
    _assert_same_run(ref4, tmp_path / "run", 4)


# --- shards vs strategy file vs MindSpore ---------------------------------------------------------


def _transform(ms, run_dir, step: int, out, dst_strategy=None) -> str:
    src = out / "src"
    for r in range(4):
        os.makedirs(src / f"rank_{r}")
        shutil.copy(th.shard(run_dir, r, step), src / f"rank_{r}")
    ms.transform_checkpoints(str(src), str(out / "dst"), "t_", os.path.join(run_dir, "strategy.ckpt"), dst_strategy)
    return str(out / "dst")


@pytest.mark.slow
def test_shards_are_exactly_the_strategy_slices(ref4, tmp_path, ms):
    from ckptd.format.strategy import load_strategy

    strategy = load_strategy(os.path.join(ref4, "strategy.ckpt"))
    specs = {s.name: s for s in param_specs(CFG)}
    full_shapes = {p + n: s.shape for n, s in specs.items() for p in ("", "adam_m.", "adam_v.")}
    assert set(strategy.params) == set(full_shapes) and strategy.stage_device_num == 4
    # step 0: every rank holds exactly its strategy slice of the layout-independent initial weights
    for r in range(4):
        shard = th.load(ms, th.shard(ref4, r, 0))
        assert int(shard["rank_id"]) == r and int(shard["step_num"]) == 0
        for name, sl in strategy.slices_for_rank(r, full_shapes).items():
            base = name.split(".", 1)[1] if name.startswith("adam_") else name
            want = full_init(specs[base], 0)[sl.index] if not name.startswith("adam_") else np.zeros(sl.sizes)
            assert np.array_equal(shard[name], want), (r, name)
    # step 8: assembling the shards by the strategy == MindSpore's own merge, bit for bit
    shards = [th.load(ms, th.shard(ref4, r, 8)) for r in range(4)]
    merged = th.load(ms, os.path.join(_transform(ms, ref4, 8, tmp_path), "rank_0", "t_0.ckpt"))
    for name, shape in full_shapes.items():
        full = np.full(shape, np.nan, np.float32)
        for r in range(4):
            sl = strategy.slices_for_rank(r, {name: shape}, missing="skip")[name]
            if not np.isnan(full[sl.index]).all():
                assert np.array_equal(full[sl.index], shards[r][name]), f"dp replicas of {name} differ"
            full[sl.index] = shards[r][name]
        assert np.array_equal(full, merged[name]), name
    assert int(merged["step_num"]) == 8


@pytest.mark.slow
def test_reshard_to_another_layout_and_compare_with_one_rank(ref4, ref1, tmp_path, ms):
    from ckptd.format.strategy import save_strategy
    from trainer.checkpoint import build_strategy

    save_strategy(build_strategy(param_specs(CFG), Topology(2, 1, 0)), tmp_path / "tp2.ckpt")
    out = _transform(ms, ref4, 8, tmp_path, str(tmp_path / "tp2.ckpt"))
    one = th.load(ms, th.shard(ref1, 0, 8))  # the same training on a single rank
    specs = {s.name: s for s in param_specs(CFG)}
    for r in range(2):
        got = th.load(ms, os.path.join(out, f"rank_{r}", f"t_{r}.ckpt"))
        for name, spec in specs.items():
            from ckptd.format.layout import slice_for_rank

            sl = slice_for_rank(layout_for(spec.split, len(spec.shape), Topology(2, 1, r)), spec.shape, r)
            # tp2 x dp2 vs 1 rank: same maths, different reduction order -> float rounding only
            np.testing.assert_allclose(got[name], one[name][sl.index], rtol=0, atol=2e-5, err_msg=name)
