"""``rlray check CONFIG`` (issue 29): the preflight, then each environment's first prompt with its tools' schemas as the
model will see it, and the first single-turn row's; no Ray, no MLflow run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlray import cli
from rlray.launch import driver

REPO = Path(__file__).resolve().parents[2]
TRL_CALCULATOR = REPO / "tests" / "fixtures" / "envs" / "trl_calculator.py"


def test_check_prints_each_environments_first_prompt_with_its_tools(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(driver, "init_ray", lambda **_: pytest.fail("rlray check started Ray"))
    rows = [{"prompt": "What is 6 x 7?", "a": 6, "b": 7, "environment": "mult"},
            {"prompt": "Say hi.", "solution": "hi"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    status = cli.main(["check", str(REPO / "configs/envs/mixed_tiny.yaml"), f"data.train_files=[{tmp_path}/rows.jsonl]",
                       f"data.eval_files=[{tmp_path}/rows.jsonl]", f"run.output_dir={tmp_path}/out",
                       f"env.environments={{mult: '{TRL_CALCULATOR}:TRLCalculatorEnv'}}",
                       f"tracking.mlflow_uri=sqlite:///{tmp_path}/m.db"])
    out = capsys.readouterr().out
    assert status == 0
    assert out.startswith("rlray check: every input of the run is usable (model ")
    assert f"environment 'mult' ({TRL_CALCULATOR}:TRLCalculatorEnv, a TRL environment_factory class): 2 rows (train and " \
           "eval); tools: multiply" in out  # the train row and the same row read from eval_files
    # the smollm2-tools template lists the tools' schemas in the system turn
    assert '"name": "multiply", "description": "Multiplies two integers."' in out
    assert "<|im_start|>user\nWhat is 6 x 7? Use the multiply tool on 6 and 7.<|im_end|>\n<|im_start|>assistant\n" in out
    assert "first prompt, row 'rows:0', as the model sees it (" in out and "at most 3 turns" in out
    assert "single-turn rows: 1 of 2 training rows; the first, 'rows:1'" in out
    assert "<|im_start|>user\nSay hi.<|im_end|>" in out
    assert not (tmp_path / "m.db").exists()  # no MLflow run was created


def test_check_of_a_broken_environment_is_the_preflights_error(tmp_path, capsys):
    from rlray.config import load_config
    from rlray.launch.check import check_run
    from rlray.launch.preflight import PreflightError
    from rlray.plan import resolve_plan

    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "What is 6 x 7?", "a": 6, "b": 7}) + "\n")
    cfg = driver.resolve_paths(load_config(REPO / "configs/envs/mixed_tiny.yaml", [
        f"data.train_files=[{tmp_path}/rows.jsonl]", f"data.eval_files=[{tmp_path}/rows.jsonl]", "reward.functions=[]",
        f"run.output_dir={tmp_path}/out", "env.default=mult", f"env.environments={{mult: '{TRL_CALCULATOR}:NotAnEnv'}}"]))
    with pytest.raises(PreflightError, match=r"class NotAnEnv has no reset method"):
        check_run(resolve_plan(cfg))


def test_check_of_a_broken_environment_is_one_line(tmp_path, capsys):
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "What is 6 x 7?", "a": 6, "b": 7}) + "\n")
    status = cli.main(["check", str(REPO / "configs/envs/mixed_tiny.yaml"), f"data.train_files=[{tmp_path}/rows.jsonl]",
                       f"data.eval_files=[{tmp_path}/rows.jsonl]", f"run.output_dir={tmp_path}/out",
                       f"tracking.mlflow_uri=sqlite:///{tmp_path}/m.db", "env.default=mult", "reward.functions=[]",
                       f"env.environments={{mult: '{TRL_CALCULATOR}:NotAnEnv'}}"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert f"rlray: env.environments.mult='{TRL_CALCULATOR}:NotAnEnv': class NotAnEnv has no reset method" in err
