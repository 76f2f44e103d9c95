"""The plan's config in force (``RunPlan.settings``, ``source``, ``config_hash``) and the one way it changes
(``rlray.plan.replan``; ``plan_from_tree`` for a shipped or stored tree): issue 38."""

from __future__ import annotations

import pytest

from rlray.config import Config, ConfigError, GuardConfig, config_from_dict
from rlray.plan import plan_from_tree, replan, resolve_plan
from rlray.plan.settings import GuardSettings, Settings


def test_the_plan_carries_the_config_in_force_as_settings_and_as_plain_data():
    cfg = config_from_dict({"learner": {"lr": 3e-5}, "run": {"max_steps": 7}})
    plan = resolve_plan(cfg)
    assert plan.settings is cfg and isinstance(plan.settings, Settings) and Settings is Config
    assert GuardSettings is GuardConfig and isinstance(plan.settings.guard, GuardSettings)
    assert plan.source == cfg.model_dump() and plan.source["learner"]["lr"] == 3e-5
    assert plan.config_hash == cfg.config_hash() and plan.to_yaml() == cfg.to_yaml()
    assert plan.max_steps == 7 == plan.snapshots.last_step


def test_plan_from_tree_validates_the_shipped_tree_and_equals_the_plan_of_the_config():
    cfg = config_from_dict({"learner": {"sequences_per_microbatch": 2}, "rollout": {"max_new_tokens": 64}})
    shipped = cfg.model_dump()  # what the driver hands every learner rank (WorkerArgs.config)
    again = plan_from_tree(shipped)
    assert again == resolve_plan(cfg)  # every decision equal (settings and source are not compared)
    assert again.source == shipped and again.config_hash == cfg.config_hash()
    assert again.parallelism.micro_batching.sequences == 2 and again.lengths.max_new_tokens == 64
    with pytest.raises(ConfigError, match="learner.lr"):
        plan_from_tree({"learner": {"lr": -1.0}})


def test_replan_re_resolves_the_decisions_of_the_new_values():
    plan = resolve_plan(config_from_dict({"algo": {"kl_coef": 0.0}, "guard": {"kl_threshold": None},
                                          "rollout": {"max_new_tokens": 32}}))
    assert plan.roles.reference == "off" and plan.lengths.max_new_tokens == 32
    new, changes = replan(plan, ["algo.kl_coef=0.1", "rollout.max_new_tokens*=2"])
    assert changes == {"algo.kl_coef": (0.0, 0.1), "rollout.max_new_tokens": (32, 64.0)}
    assert new.roles.reference == "learner" and new.lengths.max_new_tokens == 64 and new.sampling.train.max_new_tokens == 64
    assert plan.roles.reference == "off" and plan.source["algo"]["kl_coef"] == 0.0  # the old plan is untouched
