"""The README's "your own prompts and reward" example, run as written: the command is read from README.md (and
docs/prompts-and-rewards.md shows the same one).

Test-size overrides are appended (the tiny-random model, one step, 2 prompts x 2 samples, the transformers
backend), so what is checked is the README's data file, reward function and command line, not the demo's sizes.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from rlray import cli
from rlray.observe.tracking import get_run, get_run_metrics

REPO = Path(__file__).resolve().parents[1]
COMMAND_START = "rlray train configs/grpo_smollm2.yaml"


def shown_command(page: str) -> list[str]:
    """Returns the own-task command ``page`` (README.md or a docs page) shows, as argv (lines joined at trailing
    backslashes)."""
    text = (REPO / page).read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(COMMAND_START)]
    assert len(lines) == 1, f"{page} should show the command '{COMMAND_START} ...' once, found {len(lines)}"
    return shlex.split(lines[0])


def readme_command() -> list[str]:
    """Returns the README's own-task command as argv; docs/prompts-and-rewards.md shows the same one."""
    argv = shown_command("README.md")
    assert shown_command("docs/prompts-and-rewards.md") == argv
    return argv


def test_the_readme_command_names_the_example_files():
    argv = readme_command()
    assert argv[:3] == ["rlray", "train", "configs/grpo_smollm2.yaml"]
    assert "data.train_files=docs/examples/my_prompts.jsonl" in argv
    assert "reward.functions=[{function: docs/examples/my_reward.py:mentions_capital}]" in argv


@pytest.mark.ray
def test_the_readme_own_task_command_trains(ray_session, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the README's paths are relative to the repository root
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sizes = ["model.path=tiny-random", "model.dtype=float32", "rollout.backend=hf", "run.max_steps=1",
             "learner.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
             "learner.sequences_per_minibatch=4", "learner.sequences_per_microbatch=2", "learner.torch_threads=1",
             "monitor.port=0", "guard.kl_threshold=null", f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={uri}"]
    assert cli.main(readme_command()[1:] + sizes) == 0
    out = capsys.readouterr().out
    run_id = json.loads(out[out.rindex("{\n"):])["run_id"]  # the JSON summary `rlray train` prints last
    assert get_run(uri, run_id).info.status == "FINISHED"
    metrics = {k: [v for _, v in series] for k, series in get_run_metrics(uri, run_id).items()}
    # one term of weight 1: the summed reward is that term, sample for sample, so the means agree exactly
    assert metrics["reward/mentions_capital"] == metrics["reward/mean"]
    assert 0.0 <= metrics["reward/mean"][0] <= 1.0
    assert metrics["reward/mentions_capital_skipped"] == [0.0] and metrics["reward/failed"] == [0.0]
