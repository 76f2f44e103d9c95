"""The sweep file schema: shipped sweep files load, bad files fail naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlray.config import load_config
from rlray.sweep.spec import SweepConfig, SweepError, check_sweep, load_sweep

REPO = Path(__file__).resolve().parents[2]
SWEEPS = sorted((REPO / "configs" / "sweeps").glob("*.yaml"))


def _write(tmp_path: Path, tree: dict) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def _error(tmp_path: Path, tree: dict) -> str:
    with pytest.raises(SweepError) as err:
        load_sweep(_write(tmp_path, tree))
    return str(err.value)


def test_shipped_sweeps_exist():
    assert [p.name for p in SWEEPS] == ["grpo_lr_beta.yaml", "grpo_pbt_lr_kl.yaml"]


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_shipped_sweep_validates_against_the_demo_config(path):
    sweep = load_sweep(path)
    check_sweep(sweep, load_config(REPO / "configs" / "grpo_gsm8k_smollm2.yaml"))
    check_sweep(sweep, load_config(REPO / "configs" / "grpo_gsm8k_tiny.yaml", ["run.max_steps=5"]))


def test_grpo_lr_beta_contents():
    sweep = load_sweep(REPO / "configs" / "sweeps" / "grpo_lr_beta.yaml")
    assert set(sweep.space) == {"learner.lr", "algo.kl_coef"}
    assert sweep.space["learner.lr"].grid == [3e-6, 1e-5, 3e-5]
    assert sweep.space["algo.kl_coef"].grid == [0.0, 0.04]
    assert (sweep.metric, sweep.mode, sweep.scheduler.name, sweep.scheduler.grace_period_steps) == ("reward/mean", "max", "asha", 4)


def test_grpo_pbt_lr_kl_contents():
    sweep = load_sweep(REPO / "configs" / "sweeps" / "grpo_pbt_lr_kl.yaml")
    assert (sweep.space["learner.lr"].loguniform, sweep.space["algo.kl_coef"].uniform) == ((3e-6, 3e-5), (0.0, 0.08))
    s = sweep.scheduler
    assert (sweep.metric, s.name, s.perturbation_interval_steps, s.quantile_fraction, s.resample_probability) == (
        "reward/mean", "pbt", 4, 0.25, 0.25)


def test_unknown_top_level_key_is_named(tmp_path):
    msg = _error(tmp_path, {"metric": "reward/mean", "space": {"learner.lr": {"grid": [1e-5]}}, "schedular": {"name": "asha"}})
    assert "unknown key 'schedular'" in msg and "scheduler" in msg and "sweep.yaml" in msg


def test_unknown_scheduler_key_is_named(tmp_path):
    msg = _error(tmp_path, {"space": {"learner.lr": {"grid": [1e-5]}}, "scheduler": {"name": "asha", "grace": 2}})
    assert "unknown key 'scheduler.grace'" in msg and "grace_period_steps" in msg


@pytest.mark.parametrize(
    ("space", "needle"),
    [
        ({"grid": [1e-5], "choice": [1e-5]}, "exactly one of grid, choice, uniform, loguniform (got ['grid', 'choice'])"),
        ({}, "exactly one of grid, choice, uniform, loguniform (got none)"),
        ({"uniform": [1.0, 0.5]}, "uniform=[1.0, 0.5]: low must be below high"),
        ({"loguniform": [0.0, 1e-4]}, "loguniform=[0.0, 0.0001]: low must be > 0"),
        ({"grid": []}, "space.learner.lr.grid"),
        ({"normal": [0, 1]}, "unknown key 'space.learner.lr.normal'"),
    ],
)
def test_bad_space_is_rejected_naming_the_key(tmp_path, space, needle):
    msg = _error(tmp_path, {"space": {"learner.lr": space}})
    assert needle in msg and "space.learner.lr" in msg


def test_metric_must_be_a_per_step_metric(tmp_path):
    msg = _error(tmp_path, {"metric": "learner/avg", "space": {"learner.lr": {"grid": [1e-5]}}})
    assert "metric='learner/avg'" in msg and "reward/mean" in msg
    assert "metric='reward/accuracy' was renamed 'reward/gsm8k_correct'" in _error(
        tmp_path, {"metric": "reward/accuracy", "space": {"learner.lr": {"grid": [1e-5]}}})
    # reward/<x> may be a reward term: checked against the config's terms
    base = load_config(REPO / "configs/grpo_gsm8k_smollm2.yaml")
    check_sweep(load_sweep(_write(tmp_path, {"metric": "reward/gsm8k_format", "space": {"learner.lr": {"grid": [1e-5]}}})), base)
    typo = load_sweep(_write(tmp_path, {"metric": "reward/avg", "space": {"learner.lr": {"grid": [1e-5]}}}))
    with pytest.raises(SweepError, match=r"metric='reward/avg' is neither a per-step metric .* reward terms "
                                         r"\['reward/gsm8k_correct', 'reward/gsm8k_correct_skipped', 'reward/gsm8k_format'"):
        check_sweep(typo, base)


def test_mode_and_empty_space(tmp_path):
    assert "mode='best'" in _error(tmp_path, {"mode": "best", "space": {"learner.lr": {"grid": [1e-5]}}})
    assert "space={}" in _error(tmp_path, {"space": {}})


def test_pbt_fields_are_validated(tmp_path):
    ok = SweepConfig.model_validate({"space": {"learner.lr": {"loguniform": [1e-6, 1e-4]}},
                                     "scheduler": {"name": "pbt", "perturbation_interval_steps": 5, "resample_probability": 0.5}})
    assert ok.scheduler.perturbation_interval_steps == 5
    assert "scheduler.quantile_fraction=0.7" in _error(
        tmp_path, {"space": {"learner.lr": {"uniform": [1e-6, 1e-4]}}, "scheduler": {"name": "pbt", "quantile_fraction": 0.7}})
    # PBT perturbs values: a grid has nothing to perturb into
    assert "space.learner.lr cannot be a grid" in _error(
        tmp_path, {"space": {"learner.lr": {"grid": [1e-5, 1e-4]}}, "scheduler": {"name": "pbt"}})


def test_check_sweep_names_bad_config_keys_and_values():
    base = load_config(REPO / "configs" / "grpo_gsm8k_tiny.yaml")
    bad_key = SweepConfig.model_validate({"space": {"learner.lrr": {"grid": [1e-5]}}})
    with pytest.raises(SweepError, match=r"(?s)space\.learner\.lrr .*unknown key 'learner\.lrr'; did you mean 'learner\.lr'"):
        check_sweep(bad_key, base)
    # the upper bound of the range is not a valid learning rate
    bad_value = SweepConfig.model_validate({"space": {"rollout.top_p": {"uniform": [0.5, 1.5]}}})
    with pytest.raises(SweepError, match=r"(?s)space\.rollout\.top_p value 1\.5 \(uniform\).*rollout\.top_p=1\.5"):
        check_sweep(bad_value, base)
    too_long = SweepConfig.model_validate({"space": {"learner.lr": {"grid": [1e-5]}}, "scheduler": {"grace_period_steps": 3}})
    with pytest.raises(SweepError, match="grace_period_steps=3 must be below run.max_steps=3"):
        check_sweep(too_long, base)
    fifo = SweepConfig.model_validate({"space": {"learner.lr": {"grid": [1e-5]}}, "scheduler": {"name": "fifo", "grace_period_steps": 3}})
    check_sweep(fifo, base)  # the grace period is ASHA's alone


def test_missing_and_non_mapping_files(tmp_path):
    with pytest.raises(SweepError, match="does not exist"):
        load_sweep(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(SweepError, match="must hold a mapping, got list"):
        load_sweep(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("space:\n  learner.lr: {grid: [1e-5\n")
    with pytest.raises(SweepError, match=rf"^sweep file '{tmp_path / 'broken.yaml'}' is not valid YAML: "):
        load_sweep(tmp_path / "broken.yaml")


@pytest.mark.parametrize("key, tree, shown", [
    ("num_samples", {"num_samples": True}, "true"),
    ("scheduler.grace_period_steps", {"scheduler": {"grace_period_steps": True}}, "true"),
    ("trial_driver_cpus", {"trial_driver_cpus": False}, "false"),
])
def test_a_boolean_is_not_read_as_a_number_in_a_sweep_file(tmp_path, key, tree, shown):
    message = _error(tmp_path, {"space": {"learner.lr": {"grid": [1e-5]}}, **tree})
    assert f"  - {key}: got {shown}, a boolean; give a number" in message


def test_cli_sweep_reports_a_bad_sweep_file_without_starting_ray(tmp_path, capsys):
    from rlray.cli import build_parser, main

    args = build_parser().parse_args(["sweep", "c.yaml", "s.yaml", "learner.lr=1e-5", "run.max_steps=4"])
    assert (args.config, args.sweep, args.overrides) == ("c.yaml", "s.yaml", ["learner.lr=1e-5", "run.max_steps=4"])
    bad = _write(tmp_path, {"space": {"learner.lr": {"grid": [1e-5]}}, "metric": "reward"})
    assert main(["sweep", str(REPO / "configs" / "grpo_gsm8k_tiny.yaml"), str(bad)]) == 2
    assert "metric='reward' is not a per-step metric" in capsys.readouterr().err
