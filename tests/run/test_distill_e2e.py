"""End to end: 2 steps of pure on-policy distillation (configs/distill_tiny.yaml) through vLLM rollout actors, Ray
Train and MLflow: the tiny-random student, the differently seeded tiny-random@1 teacher on the learner, no task
reward. Under `slow`: `make test` covers distillation through Ray in tests/run/test_envs_e2e.py, whose mixed-environment
run also distills from tiny-random@1 (one run for both, to keep the suite's time)."""

import math
from pathlib import Path

import pytest

from rlray.observe.metrics import METRIC_KEYS
from rlray.observe.tracking import get_run, get_run_metrics

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.ray
@pytest.mark.slow
def test_pure_distillation_two_steps_through_ray(ray_session, tmp_path, gsm8k_dir):
    from rlray.config import load_config
    from rlray.launch.driver import run_training

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config(REPO / "configs" / "distill_tiny.yaml", [
        f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={uri}", "run.max_steps=2",
        f"data.train_files=[{gsm8k_dir}/train.jsonl]", f"data.eval_files=[{gsm8k_dir}/test.jsonl]"])  # fmt: skip
    result = run_training(cfg)
    assert result.status == "FINISHED"
    assert get_run(uri, result.run_id).info.status == "FINISHED"
    metrics = get_run_metrics(uri, result.run_id)
    assert "algo/distill_reverse_kl" in METRIC_KEYS
    kl = metrics["algo/distill_reverse_kl"]
    assert [s for s, _ in kl] == [1, 2] and all(math.isfinite(v) for _, v in kl)
    assert [v for _, v in metrics["reward/mean"]] == [0.0, 0.0]  # task reward off: 0.0, never NaN (failed)
    assert [v for _, v in metrics["reward/failed"]] == [0.0, 0.0]
    # GRPO's advantages are 0 (equal rewards); what is left is the teacher's per-token signal, and it moves the student
    assert all(v > 0 for _, v in metrics["algo/advantage_abs_mean"])
    assert all(v > 0 and math.isfinite(v) for _, v in metrics["learner/grad_norm"])
    assert "algo/distill_jsd" not in metrics
