"""The command line's quick answers: ``rlray --version`` and ``rlray config`` (the resolved config, and with
--describe each field's description and default as YAML comments)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import rlray
from rlray import cli
from rlray.config import load_config
from rlray.config.describe import described_yaml

CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "grpo_gsm8k_tiny.yaml")


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"rlray {rlray.__version__}"


def test_config_prints_the_resolved_config_with_overrides(capsys):
    assert cli.main(["config", CONFIG, "guard.kl_threshold=0.05", "tracking.samples_per_step=2"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    expected = load_config(CONFIG, ["guard.kl_threshold=0.05", "tracking.samples_per_step=2"]).model_dump(mode="json")
    assert printed == expected
    assert printed["guard"]["kl_threshold"] == 0.05 and printed["tracking"]["samples_per_step"] == 2
    assert printed["tracking"]["tensorboard_dir"] is None  # defaults are filled in: the whole config


def test_config_describe_comments_every_field_and_still_loads(capsys):
    assert cli.main(["config", CONFIG, "tracking.samples_per_step=0", "--describe"]) == 0
    text = capsys.readouterr().out
    cfg = load_config(CONFIG, ["tracking.samples_per_step=0"])
    assert yaml.safe_load(text) == cfg.model_dump(mode="json")  # the comments change nothing
    assert text == described_yaml(cfg)
    lines = text.splitlines()

    def comment_above(field_line: str) -> str:
        i, out = lines.index(field_line), []
        while lines[i - 1].lstrip().startswith("#"):
            i -= 1
            out.insert(0, lines[i].strip().lstrip("#").strip())
        return " ".join(out)

    got = comment_above("  samples_per_step: 0")
    assert got.startswith("Rollouts kept per online step") and got.endswith("Default: 4.")
    assert comment_above("  tensorboard_dir: null").endswith("None: off. Default: null.")
    assert comment_above("tracking:") == "MLflow tracking, the samples kept per step, and TensorBoard."
    assert all(len(line) <= 120 for line in lines if line.lstrip().startswith("#"))


def test_config_names_a_bad_key(capsys):
    assert cli.main(["config", CONFIG, "tracking.sample_per_step=3"]) == 2
    assert "tracking.sample_per_step" in capsys.readouterr().err


@pytest.mark.parametrize("describe", [[], ["--describe"]])
def test_config_never_prints_a_secret(tmp_path, capsys, describe):
    secret = "https://hooks.example/T0k3nS3cr3t"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"monitor": {"alerts": ["log", "webhook"], "webhook_url": secret},
                                    "checkpoint": {"s3": {"access_key_id": "AKIAid", "secret_access_key": "AKIAverysecret"}}}))
    assert cli.main(["config", str(path), *describe]) == 0
    out = capsys.readouterr().out
    assert "T0k3nS3cr3t" not in out and "AKIAverysecret" not in out
    assert yaml.safe_load(out)["monitor"]["webhook_url"] == "**********"
