"""Rank-0 sampling extras: DAPO dynamic sampling and overlong shaping, ReMax's greedy baseline (no Ray, no engine)."""

import pytest

from rlray.algos import DynamicSamplingError
from rlray.data import PromptRow
from rlray.rollout import Completion
from rlray.run.online_sampling import Rollouts, SamplingExtras, apply, dynamic_sampling, overlong_shaping

G = 2  # samples per prompt


def batch(prompt_names: list[str], accuracy: list[float], lengths: list[int] | None = None) -> Rollouts:
    """G completions per prompt; completion i has accuracy[i], reward 10*accuracy[i] and lengths[i] tokens."""
    lengths = lengths or [3] * len(accuracy)
    rows = [PromptRow(p, f"question {p}", {"answer": "1"}) for p in prompt_names]
    completions = [
        Completion(i // G, i % G, [7] * lengths[i], [-1.0] * lengths[i], "stop", 0) for i in range(len(accuracy))
    ]
    rewards = {"reward": [10.0 * a for a in accuracy], "accuracy": list(accuracy), "format": [0.0] * len(accuracy)}
    return Rollouts(rows, [[1, 2, ord(p)] for p in prompt_names], completions, rewards)


def test_dynamic_sampling_refills_until_enough_groups_vary():
    first = batch(["a", "b", "c"], [1, 0, 0, 0, 1, 1])  # only 'a' varies
    draws = []

    def draw(n, round_index):
        draws.append((n, round_index))
        return {1: batch(["d", "e"], [0, 1, 1, 1]), 2: batch(["f", "g"], [1, 0, 0, 1])}[round_index]

    got, rounds = dynamic_sampling(first, draw, target_groups=3, max_rounds=3)
    # round 1 keeps a; round 2 draws 2 prompts and keeps d; round 3 draws 1 more (f, g come back), keeps f
    assert draws == [(2, 1), (1, 2)] and rounds == 3
    assert [r.prompt_id for r in got.rows] == ["a", "d", "f"]
    assert [c.prompt_index for c in got.completions] == [0, 0, 1, 1, 2, 2]
    assert got.rewards["accuracy"] == [1, 0, 0, 1, 1, 0]
    assert got.rewards["reward"] == [10, 0, 0, 10, 10, 0]
    assert [ids[-1] for ids in got.prompt_ids] == [ord("a"), ord("d"), ord("f")]


def test_dynamic_sampling_keeps_a_full_first_batch_in_one_round():
    first = batch(["a", "b"], [1, 0, 0, 1])
    got, rounds = dynamic_sampling(first, lambda n, r: pytest.fail("no refill needed"), target_groups=2, max_rounds=1)
    assert rounds == 1 and [r.prompt_id for r in got.rows] == ["a", "b"]


def test_dynamic_sampling_fails_clearly_past_the_limit():
    constant = batch(["a", "b"], [0, 0, 1, 1])
    with pytest.raises(DynamicSamplingError, match=r"after 2 rollout round\(s\) \(max_rounds=2\) only 0/2"):
        dynamic_sampling(constant, lambda n, r: batch(["c"], [0, 0]), target_groups=2, max_rounds=2)


def test_dynamic_sampling_metric_must_be_a_reward_term():
    with pytest.raises(KeyError, match="algo.dynamic_sampling_metric='length'"):
        dynamic_sampling(batch(["a"], [0, 1]), lambda n, r: None, target_groups=1, max_rounds=1, metric="length")


def test_dynamic_sampling_on_another_term():
    b = batch(["a", "b"], [0, 0, 0, 0])
    b.rewards["format"] = [0.0, 1.0, 0.0, 0.0]  # accuracy is constant, format varies for 'a'
    got, _ = dynamic_sampling(b, lambda n, r: batch(["c"], [0, 0]), target_groups=1, max_rounds=1, metric="format")
    assert [r.prompt_id for r in got.rows] == ["a"]


def test_overlong_shaping_by_hand():
    # L_max 10, cache 4 -> L_exp 6: lengths 5 -> 0; 8 -> (6 - 8) / 4 = -0.5; 10 -> -1; times factor 0.5
    got = overlong_shaping(batch(["a", "b"], [1, 0, 0, 0], [5, 8, 10, 6]), max_new_tokens=10, cache_tokens=4,
                           penalty_factor=0.5)  # fmt: skip
    assert got.rewards["overlong"] == [0.0, -0.25, -0.5, 0.0]
    assert got.rewards["reward"] == [10.0, -0.25, -0.5, 0.0]


def test_apply_remax_baseline_is_the_greedy_reward_of_each_prompt():
    sampled = batch(["a", "b"], [1, 0, 1, 1], [3, 3, 9, 3])

    def greedy(b):  # one greedy completion per prompt: 'a' wrong, 'b' right; b's is overlong (9 of 10 tokens)
        out = batch(["a", "b"], [0, 1], [3, 9])
        out.completions = [Completion(i, 0, [7] * n, [-1.0] * n, "stop", 0) for i, n in enumerate([3, 9])]
        return out

    spec = SamplingExtras(dynamic_sampling=False, greedy_baseline=True, target_groups=2, max_rounds=1, max_new_tokens=10,
                          overlong_cache_tokens=4)
    got, baseline, metrics = apply(sampled, lambda n, r: None, greedy, spec)
    # the greedy rewards get the same overlong shaping: 'b' 10 + (6 - 9) / 4 = 9.25; 'a' 0
    assert baseline == [0.0, 0.0, 9.25, 9.25]
    assert got.rewards["reward"] == [10.0, 0.0, 9.25, 10.0]
    assert metrics == {"reward/baseline_mean": pytest.approx(4.625), "reward/overlong_penalty_mean": pytest.approx(-0.1875)}


def test_apply_is_a_no_op_for_plain_algorithms():
    b = batch(["a"], [0, 1])
    plain = SamplingExtras(dynamic_sampling=False, greedy_baseline=False, target_groups=1, max_rounds=1, max_new_tokens=10)
    got, baseline, metrics = apply(b, None, None, plain)
    assert got is b and baseline is None and metrics == {}
