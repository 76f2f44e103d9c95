"""rlray.reward.scorer: terms in config order, None (skipped) vs NaN (failed), columns reaching user functions in their
sandboxes, and the errors a bad entry gets when the scorer is built."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest

from rlray.reward import RewardFunctionError, RewardScorer, gsm8k_reward

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REWARDS = f"{FIXTURES}/rewards.py"
GSM8K_TERMS = [{"function": "gsm8k_correct", "weight": 1.0}, {"function": "gsm8k_format", "weight": 0.2}]


@pytest.fixture(scope="module")
def solutions(gsm8k_dir):
    """The first 8 GSM8K test solutions ('... #### N')."""
    with open(gsm8k_dir / "test.jsonl") as handle:
        return [json.loads(line)["answer"] for _, line in zip(range(8), handle, strict=False)]


def test_gsm8k_terms_reproduce_the_demo_reward_bit_for_bit(solutions):
    finals = [s.rsplit("####", 1)[1].strip() for s in solutions]
    completions = [f"#### {finals[0]}", f"#### {finals[1]}1", f"The answer is {finals[2]}.", "no idea",
                   solutions[4], f"#### {finals[5]}\nthanks", f"#### ${finals[6]}.00", ""]  # fmt: skip
    scorer = RewardScorer(functions=GSM8K_TERMS, columns=["answer"])
    got = scorer.score(["q"] * 8, completions, [{"answer": s} for s in solutions])
    old = gsm8k_reward(completions, finals, correct_weight=1.0, format_weight=0.2)
    assert got == {"reward": old["reward"], "gsm8k_correct": old["accuracy"], "gsm8k_format": old["format"]}  # exact
    assert got["gsm8k_correct"] == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert got["gsm8k_format"] == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def test_none_skips_a_term_and_a_failure_fails_the_sample():
    scorer = RewardScorer(functions=[{"function": "exact_match", "weight": 1.0},
                                     {"function": f"{REWARDS}:skip_marked", "weight": 0.5},
                                     {"function": f"{FIXTURES}/faulty_rewards.py:flaky", "weight": 2.0}],
                          columns=["answer"])  # fmt: skip
    try:
        got = scorer.score(["p"] * 4, ["abc", "SKIP", "RAISE", "SKIP NONE"],
                           [{"answer": "abc"}, {"answer": None}, {"answer": "x"}, {}])  # fmt: skip
    finally:
        scorer.close()
    assert got["exact_match"] == [1.0, None, 0.0, None]  # no reference: skipped
    assert got["skip_marked"] == [0.3, None, 0.5, None]  # len / 10, None for SKIP
    assert got["flaky"][:2] == [0.3, 0.4] and math.isnan(got["flaky"][2]) and got["flaky"][3] is None  # raised; NONE
    reward = got["reward"]
    assert reward[0] == 0.0 + 1.0 * 1.0 + 0.5 * 0.3 + 2.0 * 0.3  # every term applies, in config order
    assert reward[1] == 2.0 * 0.4  # the two skipped terms are left out, not counted as 0 or failures
    assert math.isnan(reward[2])  # flaky raised on it: failed, whatever the other terms say
    assert math.isnan(reward[3])  # every term skipped it and there is no model: nothing rewarded it


def test_async_user_function_and_conversational_completions():
    scorer = RewardScorer(functions=[{"function": f"{REWARDS}:async_length", "weight": 1.0},
                                     {"function": "gsm8k_format", "weight": 0.2}], columns=[])  # fmt: skip
    try:
        chat = [{"role": "user", "content": "What is 2 + 3?"}]
        got = scorer.score(["plain", chat], ["ab\n#### 5", "#### 5"], [{}, {}])
    finally:
        scorer.close()
    # the chat sample's completion reaches functions as [{"role": "assistant", ...}]: async_length sees a list of 1
    assert got["async_length"] == [0.9, 0.1]
    assert got["gsm8k_format"] == [1.0, 1.0]  # the built-in reads the assistant message's text
    assert got["reward"] == [0.0 + 0.9 + 0.2 * 1.0, 0.0 + 0.1 + 0.2 * 1.0]


def test_columns_of_mixed_types_reach_a_user_function_intact(tmp_path):
    target = tmp_path / "args.pkl"
    scorer = RewardScorer(functions=[{"function": f"{REWARDS}:record_arguments", "kwargs": {"record_to": str(target)}}],
                          columns=["answer", "meta", "source"])  # fmt: skip
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q1"}]
    rows = [{"answer": 18, "meta": {"k": [1, 2], "x": None}}, {"answer": "x", "tags": ["a", "b"]}, {"answer": None, "meta": [3.5, True]}]
    try:
        got = scorer.score(["q0", chat, "q2"], ["c0", "c1", "c2"], rows, completion_ids=[[1, 2], [3], []])
    finally:
        scorer.close()
    assert got == {"reward": [1.0, 1.0, 1.0], "record_arguments": [1.0, 1.0, 1.0]}
    assert pickle.loads(target.read_bytes()) == {
        "prompts": ["q0", chat, "q2"],
        "completions": ["c0", [{"role": "assistant", "content": "c1"}], "c2"],
        "completion_ids": [[1, 2], [3], []],
        "answer": [18, "x", None],
        "meta": [{"k": [1, 2], "x": None}, None, [3.5, True]],
        "source": [None, None, None],  # a known column no row has still arrives
        "tags": [None, ["a", "b"], None],  # a column only one row has
    }


def test_a_function_without_kwargs_runs_in_its_sandbox_with_only_what_it_names():
    scorer = RewardScorer(functions=[{"function": f"{REWARDS}:answer_in_completion", "name": "contains"}],
                          columns=["answer", "question"])  # fmt: skip
    try:
        got = scorer.score(["p", "p"], ["#### 18", "#### 17"], [{"answer": 18, "question": "q"}, {"answer": 18, "question": "q"}])
    finally:
        scorer.close()
    assert got == {"reward": [1.0, 0.0], "contains": [1.0, 0.0]}


def test_a_missing_column_is_named_when_the_scorer_is_built():
    spec = f"{REWARDS}:answer_in_completion"
    with pytest.raises(RewardFunctionError, match=(
        rf"reward.functions\[1\] \(function='{spec}', name='answer_in_completion'\): parameter 'answer' has no "
        r"default .* \(columns: \['question', 'solution'\]\)")):
        RewardScorer(functions=[{"function": "gsm8k_format"}, {"function": spec}], columns=["solution", "question"])


@pytest.mark.parametrize(
    ("functions", "message"),
    [
        ([{"function": "math_equl"}], r"reward.functions\[0\] \(function='math_equl', name='math_equl'\): 'math_equl' is "
                                      r"not a built-in verifier \(math_equal, exact_match, regex_match, gsm8k_correct, gsm8k_format, "
                                          r"reasoning_gym\)"),
        ([{"function": "gsm8k_format"}, {"function": "math_equal", "name": "gsm8k_format"}],
         r"reward.functions\[0\] \('gsm8k_format'\) and reward.functions\[1\] \('math_equal'\) are both named 'gsm8k_format'"),
        ([{"function": "exact_match", "name": "reward"}], r"reward.functions\[0\] \('exact_match'\) is named 'reward', a reserved name"),
        ([{"function": "x.py:reward_model"}], r"is named 'reward_model', a reserved name"),
        ([{"function": "exact_match", "weight": 1.0, "path": "x"}], r"reward.functions\[0\] \('exact_match'\) has unknown keys \['path'\]"),
        ([{"function": "regex_match", "kwargs": {"pattern": "(#### "}}], r"kwargs pattern '\(#### ' is not a regular expression"),
        ([{"function": "regex_match"}], r"parameter 'pattern' has no default"),
        ([{"function": "gsm8k_correct", "kwargs": {"column": "solution"}}], r"reads column 'solution', which the dataset lacks"),
        ([{"function": "gsm8k_correct", "kwargs": {"colum": "answer"}}], r"kwargs key 'colum' is not one of its parameters"),
        ([{"function": "no_such_module:fn"}], r"reward.functions\[0\] \(function='no_such_module:fn', name='fn'\): reward "
                                              r"function 'no_such_module:fn': cannot import 'no_such_module'.*\(built-in verifiers: math_equal"),
    ],
)
def test_bad_entries_fail_when_the_scorer_is_built(functions, message):
    with pytest.raises(RewardFunctionError, match=message):
        RewardScorer(functions=functions, columns=["answer"])


def test_names_kwargs_and_an_unknown_column_set():
    scorer = RewardScorer(functions=[{"function": "gsm8k_correct", "name": "correct", "kwargs": {"column": "solution"}},
                                     {"function": "regex_match", "name": "boxed", "weight": 0.5,
                                      "kwargs": {"pattern": r"\\boxed\{\d+\}$"}}])  # fmt: skip
    assert scorer.columns is None  # a standalone server: nothing known, the column is read if the rows have it
    got = scorer.score(["q", "q"], ["#### 18", "\\boxed{18}"], [{"solution": "x\n#### 18"}, {"solution": "#### 19"}])
    assert got == {"reward": [1.0, 0.0 + 0.5], "correct": [1.0, 0.0], "boxed": [0.0, 1.0]}


def test_a_column_named_like_an_argument_is_refused():
    with pytest.raises(ValueError, match=r"dataset column\(s\) \['completion_ids'\] have the names of reward-function arguments"):
        RewardScorer(functions=GSM8K_TERMS, columns=["answer", "completion_ids"])
    with pytest.raises(ValueError, match=r"\['prompts'\] have the names"):  # columns unknown: refused when a row has it
        RewardScorer(functions=GSM8K_TERMS).score(["p"], ["c"], [{"prompts": "x"}])


def test_empty_batches_and_length_mismatches():
    scorer = RewardScorer(functions=GSM8K_TERMS, columns=["answer"])
    assert scorer.score([], [], []) == {"reward": [], "gsm8k_correct": [], "gsm8k_format": []}
    with pytest.raises(ValueError, match=r"prompts \(1\), completions \(2\), columns \(2\) and completion_ids \(None\) must"):
        scorer.score(["p"], ["a", "b"], [{}, {}])
    with pytest.raises(ValueError, match=r"completion_ids \(1\) must have the same length"):
        scorer.score(["p", "q"], ["a", "b"], [{}, {}], completion_ids=[[1]])


def test_a_scorer_without_terms_gives_every_sample_0():
    scorer = RewardScorer(functions=[])  # the task reward is off (pure distillation): 0.0, never NaN (failed)
    assert scorer.score(["p1", "p2"], ["a", "b"], [{}, {}]) == {"reward": [0.0, 0.0]}
    assert scorer.score([], [], []) == {"reward": []}
