"""Table tests for the pure policies: step states, resume choice, training health, retention."""

from __future__ import annotations

import math

import pytest

from ckptd.policy import Health, ResumePolicy, RetentionPolicy, SpikeRule, StepInfo, first_unhealthy
from ckptd.states import ShardState as S
from ckptd.states import StepState, step_state

V, C, D = S.VERIFIED, S.COMPLETE, S.CORRUPT


@pytest.mark.parametrize(
    "expected, shards, checks, want",
    [
        (2, {}, None, StepState.INCOMPLETE),
        (2, {0: V}, None, StepState.INCOMPLETE),
        (None, {0: V}, None, StepState.INCOMPLETE),
        (2, {0: V, 1: C}, None, StepState.PENDING),
        (2, {0: V, 1: V}, None, StepState.PENDING),
        (2, {0: V, 1: V}, True, StepState.VERIFIED),
        (2, {0: V, 1: V}, False, StepState.CORRUPT),
        (2, {0: V, 1: D}, None, StepState.CORRUPT),
        (2, {0: D}, None, StepState.CORRUPT),
        (2, {0: V, 1: S.DELETED}, True, StepState.DELETED),
        (2, {0: D, 1: S.DELETED}, None, StepState.DELETED),
    ],
)
def test_step_state_table(expected, shards, checks, want):
    assert step_state(expected, shards, checks) == want


def _s(id_, step, state="verified", **kw):
    return StepInfo(id=id_, step=step, state=state, **kw)


@pytest.mark.parametrize(
    "steps, policy, health, chosen, skipped",
    [
        ([], ResumePolicy(), [], None, []),
        ([_s(1, 100), _s(2, 200)], ResumePolicy(), [], 200, []),
        ([_s(1, 100), _s(2, 200, "corrupt", reason="rank 1: CRC mismatch")], ResumePolicy(), [], 100,
         [(200, "corrupt: rank 1: CRC mismatch")]),
        ([_s(1, 100), _s(2, 200, "incomplete"), _s(3, 300, "pending")], ResumePolicy(), [], 100,
         [(300, "pending: verification has not finished"), (200, "incomplete: not every rank's shard is present")]),
        ([_s(1, 100), _s(2, 200, "deleted")], ResumePolicy(), [], 100, [(200, "deleted: a shard file is gone")]),
        ([_s(1, 100), _s(2, 200, marked_bad=True, bad_reason="diverged")], ResumePolicy(), [], 100,
         [(200, "marked bad by an operator: diverged")]),
        ([_s(1, 100), _s(2, 200), _s(3, 300)], ResumePolicy(max_step=250), [], 200, []),
        ([_s(1, 100), _s(2, 200)], ResumePolicy(max_step=50), [], None, []),
        ([_s(1, 100), _s(2, 200, "corrupt")], ResumePolicy(), [], 100, [(200, "corrupt: a shard failed verification")]),
        # NaN at step 150 poisons every checkpoint from 150 on
        ([_s(1, 100), _s(2, 200)], ResumePolicy(), [Health(150, math.nan)], 100, [(200, "unhealthy: loss is nan at step 150")]),
        ([_s(1, 100), _s(2, 200)], ResumePolicy(), [Health(200, math.inf)], 100, [(200, "unhealthy: loss is inf at step 200")]),
        ([_s(1, 100), _s(2, 200)], ResumePolicy(), [Health(201, math.nan)], 200, []),
        ([_s(1, 100, "corrupt"), _s(2, 200, "incomplete")], ResumePolicy(), [], None,
         [(200, "incomplete: not every rank's shard is present"), (100, "corrupt: a shard failed verification")]),
    ],
)
def test_resume_policy_table(steps, policy, health, chosen, skipped):
    decision = policy.decide(steps, health)
    assert (decision.chosen.step if decision.chosen else None) == chosen
    assert list(decision.skipped) == skipped


def test_spike_rule_only_when_asked():
    history = [Health(s, 2.0) for s in range(1, 11)] + [Health(11, 9.0)] + [Health(s, 2.0) for s in range(12, 20)]
    steps = [_s(1, 10), _s(2, 15)]
    assert ResumePolicy().decide(steps, history).chosen.step == 15
    decision = ResumePolicy(spike=SpikeRule(factor=3.0, window=5)).decide(steps, history)
    assert decision.chosen.step == 10
    assert decision.skipped == ((15, "unhealthy: loss spike at step 11: 9 > 3 x median 2"),)


@pytest.mark.parametrize(
    "history, rule, want",
    [
        ([Health(1, 5.0), Health(2, 4.0)], SpikeRule(min_history=5), None),  # too little history: warm-up is not a spike
        ([Health(s, 1.0) for s in range(6)] + [Health(6, 2.9)], SpikeRule(), None),
        ([Health(s, 1.0) for s in range(6)] + [Health(6, 3.1)], SpikeRule(), 6),
        ([Health(s, None) for s in range(10)], SpikeRule(), None),
        ([Health(3, math.nan), Health(1, 1.0)], None, 3),
    ],
)
def test_first_unhealthy_table(history, rule, want):
    got = first_unhealthy(history, rule)
    assert (got[0] if got else None) == want


@pytest.mark.parametrize(
    "steps, policy, deleted",
    [
        # keep-last-2 of verified steps
        ([_s(1, 100), _s(2, 200), _s(3, 300)], RetentionPolicy(keep_last=2), [1]),
        # keep_last=0 still never deletes the newest restorable step
        ([_s(1, 100), _s(2, 200)], RetentionPolicy(keep_last=0), [1]),
        # newer incomplete/pending steps may still become restorable: kept
        ([_s(1, 100), _s(2, 200), _s(3, 300, "incomplete"), _s(4, 400, "pending")], RetentionPolicy(keep_last=1), [1]),
        # newest restorable is old: everything newer is kept, even with keep_last=1
        ([_s(1, 100), _s(2, 200, "corrupt"), _s(3, 300, "incomplete")], RetentionPolicy(keep_last=1), []),
        # old corrupt and deleted steps go
        ([_s(1, 100, "corrupt"), _s(2, 150, "deleted"), _s(3, 200), _s(4, 300)], RetentionPolicy(keep_last=2), [2, 1]),
        # pinned and leased steps stay
        ([_s(1, 100, pinned=True), _s(2, 200, in_use=True), _s(3, 300), _s(4, 400)], RetentionPolicy(keep_last=1), [3]),
        # keep every 1000th step
        ([_s(1, 1000), _s(2, 1500), _s(3, 2000), _s(4, 2500)], RetentionPolicy(keep_last=1, keep_every=1000), [2]),
        # a marked-bad newest step is not "the newest restorable", and is kept as evidence
        ([_s(1, 100), _s(2, 200, marked_bad=True), _s(3, 50)], RetentionPolicy(keep_last=1), [3]),
        # nothing restorable at all: nothing that might become restorable is deleted
        ([_s(1, 100, "incomplete"), _s(2, 200, "pending")], RetentionPolicy(keep_last=1), []),
        # steps already being deleted are not planned twice
        ([_s(1, 100, "deleting"), _s(2, 200)], RetentionPolicy(keep_last=1), []),
    ],
)
def test_retention_table(steps, policy, deleted):
    plan = policy.plan(steps)
    assert list(plan.delete) == deleted
    assert set(plan.keep) | set(plan.delete) | {s.id for s in steps if s.state == "deleting"} == {s.id for s in steps}
