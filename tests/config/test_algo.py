"""Algorithm config: one YAML per algorithm, validation that names keys, families."""

import warnings
from pathlib import Path

import pytest

from rlray.algos import ALGORITHMS, algorithm_names
from rlray.config import AlgoConfig, ConfigError, config_from_dict, load_config

REPO = Path(__file__).resolve().parents[2]
ONLINE_ALGOS, OFFLINE_ALGOS = algorithm_names("online"), algorithm_names("offline")
GROUP_ALGOS = tuple(name for name, a in ALGORITHMS.items() if a.needs_groups)


def test_one_config_per_algorithm():
    names = {p.stem for p in (REPO / "configs" / "algos").glob("*.yaml")}
    assert names == set(ONLINE_ALGOS) | set(OFFLINE_ALGOS)
    assert len(ONLINE_ALGOS) == 10 and len(OFFLINE_ALGOS) == 7
    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no shipped config trips a warning (e.g. GSPO's clip range)
            cfg = load_config(REPO / "configs" / "algos" / f"{name}.yaml")
        assert cfg.algo.name == name
        assert cfg.algo.family == ("online" if name in ONLINE_ALGOS else "offline")


def test_the_name_description_lists_the_registered_algorithms():
    """``rlray config --describe`` lists every algorithm of the registry by family, in registration order."""
    assert AlgoConfig.model_fields["name"].description == (
        "Online (rollouts on prompt data): grpo, dr_grpo, dapo, gspo, cispo, rloo, reinforce_pp, reinforce_pp_baseline, "
        "remax, ppo. Offline (preference pairs in offline.pairs_files): dpo, ipo, kto, orpo, simpo, reward_model, sft."
    )


@pytest.mark.parametrize("name", GROUP_ALGOS)
def test_group_estimators_need_two_samples(name):
    with pytest.raises(ConfigError, match=f"rollout.samples_per_prompt=1: the group estimator '{name}' needs at least 2"):
        config_from_dict({"algo": {"name": name, "clip_eps_low": 1e-3, "clip_eps_high": 1e-3},
                          "rollout": {"samples_per_prompt": 1}})  # fmt: skip


@pytest.mark.parametrize("name", ["reinforce_pp", "remax", "ppo"])
def test_non_group_estimators_take_one_sample(name):
    cfg = config_from_dict({"algo": {"name": name}, "rollout": {"samples_per_prompt": 1},
                            "learner": {"sequences_per_minibatch": 8}})  # fmt: skip
    assert cfg.sequences_per_step == 8


def test_gspo_with_ppo_sized_clip_ranges_warns():
    with pytest.warns(UserWarning, match=r"algo.name='gspo' with clip_eps_low=0.2, clip_eps_high=0.28: GSPO"):
        config_from_dict({"algo": {"name": "gspo"}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config_from_dict({"algo": {"name": "gspo", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4}})


def test_option_errors_name_key_value_and_fix():
    with pytest.raises(ConfigError, match=r"algo.dual_clip=3.0: .* algo.name='cispo' does not use; set algo.dual_clip=null"):
        config_from_dict({"algo": {"name": "cispo", "dual_clip": 3.0}})
    with pytest.raises(ConfigError, match=r"algo.dual_clip=1.0"):
        config_from_dict({"algo": {"dual_clip": 1.0}})
    with pytest.raises(ConfigError, match=r"algo.overlong_cache_tokens=16 must be below rollout.max_new_tokens=16"):
        config_from_dict({"algo": {"name": "dapo", "overlong_cache_tokens": 16}, "rollout": {"max_new_tokens": 16}})
    with pytest.raises(ConfigError, match=r"algo.label_smoothing=0.5"):
        config_from_dict({"algo": {"name": "dpo", "label_smoothing": 0.5}})
    with pytest.raises(ConfigError, match=r"algo.name='dpo_v2': Input should be 'grpo', .* 'reward_model' or 'sft'"):
        config_from_dict({"algo": {"name": "dpo_v2"}})


def test_offline_sizes():
    cfg = config_from_dict({"algo": {"name": "dpo"}, "rollout": {"samples_per_prompt": 1}})
    assert cfg.algo.family == "offline"  # the online size rules do not apply
    with pytest.raises(ConfigError, match="offline.pairs_per_microbatch=3 x 1 learner worker"):
        config_from_dict({"algo": {"name": "sft"}, "offline": {"pairs_per_step": 8, "pairs_per_microbatch": 3}})
    with pytest.raises(ConfigError, match=r"offline.eval_fraction=0.01 of offline.max_pairs=20 holds out no pair"):
        config_from_dict({"algo": {"name": "kto"}, "offline": {"max_pairs": 20, "eval_fraction": 0.01}})


def test_rollout_correction_defaults_and_modes():
    rc = config_from_dict({}).algo.rollout_correction
    assert (rc.mode, rc.ratio_min, rc.ratio_max) == ("token_truncate", None, 2.0)  # Yao et al.'s TIS
    trl = config_from_dict({"algo": {"rollout_correction": {"mode": "sequence_mask", "ratio_max": 3.0}}})
    assert trl.algo.rollout_correction.mode == "sequence_mask"
    assert config_from_dict({"algo": {"rollout_correction": {"mode": "none", "ratio_max": None}}})
    # the word none on the command line (which the override parser reads as null) is the mode "none"
    cli = config_from_dict({}, ["algo.rollout_correction.mode=none", "algo.adv_std_scale=none"]).algo
    assert (cli.rollout_correction.mode, cli.adv_std_scale) == ("none", "none")


@pytest.mark.parametrize(
    "algo, match",
    [
        ({"tis_cap": 3.0, "tis_level": "sequence"}, r"algo.tis_cap / algo.tis_level .* were replaced by algo.rollout_correction; "
         r"write algo.rollout_correction.mode=sequence_truncate and algo.rollout_correction.ratio_max=3.0"),
        ({"tis_cap": None}, r"write algo.rollout_correction.mode=none"),
        ({"tis_level": "token"}, r"mode=token_truncate and algo.rollout_correction.ratio_max=2.0"),
        ({"rollout_correction": {"mode": "seq_mask"}}, r"algo.rollout_correction.mode='seq_mask': Input should be 'none'"),
        ({"rollout_correction": {"ratio_max": 0.5}}, r"algo.rollout_correction.ratio_max=0.5: .*greater than or equal to 1"),
        ({"rollout_correction": {"ratio_min": 0.0}}, r"algo.rollout_correction.ratio_min=0.0: .*greater than 0"),
        ({"rollout_correction": {"ratio_min": 1.5}}, r"algo.rollout_correction.ratio_min=1.5: .*less than or equal to 1"),
        ({"rollout_correction": {"ratio_min": 1.0, "ratio_max": 1.0}}, r"ratio_min=1.0 must be below ratio_max=1.0"),
        ({"rollout_correction": {"mode": "sequence_mask", "ratio_max": None}}, r"corrects nothing; set a bound"),
    ],
)
def test_rollout_correction_errors_name_key_value_and_fix(algo, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({"algo": algo})
