"""The one reward rule (``rlray.reward.combine``): the three stages (scorer, judges, environment) summed through it
give bit for bit what the three separate rules gave before it (kept below as the reference), in the same key order."""

from __future__ import annotations

import math
import random
import struct

import pytest

from rlray.reward.combine import Term, combine


def _old_scorer(weighted: list[tuple[str, float, list]], n: int) -> dict[str, list]:
    """The scorer's rule before combine: summed_reward from 0.0 in order, NaN when nothing applied, 0.0 without terms."""
    reward = []
    for i in range(n):
        total, applied = 0.0, False
        for _, weight, values in weighted:
            if values[i] is not None:
                total += weight * values[i]
                applied = True
        reward.append(total if applied else math.nan)
    return {"reward": reward if weighted else [0.0] * n, **{name: values for name, _, values in weighted}}


def _old_judges(values: dict[str, list], judged: list[tuple[str, float, list]]) -> dict[str, list]:
    """add_judge_terms before combine."""
    terms = [k for k in values if k != "reward"]
    reward = list(values["reward"])
    for i in range(len(reward)):
        base = 0.0 if all(values[t][i] is None for t in terms) else reward[i]
        for _, weight, scores in judged:
            base += weight * scores[i]
        reward[i] = base
    return {**values, **{name: list(scores) for name, _, scores in judged}, "reward": reward}


def _old_env(values: dict[str, list], episodes: list[tuple[bool, bool, float | None] | None], weight: float) -> dict:
    """add_env_reward before combine; an episode is (failed, has an environment, env reward) or None (single turn)."""
    terms = [k for k in values if k != "reward"]
    reward, env = list(values["reward"]), []
    for i, ep in enumerate(episodes):
        if ep is not None and ep[0]:
            reward[i] = math.nan
            env.append(math.nan)
            continue
        if ep is None or not ep[1]:
            env.append(None)
            continue
        r = 0.0 if ep[2] is None else ep[2]
        env.append(r)
        base = 0.0 if all(values[t][i] is None for t in terms) else reward[i]
        reward[i] = base + weight * r
    return {**values, "reward": reward, "env": env}


def _bits(values: list) -> list:
    """Returns the values as comparable bit patterns (every NaN alike, -0.0 apart from 0.0)."""
    return [v if v is None else "nan" if math.isnan(v) else struct.pack("<d", v) for v in values]


def _draw(rng: random.Random, n: int, none: float, nan: float) -> list:
    return [None if (u := rng.random()) < none else math.nan if u < none + nan else rng.uniform(-3, 3) for _ in range(n)]


@pytest.mark.parametrize("seed", range(40))
def test_the_three_stages_through_combine_equal_the_old_rules_bit_for_bit(seed):
    rng, n = random.Random(seed), 24
    functions = [(f"f{k}", rng.choice([1.0, 0.2, -0.7, 0.1]), _draw(rng, n, 0.4, 0.05)) for k in range(rng.randint(0, 3))]
    if rng.random() < 0.3:
        functions.append(("reward_model", 0.5, _draw(rng, n, 0.0, 0.0)))
    judges = [(f"j{k}", rng.choice([0.5, 2.0, 0.3]), _draw(rng, n, 0.0, 0.1)) for k in range(rng.randint(0, 2))]
    episodes = [None if rng.random() < 0.3 else (rng.random() < 0.1, rng.random() < 0.8, rng.choice([None, 1.0, 0.25, -2.5]))
                for _ in range(n)]  # fmt: skip
    weight = rng.choice([1.0, 0.5, 2.0])

    old = _old_scorer(functions, n)
    new = combine([Term(*f) for f in functions], n)
    assert list(new) == list(old) and _bits(new["reward"]) == _bits(old["reward"])
    if judges:  # a run without judges has no panel (build.judge_panel returns None)
        old, new = _old_judges(old, judges), combine([Term(*j) for j in judges], n, prior=new)
        assert list(new) == list(old) and _bits(new["reward"]) == _bits(old["reward"])
    env = [None if ep is None or not ep[1] and not ep[0] else math.nan if ep[0] else (0.0 if ep[2] is None else ep[2])
           for ep in episodes]  # fmt: skip
    old, new = _old_env(old, episodes, weight), combine([Term("env", weight, env)], n, prior=new)
    assert list(new) == list(old) and _bits(new["reward"]) == _bits(old["reward"]) and _bits(new["env"]) == _bits(old["env"])


def test_combine_names_the_rule_cases():
    assert combine([], 2) == {"reward": [0.0, 0.0]}  # no term at all: the task reward is off
    got = combine([Term("a", 1.0, [None, 2.0, math.nan]), Term("b", 0.5, [None, None, 1.0])], 3)
    assert math.isnan(got["reward"][0]) and got["reward"][1] == 2.0 and math.isnan(got["reward"][2])  # nothing applied
    later = combine([Term("j", 2.0, [1.0, 1.0, 1.0])], 3, prior=got)
    assert later["reward"][:2] == [2.0, 4.0] and list(later) == ["reward", "a", "b", "j"]  # starts from 0.0 when skipped
    assert combine([Term("env", 1.0, [None, None, None])], 3, prior=later)["reward"][:2] == [2.0, 4.0]  # not applied: kept
    with pytest.raises(ValueError, match=r"terms \['a'\] are not 2 long"):
        combine([Term("a", 1.0, [1.0])], 2)
