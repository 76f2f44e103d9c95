"""The Ray test modules' split into groups for ``make test``'s workers (tests/conftest.py ``ray_groups``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import UNMEASURED_RAY_MODULE_S, ray_groups


def test_longest_first_each_to_the_least_loaded_group():
    seconds = {"a.py": 100.0, "b.py": 60.0, "c.py": 50.0, "d.py": 40.0}
    # a -> 0 (100); b -> 1 (60); c -> 1 (110); d -> 0 (140)
    assert ray_groups(list(seconds), 2, seconds) == {"a.py": 0, "b.py": 1, "c.py": 1, "d.py": 0}
    assert ray_groups(list(seconds), 1, seconds) == dict.fromkeys(seconds, 0)


def test_an_unmeasured_module_counts_as_the_default():
    seconds = {"a.py": UNMEASURED_RAY_MODULE_S + 1, "b.py": 10.0}
    # a (61) -> 0; new.py (the default, 60) -> 1, the lighter; b (10) -> 1 again (60 < 61)
    assert ray_groups(["b.py", "new.py", "a.py"], 2, seconds) == {"a.py": 0, "new.py": 1, "b.py": 1}


@given(st.dictionaries(st.text("abc", min_size=1, max_size=4), st.floats(0, 1000), max_size=12), st.integers(1, 4))
def test_every_module_in_one_group_and_the_split_within_the_longest_module(seconds, groups):
    split = ray_groups(list(seconds), groups, seconds)
    assert set(split) == set(seconds) and set(split.values()) <= set(range(groups))
    loads = [sum(s for m, s in seconds.items() if split[m] == g) for g in range(groups)]
    assert max(loads) - min(loads) <= max(seconds.values(), default=0.0) + 1e-9  # LPT's bound on the imbalance


def test_modules_that_start_serve_share_one_group():
    seconds = {"a.py": 100.0, "s1.py": 30.0, "s2.py": 40.0, "b.py": 50.0}
    # alone: a -> 0 (100); b -> 1 (50); s2 -> 1 (90); s1 -> 1 (120). together: a -> 0; s1+s2 (70) -> 1; b -> 1 (120)
    assert ray_groups(list(seconds), 2, seconds) == {"a.py": 0, "b.py": 1, "s2.py": 1, "s1.py": 1}
    seconds["s1.py"] = 90.0  # alone s1 (90) and s2 (40) would part: a -> 0, s1 -> 1, b -> 1 (140), s2 -> 0 (140)
    assert ray_groups(list(seconds), 2, seconds)["s2.py"] != ray_groups(list(seconds), 2, seconds)["s1.py"]
    together = ray_groups(list(seconds), 2, seconds, [frozenset({"s1.py", "s2.py"})])
    assert together == {"s1.py": 0, "s2.py": 0, "a.py": 1, "b.py": 1}  # s1+s2 (130) -> 0; a -> 1 (100); b -> 1 (150)


def test_the_serve_modules_of_the_suite_are_found():
    from tests.conftest import _uses_serve

    assert _uses_serve("tests/reward/test_server.py") and _uses_serve("tests/run/test_dist_e2e.py")
    assert not _uses_serve("tests/run/test_rgym_e2e.py")


def test_shares_give_each_group_its_part_of_the_time():
    seconds = {"a.py": 100.0, "b.py": 60.0, "c.py": 50.0, "d.py": 40.0}
    # shares 2:1, each item where (load + item) / share is least: a -> 0 (100/2 < 100/1); b -> 1 (160/2 > 60/1);
    # c -> 0 (150/2 = 75 < 110); d -> 0 (190/2 = 95 < 100/1)
    assert ray_groups(list(seconds), 2, seconds, shares=[2.0, 1.0]) == {"a.py": 0, "b.py": 1, "c.py": 0, "d.py": 0}
    # equal shares are the plain split
    assert ray_groups(list(seconds), 2, seconds, shares=[1.0, 1.0]) == ray_groups(list(seconds), 2, seconds)
    with pytest.raises(ValueError, match="one positive number per group"):
        ray_groups(list(seconds), 2, seconds, shares=[1.0])
    with pytest.raises(ValueError, match="one positive number per group"):
        ray_groups(list(seconds), 2, seconds, shares=[1.0, 0.0])


@given(st.dictionaries(st.text("abc", min_size=1, max_size=4), st.floats(0, 1000), max_size=12),
       st.floats(0.05, 0.95))
def test_a_tail_share_splits_within_the_longest_module(seconds, tail):
    split = ray_groups(list(seconds), 2, seconds, shares=[1 - tail, tail])
    assert set(split) == set(seconds) and set(split.values()) <= {0, 1}
    loads = [sum(s for m, s in seconds.items() if split[m] == g) for g in range(2)]
    # every item went where its finish time over the share was least, so neither group's finish exceeds the other's
    # by more than the longest item over the smaller share
    finish = [loads[0] / (1 - tail), loads[1] / tail]
    assert max(finish) - min(finish) <= max(seconds.values(), default=0.0) / min(tail, 1 - tail) + 1e-6


def test_overlapping_sets_share_one_group_and_a_module_outside_the_run_is_ignored():
    seconds = {"a.py": 100.0, "s1.py": 30.0, "s2.py": 40.0, "n1.py": 20.0, "n2.py": 60.0}
    # {s1, s2} and {s2, n1} merge into one item (90); n2 alone; gone.py is not in this run
    split = ray_groups(list(seconds), 2, seconds, [frozenset({"s1.py", "s2.py"}), frozenset({"s2.py", "n1.py", "gone.py"})])
    assert split == {"a.py": 0, "s1.py": 1, "s2.py": 1, "n1.py": 1, "n2.py": 1}  # a -> 0; s1+s2+n1 (90) -> 1; n2 -> 1 (150)


def test_the_modules_sharing_the_sweep_fixture_are_found():
    from tests.conftest import _shared_run_users

    users = _shared_run_users()
    assert len(users) == 1  # tiny_sweep
    found = {m for m in ("tests/sweep/test_tune.py", "tests/test_notebooks.py", "tests/run/test_rgym_e2e.py") if users[0](m)}
    assert found == {"tests/sweep/test_tune.py", "tests/test_notebooks.py"}
