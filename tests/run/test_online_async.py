"""Async mode through the real step (run_step) on one learner rank with two transformers-backend
rollout actors: k = 0 reproduces the synchronous stage sequence exactly, and k = 2 keeps every
sample within 2 policy versions of the update that consumes it."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from rlray import schema
from rlray.config import RewardFunctionConfig, load_config
from rlray.learner import online as learner_online
from rlray.learner.collective import Collective
from rlray.plan import resolve_plan
from rlray.run.build import sampling_for_step, update_spec
from rlray.run.experience import Experience, build_experience, score
from rlray.run.online import distribute, reference_and_old_logprobs, run_step, setup, sync_weights

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray
UPDATE_KEYS = ("learner/loss", "learner/grad_norm", "learner/pg_loss", "algo/kl", "rollout/logprob_abs_diff")


@pytest.fixture(scope="module")
def cfg_and_actors(ray_session, tmp_path_factory, gsm8k_dir, tiny_model_path):
    """A tiny-model config (hf rollout backend) and 2 rollout actors started by start_rollout_actors."""
    from rlray.launch.actors import kill_actors, start_rollout_actors
    from rlray.plan import resolve_plan

    tmp = tmp_path_factory.mktemp("async")
    train = tmp / "train.jsonl"  # 32 rows: setup tokenizes every train prompt, 4 times in this module
    train.write_text("".join((gsm8k_dir / "train.jsonl").read_text().splitlines(keepends=True)[:32]))
    cfg = load_config(
        REPO / "configs/grpo_gsm8k_tiny.yaml",
        [f"run.output_dir={tmp}/out", f"tracking.mlflow_uri=sqlite:///{tmp}/mlflow.db",
         f"data.train_files=[{train}]", "eval.num_problems=0", "rollout.backend=hf",
         "learner.lr=1e-3", "learner.torch_threads=1", "resources.rollout.num_workers=2"],
    )
    cfg.reward.functions = [RewardFunctionConfig(function=f"{REPO}/tests/fixtures/rewards.py:completion_length", weight=1.0)]
    actors = start_rollout_actors(resolve_plan(cfg), tiny_model_path, 512)
    yield cfg, actors
    kill_actors(actors)


def _fresh(cfg, model_dir, actors):
    """Returns a new rank-0 context whose actors hold the initial weights at version 0."""
    ctx = setup(resolve_plan(cfg), Collective(), model_dir=model_dir, actors=actors, run_id=None)
    ctx.lead.fleet.push_weights(ray.put(ctx.learner.export_weights(torch.float32)), 0)
    return ctx


def test_actor_names_and_core_lists(cfg_and_actors):
    _, actors = cfg_and_actors
    assert [ray.get_actor(f"rlray:rollout-{i}") for i in range(2)] == actors


@pytest.fixture(scope="module")
def k0_run(cfg_and_actors, tiny_model_path):
    """Returns (per-step metrics, final float32 weights) of 3 run_step calls with max_staleness = 0."""
    cfg, actors = cfg_and_actors
    ctx = _fresh(cfg, tiny_model_path, actors)
    got = [run_step(ctx, step).metrics for step in range(3)]
    return got, ctx.learner.export_weights(torch.float32)


def test_k0_equals_the_synchronous_stage_sequence(cfg_and_actors, tiny_model_path, k0_run):
    cfg, actors = cfg_and_actors
    got, weights = k0_run
    ref = _fresh(cfg, tiny_model_path, actors)
    spec, expected = update_spec(cfg, 1), []
    for step in range(3):  # stages 1-7 written out, as the loop ran before async mode existed
        rows, ids = ref.take_prompts()
        completions = ref.lead.fleet.generate(ids, sampling_for_step(cfg, step))
        scored = score(ref.lead.reward, rows, completions, ref.tokenizer)
        shard, batch = distribute(ref, Experience(build_experience(rows, ids, completions, scored.values), {}, []))
        data = reference_and_old_logprobs(ref, schema.collate(shard, ref.pad_token_id), spec)
        data = learner_online.advantages(data, spec, ref.coll.all_reduce_sum)
        m = learner_online.update(ref.learner, data, batch.minibatch_norms, spec, ref.coll.all_reduce_sum)
        expected.append({**m, "reward/mean": sum(scored.values["reward"]) / len(completions)})
        ref.policy_version = sync_weights(ref)

    for g, e in zip(got, expected, strict=True):
        assert {k: g[k] for k in UPDATE_KEYS} == {k: e[k] for k in UPDATE_KEYS}
        assert g["reward/mean"] == pytest.approx(e["reward/mean"], abs=1e-12)
        assert g["rollout/staleness_max"] == 0.0
    assert [g["rollout/policy_version"] for g in got] == [0.0, 1.0, 2.0]
    final = ref.learner.export_weights(torch.float32)
    assert all(torch.equal(weights[k], final[k]) for k in weights)


def test_k2_bounds_staleness_and_changes_the_run(cfg_and_actors, tiny_model_path, k0_run):
    cfg, actors = cfg_and_actors
    async_cfg = cfg.model_copy(deep=True)
    async_cfg.rollout.max_staleness = 2
    async_cfg.rollout.overlap = "on"  # auto turns it off here: rollout and learner share this machine's 2 cores
    ctx = _fresh(async_cfg, tiny_model_path, actors)
    got = [run_step(ctx, step).metrics for step in range(4)]
    # step t trains on rollouts of version max(0, t-2): staleness 0, 1, 2, 2 (never above k = 2)
    assert [g["rollout/staleness_max"] for g in got] == [0.0, 1.0, 2.0, 2.0]
    assert [g["rollout/staleness_mean"] for g in got] == [0.0, 1.0, 2.0, 2.0]
    assert [g["rollout/policy_version"] for g in got] == [0.0, 0.0, 0.0, 1.0]
    assert ctx.lead.pipeline.in_flight == 2
    assert all(g["reward/version"] == 1.0 for g in got)
    # the first step is the same as in sync mode; the next trains on older samples
    sync_got, _ = k0_run
    assert got[0]["learner/loss"] == sync_got[0]["learner/loss"]
    assert got[1]["learner/loss"] != sync_got[1]["learner/loss"]


def test_k2_without_overlap_is_the_synchronous_run(cfg_and_actors, tiny_model_path, k0_run):
    """rollout.overlap off (auto on this 2-core machine): the steps ahead keep their prompts, in the async order, and
    generate when their step comes with the newest weights, so the run is the synchronous one, step for step."""
    cfg, actors = cfg_and_actors
    async_cfg = cfg.model_copy(deep=True)
    async_cfg.rollout.max_staleness = 2
    ctx = _fresh(async_cfg, tiny_model_path, actors)
    assert ctx.lead.pipeline.overlap is False  # auto: the rollout actors share the learner's node and its 2 cores
    got = [run_step(ctx, step).metrics for step in range(3)]
    assert ctx.lead.pipeline.in_flight == 2  # the data cursor still runs 2 steps ahead
    sync_got, sync_weights = k0_run
    for g, s in zip(got, sync_got, strict=True):
        assert {k: g[k] for k in UPDATE_KEYS} == {k: s[k] for k in UPDATE_KEYS}
        assert g["rollout/staleness_max"] == 0.0
    assert [g["rollout/policy_version"] for g in got] == [0.0, 1.0, 2.0]
    final = ctx.learner.export_weights(torch.float32)
    assert all(torch.equal(sync_weights[k], final[k]) for k in final)
