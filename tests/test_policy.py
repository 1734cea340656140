"""Table tests for the pure policies: step states, resume choice, training health, retention."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
        # issue 15, finding 8: a restart re-verifies; 999-997 are pending again, older than the newest
        # restorable 1000. They would be among the newest 5 once verified: kept, 992-990 go (before:
        # keep_last counted only what was verified at that moment, deleted 999-997 and kept 994-993)
        ([_s(1000, 1000)] + [_s(i, i, "pending") for i in (999, 998, 997)] + [_s(i, i) for i in range(996, 989, -1)],
         RetentionPolicy(keep_last=5), [992, 991, 990]),
        # ... once they verified, 995-993 go too: the unsettled plan kept a superset of the settled one
        ([_s(i, i) for i in range(1000, 989, -1)], RetentionPolicy(keep_last=5), [995, 994, 993, 992, 991, 990]),
        # an incomplete step (ranks still arriving) counts the same way: newer than the 2nd newest restorable
        ([_s(1, 100), _s(2, 200), _s(3, 300, "incomplete"), _s(4, 400)], RetentionPolicy(keep_last=2), [1]),
        # ... and goes once keep_last restorable steps are newer than it
        ([_s(1, 100, "incomplete"), _s(2, 200), _s(3, 300)], RetentionPolicy(keep_last=2), [1]),
        # fewer restorable steps than keep_last: a pending step of any age would be one of them
        ([_s(1, 100, "pending"), _s(2, 200)], RetentionPolicy(keep_last=2), []),
        # they never take a restorable step's place: 100 stays one of the newest 2 restorable
        ([_s(1, 100), _s(2, 200, "pending"), _s(3, 300, "pending"), _s(4, 400)], RetentionPolicy(keep_last=2), []),
        # a pending step keep_every would keep once verified is kept
        ([_s(1, 1000, "pending"), _s(2, 1500), _s(3, 2500), _s(4, 3000)], RetentionPolicy(keep_last=1, keep_every=1000), [3, 2]),
        # a marked-bad step is not restorable whatever its verification says: it takes no keep_last place
        ([_s(1, 100), _s(2, 200), _s(3, 300, "pending", marked_bad=True), _s(4, 400)], RetentionPolicy(keep_last=2), [3, 1]),
        # corrupt and deleted steps do not become restorable by themselves: older than the newest
        # restorable, they go even while fewer than keep_last steps are restorable
        ([_s(1, 100, "corrupt"), _s(2, 150, "deleted"), _s(3, 200), _s(4, 300)], RetentionPolicy(keep_last=5), [2, 1]),
        # training order: a MindFormers step not verified yet has no global step and its name counts
        # within its epoch (5); its position says it is newer than global step 12 of epoch 1
        ([_s(1, 10, position=(1, 10, 0)), _s(2, 12, position=(1, 12, 0)), _s(3, 5, "pending", position=(2, 5, 0))],
         RetentionPolicy(keep_last=1), [1]),
    ],
)
def test_retention_table(steps, policy, deleted):
    plan = policy.plan(steps)
    assert list(plan.delete) == deleted
    assert set(plan.keep) | set(plan.delete) | {s.id for s in steps if s.state == "deleting"} == {s.id for s in steps}


_STATES = ("verified", "pending", "incomplete", "corrupt", "deleted", "deleting")


@given(
    st.lists(st.tuples(st.sampled_from(_STATES), st.booleans(), st.booleans(), st.booleans()), max_size=12),
    st.one_of(st.none(), st.integers(0, 5)),
    st.one_of(st.none(), st.integers(2, 4)),
    st.randoms(use_true_random=False),
)
@settings(max_examples=400, deadline=None)
def test_retention_never_deletes_what_the_settled_plan_keeps(rows, keep_last, keep_every, rnd):
    """Finding 8 as a property: however the pending/incomplete steps settle (verified, corrupt, or
    still waiting), nothing a plan deletes now would have been kept by the plan made afterwards."""
    steps = [StepInfo(id=i, step=i, state=state, marked_bad=bad and rnd.random() < 0.3, pinned=pin and rnd.random() < 0.2,
                      in_use=use and rnd.random() < 0.2)
             for i, (state, bad, pin, use) in enumerate(rows, start=1)]
    policy = RetentionPolicy(keep_last=keep_last, keep_every=keep_every)
    now = policy.plan(steps)
    settled = [s if s.state not in ("pending", "incomplete") else
               StepInfo(**{**s.__dict__, "state": rnd.choice(("verified", "corrupt", s.state))}) for s in steps]
    later = policy.plan(settled)
    brief = [(s.step, s.state, s.marked_bad, s.pinned, s.in_use) for s in steps]
    assert set(now.delete) <= set(later.delete), (brief, [s.state for s in settled], now, later)
    restorable = [s for s in steps if s.state == "verified" and not s.marked_bad]
    if restorable:  # the newest restorable step is never deleted
        assert max(restorable, key=lambda s: s.step).id not in now.delete
