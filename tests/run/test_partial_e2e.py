"""Partial rollouts through the real run (``worker.train``, world size 1, in process) on one transformers-backend
rollout actor (``PartialRolloutActor``) and one environment host (an ``AgentHost``), with rollout.max_staleness=2 and a
snapshot every 2 steps, on rows mixing environment episodes (``guess``, ``retry_arith``: each turn may continue across
an update), gateway agents (``adder``: each call may too) and single-turn rows: weight pushes reach the generations in
flight, every token records the version that sampled it (an episode's observation tokens the version before them), no
token is more than 2 versions behind the update that consumes it, and the prompt ledger is exact, across a crash with
generations in flight.

Run A crashes in step 3 at its weight push (its update done, steps 4 and 5 generating) and run B resumes A's step-2
snapshot. That snapshot ended the generations of steps 3 and 4 under the weights of then (version 2) and kept them
(``rollouts/in_flight.json``): B trains steps 3 and 4 on exactly those samples, each token with the version and
behaviour logprob it was sampled with. Where later pushes land inside a partial generation depends on timing, so the
samples B draws itself are not compared with an uninterrupted run's (docs/distributed.md, "Partial rollouts")."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from rlray.checkpoint import contents
from rlray.checkpoint import storage as checkpoint
from rlray.config import load_config
from rlray.observe.tracking import Tracker, read_ledger
from rlray.plan import resolve_plan
from rlray.plan.paths import resolve_paths
from rlray.rollout.types import completion_from_dict
from rlray.run import online, worker
from rlray.run.ledger import check_ledger, training_rows
from rlray.run.state import RunOutcome, RunServices, WorkerArgs

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray
STEPS = 4
ROWS = [  # 2 guess, 2 retry_arith, 2 agent and 2 single-turn rows: 2 prompts per step, 4 steps per epoch
    {"prompt": "Guess a number between 1 and 8.", "environment": "guess", "secret": 3, "low": 1, "high": 8, "max_guesses": 3},
    {"prompt": "What is 7 + 5?", "environment": "retry_arith", "a": 7, "op": "+", "b": 5, "answer": 12},
    {"prompt": "Reply with the word yes.", "solution": "yes"},
    {"prompt": "Guess a number between 1 and 16.", "environment": "guess", "secret": 11, "low": 1, "high": 16,
     "max_guesses": 3},
    {"prompt": "What is 9 - 4?", "environment": "retry_arith", "a": 9, "op": "-", "b": 4, "answer": 5},
    {"prompt": "What is 2 + 2? calls=1", "environment": "adder"},  # agent rows: steps 3, 4 (the seeded shuffle)
    {"prompt": "Name a colour.", "solution": "red"},
    {"prompt": "Add 1 and 3. calls=1", "environment": "adder"},
]


def wait_for_episode_threads(timeout_s: float = 120.0) -> None:
    """Waits until the crashed run's episode threads have ended (a killed driver takes them with it; in this process
    they would otherwise still sample on the shared actors while the resume runs)."""
    deadline = time.monotonic() + timeout_s
    while any(t.name in ("rlray-rollout", "rlray-episodes", "rlray-agents") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the crashed run's episode threads did not end"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def partial_run(ray_session, tmp_path_factory, tiny_model_path):
    """Returns (config, train rows, [(run, 0-based step, learner version before it, its experience, its metrics)]
    of every step either run collected, [(MLflow run id, snapshot it resumed)] of runs A and B)."""
    from rlray.launch.actors import kill_actors, start_env_hosts, start_rollout_actors

    tmp = tmp_path_factory.mktemp("partial")
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = load_config(REPO / "configs/envs/mixed_tiny.yaml", [
        f"run.output_dir={tmp}/out", f"tracking.mlflow_uri=sqlite:///{tmp}/mlflow.db", f"data.train_files=[{tmp}/rows.jsonl]",
        f"run.max_steps={STEPS}", "checkpoint.every_steps=2", "eval.num_problems=0", "guard.kl_threshold=null",
        "env.environments={guess: 'rlray.envs.builtin.guess:GuessNumberEnv', "
        "retry_arith: 'rlray.envs.builtin.retry_arith:RetryArithmeticEnv'}",
        f"env.agents={{adder: '{REPO}/tests/fixtures/agents.py:tool_agent'}}",
        "rollout.backend=hf", "rollout.max_staleness=2", "rollout.overlap=on", "rollout.partial=true",
        "rollout.partial_segment_tokens=1", "rollout.max_new_tokens=12", "rollout.samples_per_prompt=4",
        "learner.prompts_per_step=2", "learner.sequences_per_minibatch=8", "learner.sequences_per_microbatch=4",
        "learner.lr=1e-3", "learner.torch_threads=1", "resources.rollout.num_workers=1", "resources.env.num_workers=1",
        f"reward.functions=[{{function: '{REPO}/tests/fixtures/rewards.py:completion_length', weight: 1.0}}]"])
    # a long instruction on every opening (episodes' too): each 1-token segment re-prefills it, so a step's rollout
    # outlasts an update and the pushes land inside the generations of the steps ahead
    cfg.data.instruction = load_config(REPO / "configs/grpo_gsm8k_tiny.yaml").data.instruction
    cfg = resolve_paths(cfg)
    plan = resolve_plan(cfg)
    actors = start_rollout_actors(plan, tiny_model_path, 512)
    hosts = start_env_hosts(plan, model_dir=tiny_model_path)
    steps, runs = [], []
    collect, push = online.collect_experience, online.sync_weights

    def keep_table(lead, plan, tokenizer, step, timer, *, policy_version, world=1):  # each step's experience
        got = collect(lead, plan, tokenizer, step, timer, policy_version=policy_version, world=world)
        steps.append((len(runs), step, policy_version, got.table, got.metrics))
        return got

    def crash(ctx):  # run A, step 3: its update is done, steps 4 and 5 generate
        if not runs and ctx.policy_version == 2:
            assert ctx.lead.pipeline.in_flight == 2
            raise RuntimeError("injected crash in step 3, generations in flight")
        return push(ctx)

    source = None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(online, "collect_experience", keep_table)
        patch.setattr(online, "sync_weights", crash)
        try:
            for _ in range(2):
                tracker = Tracker(cfg.tracking.mlflow_uri, cfg.tracking.experiment)
                args = WorkerArgs(cfg.model_dump(), tiny_model_path, tracker.run_id, actors, env_hosts=hosts,
                                  services=RunServices(resume_from=source))
                try:
                    outcome = worker.train(resolve_plan(cfg), args)
                except RuntimeError as err:
                    outcome = err
                    wait_for_episode_threads()
                runs.append((tracker.run_id, source))
                source = checkpoint.latest_snapshot(checkpoint.join(cfg.checkpoint_uri,
                                                                    checkpoint.run_dir_name(tracker.run_id)))
        finally:
            kill_actors(actors + hosts)
    assert isinstance(outcome, RunOutcome) and outcome.status == "FINISHED", outcome
    assert runs[1][1].endswith("step_00000002")
    return cfg, training_rows(plan), steps, runs


def test_every_token_records_its_version_within_the_staleness_bound(partial_run):
    _, _, steps, _ = partial_run
    assert [(run, step) for run, step, *_ in steps] == [(0, 0), (0, 1), (0, 2), (1, 2), (1, 3)]
    spanning, episodes_spanning, agent_rows = 0, 0, 0
    for _, step, learner, table, metrics in steps:
        assert learner == step  # the update of step t starts from version t (0-based)
        versions = table.column("token_versions").to_pylist()
        first = table.column("policy_version").to_pylist()
        # step t's rollout was sent at the start of step t - 2 (learner version max(0, t - 2)); pushes up to the
        # learner's version before step t can reach it while it generates
        oldest_allowed = max(0, step - 2)
        stops = table.column("stop_reason").to_pylist()
        agent_rows += sum('"adder"' in c for c in table.column("prompt_columns").to_pylist())  # gateway agents' rows
        for row, head, stop in zip(versions, first, stops, strict=True):
            assert row == sorted(row) and row[0] == head  # never decreasing; the row's version is its oldest token's
            assert oldest_allowed <= row[0] and row[-1] <= learner  # staleness per token at most 2, none from the future
            spanning += len(set(row)) > 1
            episodes_spanning += len(set(row)) > 1 and stop != "single_turn"  # an environment's turn across an update
        assert metrics["rollout/staleness_max"] == learner - min(first) <= 2
        # the step's partial metrics are the table's: rows that span versions, each sampled token's staleness
        masks = table.column("response_mask").to_pylist()  # sampled tokens only: not an episode's observations
        tokens = [v for row, mask in zip(versions, masks, strict=True) for v, m in zip(row, mask, strict=True) if m]
        assert metrics["rollout/partial_samples_frac"] == sum(len(set(r)) > 1 for r in versions) / len(versions)
        assert metrics["rollout/token_staleness_mean"] == pytest.approx(learner - sum(tokens) / len(tokens))
        assert metrics["rollout/token_staleness_max"] == learner - min(tokens) <= 2
    # 12 segments of 1 token per sample: the pushes of steps 1 and 2 land inside the generations of the steps ahead
    assert spanning > 0 and episodes_spanning > 0
    assert agent_rows == 3 * 4  # step 3 (run A, run B) and step 4 (run B) hold an agent row, 4 samples each
    assert max(metrics["rollout/partial_samples_frac"] for *_, metrics in steps) > 0


def test_the_prompt_ledger_stays_exact_across_the_crash(partial_run):
    cfg, rows, _, runs = partial_run
    uri = cfg.tracking.mlflow_uri
    ledger = {s: ids for s, ids in read_ledger(uri, runs[0][0]).items() if s <= 2} | read_ledger(uri, runs[1][0])
    assert sorted(ledger) == [1, 2, 3, 4] and all(len(ids) == cfg.learner.prompts_per_step for ids in ledger.values())
    report = check_ledger(ledger, rows, seed=cfg.run.seed, shuffle=cfg.data.shuffle, last_step=STEPS,
                          prompts_per_step=cfg.learner.prompts_per_step, max_staleness=2)
    assert report.ok, report.summary()
    assert report.consumed == STEPS * cfg.learner.prompts_per_step


def test_the_resumed_run_trains_the_kept_generations_with_their_versions_and_logprobs(partial_run):
    """The step-2 snapshot kept steps 3 and 4, their generations ended under version 2; run B trains them as kept
    (tokens, per-token versions, behaviour logprobs), and run A had drawn the same step 3 before it crashed."""
    _, _, steps, runs = partial_run
    manifest = checkpoint.read_manifest(runs[1][1])
    kept = contents.read_in_flight(runs[1][1], manifest, None)
    assert manifest.policy_version == 2 and [k["version"] for k in kept] == [0, 1]  # sent at the start of steps 1, 2
    tables = {(run, step): table for run, step, _, table, _ in steps}
    for step, entry in zip((2, 3), kept, strict=True):
        completions = [completion_from_dict(c) for c in entry["completions"]]
        table = tables[(1, step)]
        assert table.column("token_versions").to_pylist() == [c.versions for c in completions]
        assert all(c.versions[-1] <= 2 for c in completions)  # ended before the snapshot: nothing newer than version 2
        assert table.column("response_token_ids").to_pylist() == [c.response_token_ids for c in completions]
        got = table.column("rollout_logprobs").to_pylist()
        assert got == [np.float32(c.rollout_logprobs).tolist() for c in completions]  # the table stores float32
    assert tables[(0, 2)].equals(tables[(1, 2)])  # step 3 as run A drew it, before its crash
