"""rlray.reward.functions (TRL's calling convention, in this process) and the scorer's weighted sum."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from rlray.reward import RewardFunctionError, load_reward_function
from rlray.reward.functions import BoundFunction, check_values, column_values
from rlray.reward.scorer import summed_reward

REWARDS = Path(__file__).resolve().parents[1] / "fixtures" / "rewards.py"
LABEL = "reward.functions[0] (function='f', name='f')"


def _load(name: str):
    return load_reward_function(f"{REWARDS}:{name}")


def test_a_function_without_kwargs_gets_only_the_arguments_it_names():
    bound = BoundFunction.check(_load("answer_in_completion"), LABEL, {}, ["answer", "question"])
    assert bound.accepted == frozenset({"completions", "answer"})
    columns = {"answer": [18, 7], "question": ["q0", "q1"]}
    # TRL would pass prompts= and question= too, and the function would raise TypeError
    assert bound(["p0", "p1"], ["#### 18", "#### 8"], None, columns) == [1.0, 0.0]


def test_kwargs_are_bound_and_win_over_a_column_of_the_same_name(tmp_path):
    import pickle

    target = tmp_path / "args.pkl"
    bound = BoundFunction.check(_load("record_arguments"), LABEL, {"record_to": str(target)}, ["record_to", "answer"])
    assert bound.accepted is None  # it has **columns: everything is passed
    assert bound(["p"], ["c"], [[5, 6]], {"record_to": ["from the data"], "answer": [1]}) == [1.0]
    got = pickle.loads(target.read_bytes())
    assert got == {"prompts": ["p"], "completions": ["c"], "completion_ids": [[5, 6]], "answer": [1]}


def test_async_functions_are_awaited():
    bound = BoundFunction.check(_load("async_length"), LABEL, {}, [])
    assert bound(["p", "q"], ["abc", "abcdefgh"], None, {}) == [0.3, 0.8]


def test_signature_errors_name_the_entry_the_parameter_and_the_columns():
    with pytest.raises(RewardFunctionError, match=(
        r"reward.functions\[0\] \(function='f', name='f'\): parameter 'answer' has no default and is not prompts, "
        r"completions, completion_ids, a key of its kwargs or a dataset column \(columns: \['question', 'solution'\]\)")):
        BoundFunction.check(_load("answer_in_completion"), LABEL, {}, ["solution", "question"])
    with pytest.raises(RewardFunctionError, match=r"kwargs key 'column' is not one of its parameters \(parameters: \['answer', 'completions'\]\)"):
        BoundFunction.check(_load("answer_in_completion"), LABEL, {"column": "x"}, ["answer"])
    with pytest.raises(RewardFunctionError, match="kwargs key 'completions' is reserved"):
        BoundFunction.check(_load("completion_length"), LABEL, {"completions": []}, ["answer"])

    def positional(prompts, completions, /, **kw):
        return [1.0] * len(completions)

    with pytest.raises(RewardFunctionError, match="parameter 'prompts' is positional-only"):
        BoundFunction.check(positional, LABEL, {}, [])
    # columns unknown (a standalone server): a required parameter may be a column it cannot see yet
    assert BoundFunction.check(_load("answer_in_completion"), LABEL, {}, None).accepted == frozenset({"completions", "answer"})
    # the entry's kwargs provide a required parameter
    assert BoundFunction.check(_load("answer_in_completion"), LABEL, {"answer": 3}, []).kwargs == {"answer": 3}


def test_column_values_keep_types_and_fill_none():
    rows = [{"answer": 18, "meta": {"k": [1]}}, {"answer": "x", "tags": ["a"]}, {}]
    assert column_values(rows, ["answer", "source"]) == {
        "answer": [18, "x", None], "source": [None, None, None], "meta": [{"k": [1]}, None, None], "tags": [None, ["a"], None],
    }  # fmt: skip
    assert list(column_values(rows, ["source"])) == ["source", "answer", "meta", "tags"]  # known first, then as seen
    with pytest.raises(ValueError, match=r"dataset column\(s\) \['completions'\] have the names of reward-function arguments"):
        column_values([{"completions": 1}])


def test_check_values_keeps_none_and_fails_nan_and_inf():
    got = check_values(LABEL, [1, None, math.nan, math.inf, -math.inf, np.float32(0.5), np.array(2.0), True], 8)
    assert got[:2] == [1.0, None] and all(math.isnan(v) for v in got[2:5]) and got[5:] == [0.5, 2.0, 1.0]
    with pytest.raises(RewardFunctionError, match=r"^reward.functions\[0\] \(function='f', name='f'\) returned 1 values for 2 completions"):
        check_values(LABEL, [1.0], 2)
    with pytest.raises(RewardFunctionError, match="returned a non-numeric value 'good' for completion 1"):
        check_values(LABEL, [1.0, "good"], 2)
    with pytest.raises(RewardFunctionError, match="returned float, not a list of 1 numbers"):
        check_values(LABEL, 1.0, 1)


def test_summed_reward_skips_none_fails_nan_and_needs_one_applied_term():
    accuracy = [1.0, 0.0, None, math.nan, None]
    fmt = [1.0, None, 1.0, 1.0, None]
    got = summed_reward([(1.0, accuracy), (0.2, fmt)], 5)
    # 0.0 + 1.0*1 + 0.2*1 = 1.2; 0.0 + 1.0*0 (format skipped) = 0.0; 0.0 + 0.2*1 = 0.2; NaN: a term failed;
    # NaN: every term skipped and no model
    assert got[:3] == [1.0 * 1.0 + 0.2 * 1.0, 0.0, 0.2] and math.isnan(got[3]) and math.isnan(got[4])
    # a reward model's raw score always applies: the all-skipped sample gets it alone
    with_model = summed_reward([(1.0, accuracy), (0.2, fmt), (0.5, [2.0, 2.0, 2.0, 2.0, -4.0])], 5)
    assert with_model[:3] == [1.2 + 1.0, 1.0, 0.2 + 1.0] and math.isnan(with_model[3]) and with_model[4] == -2.0
    assert summed_reward([], 0) == []
