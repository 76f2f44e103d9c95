"""Partial rollouts through the real step (run_step) on one learner rank and one transformers-backend rollout actor
(``PartialRolloutActor``): with rollout.max_staleness=2, weight pushes reach the generations in flight, every token
records the version that sampled it, no token is more than 2 versions behind the update that consumes it, and the
prompt ledger is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from rlray.config import RewardFunctionConfig, load_config
from rlray.data import load_prompt_rows
from rlray.learner.collective import Collective
from rlray.plan import resolve_plan
from rlray.run import online
from rlray.run.ledger import check_ledger

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray
STEPS = 4


@pytest.fixture(scope="module")
def partial_run(ray_session, tmp_path_factory, gsm8k_dir, tiny_model_path):
    """Returns (config, train rows, per step: (learner version before it, its StepResult, its experience table))."""
    from rlray.launch.actors import kill_actors, start_rollout_actors

    tmp = tmp_path_factory.mktemp("partial")
    train = tmp / "train.jsonl"
    train.write_text("".join((gsm8k_dir / "train.jsonl").read_text().splitlines(keepends=True)[:16]))
    cfg = load_config(
        REPO / "configs/grpo_gsm8k_tiny.yaml",
        [f"run.output_dir={tmp}/out", f"tracking.mlflow_uri=sqlite:///{tmp}/mlflow.db", f"data.train_files=[{train}]",
         "eval.num_problems=0", "rollout.backend=hf", "learner.lr=1e-3", "learner.torch_threads=1",
         "resources.rollout.num_workers=1", "rollout.max_staleness=2", "rollout.overlap=on", "rollout.partial=true",
         "rollout.partial_segment_tokens=1", "rollout.max_new_tokens=12"],
    )
    cfg.reward.functions = [RewardFunctionConfig(function=f"{REPO}/tests/fixtures/rewards.py:completion_length", weight=1.0)]
    actors = start_rollout_actors(resolve_plan(cfg), tiny_model_path, 512)
    tables = []
    collect = online.collect_experience

    def keep_table(*args, **kwargs):  # the step's experience table, as run_step builds it
        got = collect(*args, **kwargs)
        tables.append(got.table)
        return got

    try:
        online.collect_experience = keep_table
        ctx = online.setup(resolve_plan(cfg), Collective(), model_dir=tiny_model_path, actors=actors, run_id=None)
        ctx.lead.fleet.push_weights(ray.put(ctx.learner.export_weights(torch.float32)), 0)
        steps = []
        for step in range(STEPS):
            before = ctx.policy_version
            steps.append((before, online.run_step(ctx, step)))
    finally:
        online.collect_experience = collect
        kill_actors(actors)
    rows = load_prompt_rows([str(train)], prompt_column=cfg.data.prompt_column)
    return cfg, rows, [(v, r, t) for (v, r), t in zip(steps, tables, strict=True)]


def test_every_token_records_its_version_within_the_staleness_bound(partial_run):
    _, _, steps = partial_run
    spanning = 0
    for step, (learner, result, table) in enumerate(steps):
        versions = table.column("token_versions").to_pylist()
        first = table.column("policy_version").to_pylist()
        # step t's rollout was sent at the start of step t - 2 (learner version max(0, t - 2)); pushes up to the
        # learner's version before step t can reach it while it generates
        oldest_allowed = max(0, step - 2)
        for row, head in zip(versions, first, strict=True):
            assert row == sorted(row) and row[0] == head  # never decreasing; the row's version is its oldest token's
            assert oldest_allowed <= row[0] and row[-1] <= learner  # staleness per token at most 2, none from the future
            spanning += len(set(row)) > 1
        assert result.metrics["rollout/staleness_max"] == learner - min(first) <= 2
        # the step's partial metrics are the table's: rows that span versions, each token's staleness
        tokens = [v for row in versions for v in row]
        assert result.metrics["rollout/partial_samples_frac"] == sum(len(set(r)) > 1 for r in versions) / len(versions)
        assert result.metrics["rollout/token_staleness_mean"] == pytest.approx(learner - sum(tokens) / len(tokens))
        assert result.metrics["rollout/token_staleness_max"] == learner - min(tokens) <= 2
        for kept in result.samples:  # the viewer's record: the response cut where its version changes
            parts = kept.version_parts
            assert parts == () or ([v for v, _, _ in parts] == sorted({v for v, _, _ in parts}) and len(parts) > 1
                                   and sum(n for _, n, _ in parts) == kept.response_tokens)
    # 12 segments of 1 token per sample: the pushes of steps 0..2 land inside the generations of the steps ahead
    assert spanning > 0
    assert max(result.metrics["rollout/partial_samples_frac"] for _, result, _ in steps) > 0


def test_the_prompt_ledger_stays_exact(partial_run):
    cfg, rows, steps = partial_run
    ledger = {step + 1: result.prompt_ids for step, (_, result, _) in enumerate(steps)}
    assert all(len(ids) == cfg.learner.prompts_per_step for ids in ledger.values())
    report = check_ledger(ledger, rows, seed=cfg.run.seed, shuffle=cfg.data.shuffle,
                          prompts_per_step=cfg.learner.prompts_per_step, max_staleness=2)
    assert report.ok and report.consumed == STEPS * cfg.learner.prompts_per_step
