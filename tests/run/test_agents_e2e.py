"""The README's agent example, run as written: `rlray train configs/envs/agent_smollm2.yaml` (read from README.md) at
test size (tiny-random, 2 steps, async with one step of staleness), through rollout actors, the environment host's
gateway and its MCP server, Ray Train and MLflow; then `rlray eval` of its final snapshot with pass@k. One run serves
every check: the agents' metrics, the kept samples (turns and tool calls) and the evaluation."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest

from rlray import cli
from rlray.observe.samples import rows_from_table
from rlray.observe.tracking import get_run, get_run_metrics, read_artifact_json, sample_steps

REPO = Path(__file__).resolve().parents[2]
COMMAND_START = "rlray train configs/envs/agent_smollm2.yaml"


def readme_command() -> list[str]:
    """Returns the README's agent command as argv."""
    lines = [line.strip() for line in (REPO / "README.md").read_text().splitlines() if line.strip().startswith(COMMAND_START)]
    assert len(lines) == 1, f"README.md should show the command '{COMMAND_START} ...' once, found {len(lines)}"
    return shlex.split(lines[0])


def test_the_readme_shows_the_agent_file_it_ships():
    text = (REPO / "README.md").read_text()
    agent = (REPO / "docs/examples/my_agent.py").read_text()
    assert agent in text and len(agent.splitlines()) <= 25  # the README's agent is the file, as written
    assert readme_command() == ["rlray", "train", "configs/envs/agent_smollm2.yaml"]


@pytest.mark.ray
def test_the_readme_agent_command_trains_and_evaluates(ray_session, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the README's paths are relative to the repository root
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sizes = ["model.path=tiny-random", "model.dtype=float32", "rollout.backend=hf", "run.max_steps=2",
             "learner.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
             "learner.sequences_per_minibatch=4", "learner.sequences_per_microbatch=2", "learner.torch_threads=1",
             "rollout.max_staleness=1", "tracking.samples_per_step=4", "monitor.port=0", "guard.kl_threshold=null",
             f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={uri}"]
    argv = readme_command()[1:] + sizes
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.rindex("{\n"):])
    run_id = summary["run_id"]
    assert get_run(uri, run_id).info.status == "FINISHED"
    metrics = {k: [v for _, v in series] for k, series in get_run_metrics(uri, run_id).items()}
    assert metrics["env/episodes"] == [4.0, 4.0]  # 2 prompts x 2 agent episodes per step
    assert metrics["env/failed"] == [0.0, 0.0] and metrics["reward/failed"] == [0.0, 0.0]
    assert metrics["env/template_drift"] == [0.0, 0.0]  # the agent only extends its conversation
    assert all(v >= 1.0 for v in metrics["env/gateway_calls_mean"]) and all(v >= 1.0 for v in metrics["env/turns_mean"])
    # the hosts' batchers: each step's engine calls carried that step's gateway calls, one prompt each
    engine_calls, per_call = metrics["env/agent_engine_calls"], metrics["env/agent_prompts_per_engine_call"]
    assert all(v >= 1.0 for v in engine_calls) and all(v >= 0.0 for v in metrics["timing/agent_batch_wait_s"])
    assert [round(c * p) for c, p in zip(engine_calls, per_call, strict=True)] == metrics["env/gateway_calls"]
    assert all(0.0 <= v <= 1.0 for v in metrics["reward/env"])
    assert all(math.isfinite(v) for v in metrics["learner/pg_loss"]) and len(metrics["learner/pg_loss"]) == 2
    assert metrics["rollout/staleness_max"][1] <= 1.0
    # the kept samples show the episode turn by turn: the prompt lists the MCP tool, assistant turns are marked
    steps = sample_steps(uri, run_id)
    assert steps == [1, 2]
    rows = rows_from_table(read_artifact_json(uri, run_id, f"samples/step_{steps[-1]:06d}.json"))
    assert len(rows) == 4 and all(r["num_turns"] >= 1 and r["stop_reason"] in ("done", "max_turns") for r in rows)
    assert all('"name": "spell"' in r["prompt"] for r in rows)
    assert all(r["segments"][0]["role"] == "assistant" and r["segment"] is None for r in rows)

    # `rlray eval` of the final snapshot runs the rows as agent episodes, with pass@2
    got = cli.main(["eval", readme_command()[2], *sizes, "data.eval_files=[docs/examples/word_prompts.jsonl]",
                    "eval.num_problems=3", "eval.pass_k=2", "--checkpoint", summary["final_snapshot"]])
    assert got == 0
    out = capsys.readouterr().out
    scores = json.loads(out[out.index("{"):])
    assert scores["eval/num_problems"] == 3.0 and scores["eval/env_failed"] == 0.0
    assert 0.0 <= scores["eval/pass@2"] <= 1.0 and scores["eval/env_turns_mean"] >= 1.0


@pytest.mark.ray
@pytest.mark.slow  # 157 s; make test covers the sweep (tests/sweep/test_tune.py) and the agent run (above) each once
def test_a_sweep_trains_the_readme_agent_in_each_trial(ray_session, tmp_path, monkeypatch):
    """`rlray sweep` over the README's agent config: each trial starts its own environment host, gateway and MCP
    server, and logs the agents' metrics in its child run."""
    from rlray.config import load_config
    from rlray.observe.tracking import child_runs
    from rlray.sweep.spec import SweepConfig
    from rlray.sweep.tune import run_sweep

    monkeypatch.chdir(REPO)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config(readme_command()[2], [
        "model.path=tiny-random", "model.dtype=float32", "rollout.backend=hf", "run.max_steps=1",
        "learner.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
        "learner.sequences_per_minibatch=4", "learner.sequences_per_microbatch=2", "learner.torch_threads=1",
        "monitor.port=0", "guard.kl_threshold=null", f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={uri}"])
    sweep = SweepConfig.model_validate({"metric": "reward/mean", "space": {"learner.lr": {"grid": [1e-4, 1e-3]}},
                                        "scheduler": {"name": "fifo"}, "max_concurrent_trials": 1})
    result = run_sweep(cfg, sweep)
    assert result.status == "FINISHED"
    children = child_runs(uri, parent_run_id=result.parent_run_id)
    assert sorted(float(c.data.params["learner.lr"]) for c in children) == [1e-4, 1e-3]
    for child in children:
        assert child.info.status == "FINISHED"
        metrics = {k: [v for _, v in series] for k, series in get_run_metrics(uri, child.info.run_id).items()}
        assert metrics["env/episodes"] == [4.0] and metrics["env/failed"] == [0.0]
        assert metrics["env/template_drift"] == [0.0] and metrics["env/gateway_calls_mean"][0] >= 1.0
