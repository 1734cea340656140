"""A job's split, ``tp=..,dp=..[,pp=..]``: the one grammar (ckptd/split.py), as a table."""

import pytest

from ckptd.convert.layouts import MAX_WORLD_SIZE
from ckptd.format.layout import MAX_DEVICES
from ckptd.runnames import MAX_RANK
from ckptd.split import ParallelSplit, SplitError, parse_split


@pytest.mark.parametrize("text, split, world", [
    ("tp=4,dp=2", ParallelSplit(4, 2), 8),
    (" dp = 2 , tp = 4 , pp = 2 ", ParallelSplit(4, 2, 2), 16),
    ("tp=1,dp=1", ParallelSplit(1, 1), 1),
    ("tp=1024,dp=1024", ParallelSplit(1024, 1024), 1 << 20),
])
def test_a_split_parses_to_its_value_and_prints_back(text, split, world):
    got = parse_split(text)
    assert got == split and got.world == world
    assert parse_split(str(got)) == got  # the text a launcher sends is the text ckptd parses


@pytest.mark.parametrize("text, what, message", [
    ("tp=2,dq=1", "--layout", "bad --layout item 'dq=1'"),
    ("tp=2", "to_layout", "to_layout needs dp=N"),
    ("dp=2", "--to-layout", "--to-layout needs tp=N"),
    ("tp=2,tp=3,dp=1", "--to-layout", "--to-layout sets tp twice"),
    ("tp=0,dp=1", "--to-layout", "bad --to-layout item 'tp=0'"),
    ("tp=-1,dp=1", "--to-layout", "bad --to-layout item 'tp=-1'"),
    ("tp=1,dp=99999999999", "split", "split dp=99999999999...: more than 1048576 ranks"),
    ("tp=2,dp=1048576", "split", "is 2097152 ranks: more than 1048576 ranks"),
    ("", "split", "bad split item ''"),
])
def test_a_bad_split_is_refused_naming_the_option(text, what, message):
    with pytest.raises(SplitError, match=None) as err:
        parse_split(text, what)
    assert message in err.value.message, err.value.message
    assert err.value.code == "invalid_request" and what in (err.value.hint or "") + err.value.message


def test_the_world_bound_is_the_ranks_a_strategy_stage_and_a_rank_directory_may_have():
    assert MAX_WORLD_SIZE == MAX_DEVICES == MAX_RANK
