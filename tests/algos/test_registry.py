"""The algorithm registry: one entry per algorithm, in the order the config describes them; ``register`` refuses
inconsistent entries; the estimators it names take a typed record."""

from __future__ import annotations

import sys

import pytest
import torch

from rlray.algos import (
    ALGORITHMS,
    POLICY_LOSSES,
    Algorithm,
    algorithm_names,
    estimators,
    get_algorithm,
    load_algorithms,
    register,
)


def test_the_built_in_algorithms_and_their_pieces():
    assert algorithm_names("online") == ("grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp",
                                         "reinforce_pp_baseline", "remax", "ppo")  # fmt: skip
    assert algorithm_names("offline") == ("dpo", "ipo", "kto", "orpo", "simpo", "reward_model", "sft")
    assert algorithm_names() == algorithm_names("online") + algorithm_names("offline")
    grouped = {n for n, a in ALGORITHMS.items() if a.needs_groups}
    assert grouped == {"grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp_baseline"}
    assert {n for n, a in ALGORITHMS.items() if a.advantage is estimators.grpo} == {"grpo", "dapo", "gspo", "cispo"}
    assert [n for n, a in ALGORITHMS.items() if a.dynamic_sampling] == ["dapo"]
    assert [n for n, a in ALGORITHMS.items() if a.greedy_baseline] == ["remax"]
    assert [n for n, a in ALGORITHMS.items() if a.needs_critic] == ["ppo"]
    assert [n for n, a in ALGORITHMS.items() if a.reference_logps] == ["dpo", "ipo", "kto"]
    assert [n for n, a in ALGORITHMS.items() if a.kl_reference_point] == ["kto"]
    assert [n for n, a in ALGORITHMS.items() if a.reward_head] == ["reward_model"]
    assert all(a.pair_objective == n for n, a in ALGORITHMS.items() if a.family == "offline")
    assert all(a.policy_loss in POLICY_LOSSES for a in ALGORITHMS.values() if a.family == "online")


def test_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(KeyError, match="algorithm 'dpo_v2' is not registered; registered: grpo, dr_grpo, .*, sft"):
        get_algorithm("dpo_v2")


@pytest.mark.parametrize(
    "entry, match",
    [
        (Algorithm("grpo", "online", estimators.grpo, "ppo_clip"), "'grpo' is already registered"),
        (Algorithm("my algo", "online", estimators.grpo, "ppo_clip"), "must be a Python identifier"),
        (Algorithm("mine", "online", policy_loss="ppo_clip"), "needs advantage=<an estimators.Estimator function>"),
        (Algorithm("mine", "online", estimators.grpo, "clip"), r"policy_loss='clip' is not one of \['cispo', 'gspo'"),
        (Algorithm("mine", "online", estimators.grpo, "ppo_clip", reward_head=True), "reward_head are offline"),
        (Algorithm("mine", "offline"), "needs pair_objective="),
        (Algorithm("mine", "offline", pair_objective="dpo", needs_critic=True), "sampling extras are online"),
        (Algorithm("mine", "hybrid", pair_objective="dpo"), "family='hybrid' must be 'online' or 'offline'"),
    ],
)
def test_register_refuses_inconsistent_entries(entry, match):
    before = dict(ALGORITHMS)
    with pytest.raises(ValueError, match=match):
        register(entry)
    assert ALGORITHMS == before  # nothing half-registered


def test_estimators_read_the_typed_record_and_name_a_missing_input():
    # one group of 2 one-token responses with rewards 1 and 0: Dr.GRPO advantages +0.5 and -0.5
    inputs = estimators.AdvantageInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(2, 1, dtype=torch.bool))
    got = estimators.dr_grpo(inputs, estimators.AdvantageSpec(), lambda x: x)
    assert got.advantages.tolist() == [[0.5], [-0.5]] and got.returns is None
    with pytest.raises(ValueError, match="inputs.baseline_reward is None; ReMax needs the greedy baseline"):
        estimators.remax(inputs, estimators.AdvantageSpec(), lambda x: x)
    with pytest.raises(ValueError, match="inputs.old_values is None; PPO needs stage 4's critic values"):
        estimators.ppo(inputs, estimators.AdvantageSpec(), lambda x: x)
    with pytest.raises(ValueError, match="inputs.old_logprobs is None; a KL in the reward needs"):
        estimators.grpo(inputs, estimators.AdvantageSpec(reward_kl_coef=0.1), lambda x: x)


def test_load_algorithms_registers_once_per_file_and_module(tmp_path, monkeypatch):
    """A file is run once per path and a module imported once, so loading again (every validation of a config does)
    is a no-op; an entry its module registered itself at import counts as registered."""
    (tmp_path / "mine.py").write_text(
        "from rlray.algos import Algorithm, estimators, register\n"
        "MINE = Algorithm('mine_grpo', 'online', advantage=estimators.grpo, policy_loss='ppo_clip')\n")
    (tmp_path / "selfreg.py").write_text(
        "from rlray.algos import Algorithm, register\n"
        "SELF = register(Algorithm('self_registered', 'offline', pair_objective='dpo'))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        first = load_algorithms([f"{tmp_path}/mine.py:MINE", "selfreg:SELF"])
        assert [a.name for a in first] == ["mine_grpo", "self_registered"]
        assert ALGORITHMS["mine_grpo"] is first[0] and ALGORITHMS["self_registered"] is first[1]
        assert load_algorithms([str(tmp_path / "mine.py") + ":MINE", "selfreg:SELF"]) == first  # again: no-op
        assert algorithm_names()[-2:] == ("mine_grpo", "self_registered")
    finally:
        ALGORITHMS.pop("mine_grpo", None)
        ALGORITHMS.pop("self_registered", None)
        sys.modules.pop("selfreg", None)
