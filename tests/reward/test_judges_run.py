"""A GRPO run with two judges through Ray (tiny-random, hf backend, async rollouts): a label-logprob judge and a
group judge whose verdict its prefill writes; the judges are hot-swapped to version 2 after step 1 by a step hook,
without stopping the run; evaluation is judged too; raw judge outputs reach the samples table; every logged key is
registered; and the run removes the judges' applications it started."""

from __future__ import annotations

import math
import sys

import cloudpickle
import pytest

from rlray.config import Config, RewardFunctionConfig, load_config

# pointwise: the labels' probabilities; group: each response's length mod 10 by position as shown (version 1), then a
# constant 7 (version 2); the random model's own continuation is never read (the first match counts)
LABEL = ("{name: judge, path: tiny-random, backend: hf, dtype: float32, logprobs: true, prefill: 'Verdict:', weight: 0.5, "
         "parse: {labels: {correct: 1.0, wrong: 0.0}}, template: 'Q: {{ prompt }} Ref: {{ answer }} A: {{ response }}'}")
RANK = ("{name: rank, path: tiny-random, backend: hf, dtype: float32, mode: group, max_new_tokens: 2, weight: 0.1, "
        "parse: {match: first}, prefill: '{% for r in responses %}Response {{ loop.index }}: SCORE\n{% endfor %}'}")


class SwapJudgesAfter:
    """A control step hook: after step ``step`` it redeploys the judges of ``config`` (the hot swap), then lets the
    run go on."""

    def __init__(self, step: int, config: dict) -> None:
        self.step, self.config = step, config

    def __call__(self, event):
        if event.step == self.step:
            from rlray.launch.judges import deploy_judges
            from rlray.plan import resolve_plan

            deploy_judges(resolve_plan(Config.model_validate(self.config)))
        return None


cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the hook travels to the learner worker by value


@pytest.mark.ray
def test_a_run_judged_by_two_judges_with_a_hot_swap(ray_session, tmp_path, gsm8k_dir, repo_root):
    from ray import serve

    from rlray.launch.driver import run_training
    from rlray.observe.metrics import is_metric_key
    from rlray.observe.samples import rows_from_table
    from rlray.observe.tracking import get_run_metrics, read_artifact_json
    from rlray.rollout.weight_sync import free_port

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    overrides = [f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={uri}", f"data.train_files=[{gsm8k_dir}/train.jsonl]",
                 f"data.eval_files=[{gsm8k_dir}/test.jsonl]", "run.max_steps=3", "rollout.backend=hf", "rollout.max_staleness=1",
                 "eval.num_problems=2", "tracking.samples_per_step=4", f"reward.server.port={free_port()}"]  # fmt: skip
    length = f"{repo_root}/tests/fixtures/rewards.py:completion_length"
    tiny = repo_root / "configs/grpo_gsm8k_tiny.yaml"
    cfg = load_config(tiny, [*overrides, f"reward.judges=[{LABEL}, {RANK.replace('SCORE', '{{ r | length % 10 }}')}]"])
    cfg.reward.functions = [RewardFunctionConfig(function=length, weight=1.0)]
    swapped = load_config(tiny, [*overrides, "reward.version=2", f"reward.judges=[{LABEL}, {RANK.replace('SCORE', '7')}]"])
    swapped.reward.functions = cfg.reward.functions
    result = run_training(cfg, step_hooks=[SwapJudgesAfter(1, swapped.model_dump())])
    assert result.status == "FINISHED"
    metrics = get_run_metrics(uri, result.run_id)
    by_step = {k: [v for _, v in sorted(metrics[k])] for k in metrics}
    assert by_step["reward/judge_version"] == [1.0, 2.0, 2.0]  # swapped after step 1, the run never stopped
    assert by_step["reward/rank"][1:] == [7.0, 7.0] and 0.0 <= by_step["reward/rank"][0] <= 9.0
    assert all(0.0 < v < 1.0 for v in by_step["reward/judge"]) and by_step["reward/failed"] == [0.0, 0.0, 0.0]
    assert by_step["reward/judge_parse_failures"] == [0.0] * 3 and by_step["reward/judge_errors"] == [0.0] * 3
    assert all(v >= 2 for v in by_step["reward/judge_calls"])  # every step's batch: a call per judge at least
    assert by_step["eval/rank"][-1] == 7.0 and math.isfinite(by_step["eval/judge"][-1])  # evaluation is judged too
    terms = ["completion_length", "judge", "rank"]
    assert {k for k in metrics if not is_metric_key(k, terms)} == set()  # every logged key is registered
    table = read_artifact_json(uri, result.run_id, "samples/step_000003.json")
    rows = rows_from_table(table)
    assert len(rows) == 4 and all(r["terms"]["rank"] == 7.0 for r in rows)
    assert all("Response 1: 7" in r["judge_outputs"]["rank"] and "[p: correct 0." in r["judge_outputs"]["judge"] for r in rows)
    apps = serve.status().applications
    assert "rlray-judge-judge" not in apps and "rlray-judge-rank" not in apps  # the run removed what it started
