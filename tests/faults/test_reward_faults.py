"""Reward faults: a user function that raises, returns NaN/inf (failed) or None (skipped), hangs, returns the wrong
number of values or non-numbers, untrusted code under limits, and a reward server that does not answer."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pytest

from rlray.reward import RewardFunctionError, RewardScorer
from rlray.reward.server import RewardServerError, RewardServerUnavailableError, ServeRewardClient

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

FLAKY = f"{FIXTURES}/faulty_rewards.py:flaky"
PROMPTS = ["p0", "p1", "p2", "p3"]
COLUMNS = [{"answer": "1"}] * 4  # each prompt row's extra columns: the reference final answer


@pytest.fixture(scope="module")
def flaky_scorer():
    """A scorer with the GSM8K terms (weights 1.0, 0.2) and `flaky` (weight 2.0, timeout 2 s) in its sandbox."""
    scorer = RewardScorer(functions=[{"function": "gsm8k_correct", "weight": 1.0}, {"function": "gsm8k_format", "weight": 0.2},
                                     {"function": FLAKY, "weight": 2.0, "timeout_s": 2.0}], columns=["answer"])  # fmt: skip
    yield scorer
    scorer.close()


def _scorer(**entry):
    """Returns a scorer of one user function (weight 1) and no other term."""
    return RewardScorer(functions=[entry], columns=["answer"])


def test_a_raising_function_fails_only_the_samples_it_raises_on(flaky_scorer, caplog):
    completions = ["#### 1", "RAISE", "abc", "RAISE too"]
    with caplog.at_level(logging.WARNING, logger="rlray.reward.scorer"):
        got = flaky_scorer.score(PROMPTS, completions, COLUMNS)
    # the batch raised, so it was scored one completion at a time: only the two RAISE ones fail
    assert got["flaky"][0] == pytest.approx(0.6) and got["flaky"][2] == pytest.approx(0.3)
    assert math.isnan(got["flaky"][1]) and math.isnan(got["flaky"][3])
    # reward = 1.0 * accuracy + 0.2 * format + 2.0 * flaky: "#### 1" is right and formatted: 1 + 0.2 + 1.2
    assert got["reward"][0] == pytest.approx(2.4) and got["reward"][2] == pytest.approx(0.6)
    assert math.isnan(got["reward"][1]) and math.isnan(got["reward"][3])
    assert got["gsm8k_correct"] == [1.0, 0.0, 0.0, 0.0]  # the built-in terms never fail
    assert "reward function 'flaky' failed on 2 of 4 completions (ValueError: flaky: cannot grade RAISE)" in caplog.text


def test_nan_and_inf_fail_their_samples_and_none_skips_the_term(flaky_scorer, caplog):
    with caplog.at_level(logging.WARNING, logger="rlray.reward.scorer"):
        got = flaky_scorer.score(PROMPTS, ["NAN", "NONE", "INF", "ok"], COLUMNS)
    assert [math.isnan(v) for v in got["reward"]] == [True, False, True, False]
    assert got["flaky"][1] is None and got["flaky"][3] == pytest.approx(0.2)
    assert got["reward"][1] == 0.0  # flaky does not apply: 1.0 * accuracy 0 + 0.2 * format 0
    assert "returned NaN/inf for 2 of 4 completions" in caplog.text


def test_a_function_past_its_timeout_fails_the_call_and_is_restarted(flaky_scorer):
    t = time.monotonic()
    got = flaky_scorer.score(PROMPTS[:2], ["HANG", "fine"], COLUMNS[:2])
    assert time.monotonic() - t < 20  # killed after timeout_s=2, not after the 60 s sleep
    assert all(math.isnan(v) for v in got["reward"]) and all(math.isnan(v) for v in got["flaky"])
    assert flaky_scorer.score(PROMPTS[:1], ["fine"], COLUMNS[:1])["flaky"] == [pytest.approx(0.4)]  # a fresh process


@pytest.mark.parametrize(
    "fn, message",
    [
        ("rewards.py:wrong_count",
         r"reward.functions\[0\] \(function='.*rewards\.py:wrong_count', name='wrong_count'\) returned 1 values for 2 completions"),
        ("faulty_rewards.py:returns_text",
         r"faulty_rewards\.py:returns_text', name='returns_text'\) returned a non-numeric value 'good' for completion 0"),
    ],
)
def test_wrong_number_of_values_or_non_numbers_name_the_function(fn, message):
    scorer = _scorer(function=f"{FIXTURES}/{fn}")
    try:
        with pytest.raises(RewardFunctionError, match=message):
            scorer.score(PROMPTS[:2], ["a", "b"], COLUMNS[:2])
    finally:
        scorer.close()


def test_a_function_that_cannot_load_names_itself():
    with pytest.raises(RewardFunctionError, match=r"^reward.functions\[0\] \(function='.*faulty_rewards\.py:nope', name='nope'\): .*"
                                                  r"faulty_rewards\.py' has no callable 'nope'"):
        _scorer(function=f"{FIXTURES}/faulty_rewards.py:nope")


def test_untrusted_code_runs_without_the_environment_and_under_memory_and_time_limits(monkeypatch):
    monkeypatch.setenv("RLRAY_TEST_SECRET", "s3cr3t")
    spec = f"{FIXTURES}/faulty_rewards.py:environment_and_memory"
    trusted = _scorer(function=spec)
    untrusted = _scorer(function=spec, untrusted=True, memory_gib=1.0)
    one = [{"answer": "1"}]
    try:
        assert trusted.score(["p"], ["x"], one)["reward"] == [1.0]  # a trusted child inherits the environment
        assert untrusted.score(["p"], ["x"], one)["reward"] == [0.0]  # an untrusted one does not see it
        # 3 GiB mapped under a 1 GiB address-space cap: ENOMEM in the child, the sample fails, the process serves on
        assert math.isnan(untrusted.score(["p"], ["BIG"], one)["reward"][0])
        assert untrusted.score(["p"], ["x"], one)["reward"] == [0.0]
        # the same mapping is fine without the cap (untouched pages: no free memory needed, so other tests' use is no matter)
        assert trusted.score(["p"], ["BIG"], one)["reward"] == [float(3 * 2**30)]
    finally:
        trusted.close()
        untrusted.close()
    # and the time limit: an untrusted function that hangs is killed after its timeout_s, the sample fails
    hanging = _scorer(function=FLAKY, untrusted=True, memory_gib=1.0, timeout_s=1.0)
    try:
        t = time.monotonic()
        assert math.isnan(hanging.score(["p"], ["HANG"], one)["reward"][0])
        assert time.monotonic() - t < 20  # not the function's 60 s sleep
        assert hanging.score(["p"], ["abcd"], one)["reward"] == [pytest.approx(0.4)]  # a fresh, limited child
    finally:
        hanging.close()


# --------------------------------------------------------------------------------------------
# The reward server's client: retries while no replica answers, then a clear error
# --------------------------------------------------------------------------------------------
class _Reply:
    def __init__(self, outcome):
        self.outcome = outcome

    def result(self, timeout_s):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class _Handle:
    """A DeploymentHandle stand-in whose score.remote(...) answers from a script of outcomes."""

    def __init__(self, outcomes):
        self.outcomes, self.calls, self.bodies = list(outcomes), 0, []
        self.score = self

    def remote(self, body):
        self.calls += 1
        self.bodies.append(body)
        return _Reply(self.outcomes.pop(0))


def test_serve_client_retries_a_dead_replica_then_answers(caplog):
    import ray.exceptions

    dead = ray.exceptions.ActorDiedError()
    handle = _Handle([dead, TimeoutError("no replica within 300 s"), {"version": 3, "scores": {"reward": [1.0]}}])
    client = ServeRewardClient("app", attempts=5, timeout_s=1.0, backoff_s=0.01, handle=handle)
    with caplog.at_level(logging.WARNING, logger="rlray.reward.server"):
        got = client.score(["p"], ["c"], [{"answer": "1"}])
    assert (got.version, got.values, handle.calls) == (3, {"reward": [1.0]}, 3)
    assert handle.bodies[-1] == {"prompts": ["p"], "completions": ["c"], "columns": [{"answer": "1"}], "completion_ids": None}
    assert "reward server 'app': score failed (try 1 of 5: " in caplog.text


def test_serve_client_gives_up_with_a_clear_error():
    from ray.serve.exceptions import DeploymentUnavailableError

    handle = _Handle([DeploymentUnavailableError("rlray-reward")] * 3)
    client = ServeRewardClient("rlray-reward", attempts=3, timeout_s=1.0, backoff_s=0.01, handle=handle)
    with pytest.raises(RewardServerUnavailableError, match=(
        r"the reward server \(Serve application 'rlray-reward'\) did not answer: score failed 3 times over \d+ s, "
        r"last with DeploymentUnavailableError")):
        client.score(["p"], ["c"], [{}])
    assert handle.calls == 3


def test_serve_client_does_not_retry_the_servers_answers():
    handle = _Handle([RewardFunctionError("reward function 'f' returned 1 values for 2 completions")])
    client = ServeRewardClient("app", attempts=5, timeout_s=1.0, backoff_s=0.01, handle=handle)
    with pytest.raises(RewardFunctionError, match="returned 1 values for 2 completions"):
        client.score(["p", "q"], ["c", "d"], [{}, {}])
    assert handle.calls == 1
    handle = _Handle([RewardServerError("RuntimeError: model failed")])
    with pytest.raises(RewardServerError, match="model failed"):
        ServeRewardClient("app", attempts=5, timeout_s=1.0, backoff_s=0.01, handle=handle).score(["p"], ["c"], [{}])
    assert handle.calls == 1
