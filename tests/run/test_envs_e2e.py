"""End to end: 2 GRPO steps of configs/envs/mixed_tiny.yaml (four environments and single-turn rows in one run)
through vLLM rollout actors, environment hosts, Ray Train and MLflow; the run also distills from a differently
seeded teacher (tiny-random@1: on-policy distillation's end-to-end check shares this run), and `rlray eval` then
scores its final snapshot."""

import math
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlray.observe.metrics import is_metric_key, term_keys
from rlray.observe.tracking import get_run, get_run_metrics
from tests.fixtures.bench import load_bench

REPO = Path(__file__).resolve().parents[2]
# the settings of the mixed run beyond its paths (its work counts are held to tests/fixtures/work_baseline.json)
OVERRIDES = ("learner.lr=1e-3", "teacher.path=tiny-random@1", "teacher.weight=0.5",
             # options that would cost a run of their own: an entropy bonus and masked sequence-level IS
             "algo.entropy_coef=0.001", "algo.rollout_correction.mode=sequence_mask", "algo.rollout_correction.ratio_max=3.0")
ENV_KEYS = ["env/episodes", "env/turns_mean", "env/tool_calls_mean", "env/tool_errors", "env/failed",
            "env/observation_tokens_mean", "env/episodes_rerun", "reward/env", "reward/exact_match"]


def work_counts_module():
    """Returns benchmarks/work_counts.py as a module (the benchmark scripts are not a package)."""
    return load_bench("work_counts")


@pytest.mark.ray
def test_mixed_environments_two_steps_through_ray(ray_session, tmp_path, tiny_model_path):
    from rlray.config import load_config
    from rlray.launch.driver import run_training

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config(REPO / "configs/envs/mixed_tiny.yaml",
                      [f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={uri}",
                       f"data.train_files=[{REPO}/docs/examples/mixed_envs.jsonl]",
                       f"data.eval_files=[{REPO}/docs/examples/mixed_envs.jsonl]", *OVERRIDES])
    result = run_training(cfg)
    assert result.status == "FINISHED"
    run = get_run(uri, result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["learner.prompts_per_step"] == "5" and run.data.tags["rlray.config_hash"]
    metrics = get_run_metrics(uri, result.run_id)
    # the main job's checks (tests/run/test_online_e2e.py, under slow, runs them on a single-turn GRPO run)
    for key in ("learner/pg_loss", "learner/grad_norm", "algo/kl", "perf/tokens_per_s", "timing/rollout_s",
                "timing/reward_s", "timing/logprobs_s", "timing/update_s", "timing/weight_sync_s", "timing/step_s"):
        assert [s for s, _ in metrics[key]] == [1, 2] and all(math.isfinite(v) for _, v in metrics[key]), key
    assert [v for _, v in metrics["rollout/policy_version"]] == [0.0, 1.0]  # step 2 sampled with the synced weights
    assert [s for s, _ in metrics["eval/reward_mean"]] == [0, 2]  # eval before training and after the last step
    final = Path(result.final_snapshot)
    assert (final / "manifest.json").exists() and (final / "trainer_state.pt").exists()
    before = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    after = load_file(str(final / "model" / "model.safetensors"))
    assert len([k for k in before if not torch.equal(before[k], after[k])]) >= len(before) // 2
    for key in ENV_KEYS:
        assert [s for s, _ in metrics[key]] == [1, 2], key
    # the 2 steps take the file's 10 rows once (5 prompts each): 8 environment rows x 2 samples are episodes, the
    # 2 single-turn rows are not
    assert sum(v for _, v in metrics["env/episodes"]) == 16.0
    stops = {k: dict(v) for k, v in metrics.items() if k.startswith("env/stop_reason/")}
    for step, episodes in metrics["env/episodes"]:
        assert sum(v.get(step, 0.0) for v in stops.values()) == episodes  # every episode has one stop reason
    assert all(v == 0.0 for _, v in metrics["env/failed"])  # no environment broke
    assert all(v == 0.0 for _, v in metrics["reward/failed"])  # every sample has a reward (env 0.0 without one)
    logged = [k for k in metrics if k.startswith(("env/", "rollout/", "learner/", "algo/"))]
    assert all(is_metric_key(k) for k in logged), [k for k in logged if not is_metric_key(k)]
    assert {"reward/env", "reward/env_skipped", "eval/env", "eval/exact_match"} <= set(metrics) & set(term_keys(["env", "exact_match"]))
    assert "eval/env_success" in metrics and "eval/env_turns_mean" in metrics
    for key in ("algo/entropy", "algo/rollout_is_weight_mean", "algo/rollout_corrected_sequence_fraction",
                "algo/rollout_kl", "algo/rollout_ratio_max"):
        assert [s for s, _ in metrics[key]] == [1, 2] and all(math.isfinite(v) for _, v in metrics[key]), key
    # distillation from the teacher on the sampled tokens (observation tokens are masked out of it)
    kl = metrics["algo/distill_reverse_kl"]
    assert [s for s, _ in kl] == [1, 2] and all(math.isfinite(v) and v != 0.0 for _, v in kl)

    # no silent slowdown (issue 42): the run's work counts (learner tokens computed, padded and shared, generated
    # tokens, weight sync bytes, engine calls, environment steps) grow by at most 1% over the committed baseline
    # (tests/fixtures/work_baseline.json; benchmarks/work_counts.py says how to update it on purpose)
    assert all(v >= 1.0 for _, v in metrics["rollout/engine_calls"])
    assert len({v for _, v in metrics["rollout/weight_sync_bytes"]}) == 1  # every sync ships the same whole policy
    work = work_counts_module().check_run("mixed_tiny", metrics, "tests/run/test_envs_e2e.py (" + ", ".join(OVERRIDES) + ")")
    for note in work.notes:
        warnings.warn(f"rlray work counts: {note}", stacklevel=1)
    assert work.ok, work.report("mixed_tiny")

    # `rlray eval` of the final snapshot runs the held-out rows as episodes too, with pass@k
    from rlray.launch.driver import evaluate_checkpoint

    cfg.eval.pass_k = 2
    got = evaluate_checkpoint(cfg, result.final_snapshot)
    assert got["eval/num_problems"] == 4.0
    assert 0.0 <= got["eval/env_success"] <= 1.0 and got["eval/env_turns_mean"] >= 1.0
    assert 0.0 <= got["eval/pass@2"] <= 1.0 and got["eval/env_failed"] == 0.0
    assert all(is_metric_key(k) or k in term_keys(["env", "exact_match"]) for k in got), got


def test_readme_shows_the_environment_file_and_the_command_this_test_runs():
    readme = (REPO / "README.md").read_text()
    page = (REPO / "docs/environments.md").read_text()
    code = (REPO / "docs/examples/my_env.py").read_text().rstrip()
    assert f"```python\n{code}\n```" in page  # the file as the environments page shows it
    assert "```bash\nrlray train configs/envs/mixed_tiny.yaml\n```" in readme
    assert "```bash\nrlray train configs/envs/mixed_tiny.yaml\n```" in page
    assert "docs/examples/my_env.py:WordLengthEnv" in (REPO / "configs/envs/mixed_tiny.yaml").read_text()
    assert len(code.splitlines()) <= 30


SHIPPED_ENV_CONFIGS = ("calculator_tiny", "guess_number_tiny", "retry_arith_tiny")
E2E_ENV_CONFIG = "retry_arith_tiny"  # the environment `make demo` trains: its 2-step run is in make test


@pytest.mark.parametrize("name", [n for n in SHIPPED_ENV_CONFIGS if n != E2E_ENV_CONFIG])
def test_each_shipped_environment_config_passes_rlray_check(name, capsys):
    """`rlray check configs/envs/<env>_tiny.yaml` (the preflight: model, data, the environment class loaded and its
    first episode opened; then that episode's opening prompt rendered) passes, without Ray, for the shipped configs
    whose 2-step run below is ``slow``."""
    from rlray import cli
    from rlray.config import load_config

    cfg = load_config(REPO / f"configs/envs/{name}.yaml")
    files = [f"data.train_files=[{REPO / cfg.data.train_files[0]}]", f"data.eval_files=[{REPO / cfg.data.eval_files[0]}]"]
    assert cli.main(["check", str(REPO / f"configs/envs/{name}.yaml"), *files]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rlray check: every input of the run is usable"), out
    environment = next(iter(cfg.env.environments))
    assert f"'{environment}'" in out, out  # its first episode's opening prompt, named by its environment


@pytest.mark.ray
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == E2E_ENV_CONFIG else [pytest.mark.slow])
                                  for n in SHIPPED_ENV_CONFIGS])
def test_each_shipped_environment_runs_its_own_config_for_two_steps(ray_session, tmp_path, name):
    """configs/envs/<env>_tiny.yaml: each built-in environment alone, 2 steps through Ray (rollouts on transformers,
    which saves each run a vLLM engine's start); the learner packs its rows
    (no padding), shares the group's opening where the config keeps learner.share_prefixes on. In ``make test``:
    retry_arith (the environment `make demo` trains), ~55 s; the other two are ``slow`` (each passes ``rlray check``
    above, and runs in the mixed-environment run at the top of this file)."""
    from rlray.config import load_config
    from rlray.launch.driver import run_training

    cfg = load_config(REPO / f"configs/envs/{name}.yaml", [
        f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri=sqlite:///{tmp_path}/mlflow.db",
        "algo.entropy_coef=0.001",  # a gradient even where no episode succeeds (tiny-random: zero advantages)
        "rollout.backend=hf"])  # transformers rollouts: the vLLM episode path runs in the mixed test above
    cfg.data.train_files = [str(REPO / f) for f in cfg.data.train_files]
    cfg.data.eval_files = [str(REPO / f) for f in cfg.data.eval_files]
    result = run_training(cfg)
    assert result.status == "FINISHED"
    metrics = get_run_metrics(cfg.tracking.mlflow_uri, result.run_id)
    episodes = cfg.learner.prompts_per_step * cfg.rollout.samples_per_prompt
    assert [v for _, v in metrics["env/episodes"]] == [episodes, episodes]
    for key in ("learner/grad_norm", "timing/logprobs_s", "timing/update_s", "perf/learner_tokens_real"):
        assert [s for s, _ in metrics[key]] == [1, 2] and all(math.isfinite(v) and v > 0 for _, v in metrics[key]), key
    assert all(v == 0.0 for _, v in metrics["perf/learner_tokens_padding"])  # packed rows: no padding computed
    shared = [v for _, v in metrics["perf/learner_tokens_shared"]]
    assert all(v > 0 for v in shared) if cfg.learner.share_prefixes else all(v == 0 for v in shared)
