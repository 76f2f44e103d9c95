"""Lossless async resume, multi-turn: an async run (``rollout.overlap: on``, ``rollout.max_staleness: 1``) whose steps
mix environment episodes (``guess``, ``retry_arith``) and gateway agent episodes (``tests/fixtures/agents.py:tool_agent``)
crashes in step 3 at its weight push, with step 4's episodes submitted and not collected, and is resumed from its
step-2 snapshot, which kept the samples of step 3 (in flight when it was written). The resumed run trains each prompt
exactly once (the prompt ledger) and logs the uninterrupted run's metrics bit for bit (``benchmarks/compare_runs.py``'s
comparison, every key but wall-clock readings).

One Ray cluster, one rollout actor and one environment host (an ``AgentHost``) serve three in-process runs
(``worker.train``, world size 1, as tests/run/test_session.py): A runs 4 steps straight; B crashes in step 3; C resumes
B's latest snapshot; D (one run more, ~25 s) has its rollout actor and its environment host SIGKILLed at seeded steps,
inside a step's first engine turn, and Ray restarts them: the step's rollout runs again, whole (``rlray.run.rerun``),
and D ends with A's ledger and metrics bit for bit but for the counted lost work. The full size (6 steps, staleness
2: two crashes, and the two kills) is marked slow; so are the kills of a learner rank and of the driver
(tests/faults/test_kill_resume.py).
The crashed run's episode threads are waited for before the resume (a killed driver takes them with it; here they
would sample on the shared actors)."""

from __future__ import annotations

import random
import sys
import threading
import time
from pathlib import Path

import pytest

from rlray.checkpoint import contents
from rlray.checkpoint import storage as checkpoint
from rlray.config import Config
from rlray.observe.tracking import Tracker, read_ledger
from rlray.plan import resolve_plan
from rlray.run import episodes, online, worker
from rlray.run.state import RunOutcome, RunServices, WorkerArgs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from async_runs import FAULT_COUNTERS, ROWS, assert_lossless, make_cfg, sigkill, write_rows  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster(ray_session, tmp_path_factory, tiny_model_path):
    """(base folder, rollout actors, environment hosts) shared by every run of the module."""
    from rlray.launch.actors import kill_actors, start_env_hosts, start_rollout_actors
    from rlray.launch.driver import max_model_len

    base = tmp_path_factory.mktemp("async_resume")
    write_rows(base)
    # restarts enough for the kills of both sizes (the runs' own configs do not start actors)
    plan = resolve_plan(make_cfg(base, "probe", "resources.rollout.max_restarts=4", "resources.env.max_restarts=4"))
    actors = start_rollout_actors(plan, tiny_model_path, max_model_len(plan.settings))
    hosts = start_env_hosts(plan, model_dir=tiny_model_path)
    yield base, actors, hosts
    kill_actors(actors + hosts)


def run(cluster, model_path: str, cfg: Config, **services) -> tuple[RunOutcome | Exception, str]:
    """Runs ``train`` in this process; returns (its outcome, or the error it raised; the MLflow run id)."""
    _, actors, hosts = cluster
    tracker = Tracker(cfg.tracking.mlflow_uri, cfg.tracking.experiment)
    args = WorkerArgs(cfg.model_dump(), model_path, tracker.run_id, actors, env_hosts=hosts,
                      services=RunServices(**services))
    try:
        return worker.train(resolve_plan(cfg), args), tracker.run_id
    except RuntimeError as err:
        return err, tracker.run_id


def wait_for_rollout_threads(timeout_s: float = 120.0) -> None:
    """Waits until the crashed run's episode and agent threads (``in_background``) have ended: a killed driver takes
    them with it; in this process they would otherwise still sample on the shared actors while the resume runs."""
    deadline = time.monotonic() + timeout_s
    while any(t.name in ("rlray-rollout", "rlray-episodes", "rlray-agents") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the crashed run's rollout threads did not end"
        time.sleep(0.2)


def crash_and_resume(cluster, model_path: str, name: str, crash_steps: tuple[int, ...], **kw) -> list[tuple[str, str | None]]:
    """Runs the config, crashing in each step of ``crash_steps`` (1-based) at its weight push: its update is done, and
    the episodes of the next step (submitted when it started) are running; then resumes from the run's latest
    snapshot, each time. Returns [(MLflow run id, the snapshot it started from)] of every run, in order (the last one
    finished)."""
    real_sync, runs, pending = online.sync_weights, [], list(crash_steps)

    def crash(ctx):
        if pending and ctx.policy_version + 1 == pending[0]:  # the push of step s's update is version s
            pending.pop(0)
            assert ctx.lead.pipeline.in_flight == ctx.settings.rollout.max_staleness  # submitted, not collected
            raise RuntimeError(f"injected crash in step {ctx.policy_version + 1}, episodes in flight")
        return real_sync(ctx)

    source = None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(online, "sync_weights", crash)
        while True:
            cfg = make_cfg(cluster[0], name, **kw)
            outcome, run_id = run(cluster, model_path, cfg, resume_from=source)
            runs.append((run_id, source))
            if isinstance(outcome, RunOutcome):
                assert outcome.status == "FINISHED" and not pending
                return runs
            assert "injected crash" in str(outcome), outcome
            wait_for_rollout_threads()
            source = checkpoint.join(cfg.checkpoint_uri, checkpoint.run_dir_name(run_id))
            source = checkpoint.latest_snapshot(source)
            assert source is not None


@pytest.fixture(scope="module")
def straight(cluster, tiny_model_path):
    """A: the uninterrupted run (4 steps)."""
    outcome, run_id = run(cluster, tiny_model_path, make_cfg(cluster[0], "straight"))
    assert isinstance(outcome, RunOutcome) and outcome.status == "FINISHED", outcome
    return run_id


def test_a_crash_with_episodes_in_flight_resumes_losslessly(cluster, tiny_model_path, straight):
    runs = crash_and_resume(cluster, tiny_model_path, "crashed", (3,))
    assert len(runs) == 2 and runs[1][1].endswith("step_00000002")
    manifest = checkpoint.read_manifest(runs[1][1])
    assert len(manifest.data_cursor["in_flight"]) == 1  # step 3's prompts were taken, its samples kept
    kept = contents.read_in_flight(runs[1][1], manifest, None)
    assert [k["version"] for k in kept] == [1] and len(kept[0]["completions"]) == 4  # 2 prompts x 2, at version 1
    straight_metrics, _ = assert_lossless(cluster[0], straight, runs, steps=4, staleness=1, name="crashed")
    assert [v for _, v in straight_metrics["rollout/staleness_max"]] == [0.0, 1.0, 1.0, 1.0]


KILL_SEED = 0


def kill_plan(seed: int, ledger_steps: dict[int, list[str]]) -> dict[int, str]:
    """Returns {step: "rollout" | "host"}: two distinct seeded steps (from 2 on) among those whose prompts (``ledger_steps``,
    an uninterrupted run's ledger: "rows:<index in ROWS>") include an environment episode, whose rollout kills that
    process."""
    def has_env(ids: list[str]) -> bool:
        return any(ROWS[int(i.split(":")[1])].get("environment") in ("guess", "retry_arith") for i in ids)

    picked = random.Random(seed).sample(sorted(s for s, ids in ledger_steps.items() if s >= 2 and has_env(ids)), 2)
    return {picked[0]: "rollout", picked[1]: "host"}


def kill_and_check(cluster, model_path: str, straight_id: str, name: str, *, steps: int, staleness: int) -> dict:
    """Runs the config with its rollout actor and its environment host SIGKILLed at ``kill_plan``'s steps, each inside
    the step's first engine turn (its environment episodes reset on the host, its agent episodes running there), and
    checks the run against the uninterrupted ``straight_id``; returns the kill plan."""
    _, actors, hosts = cluster
    straight_ledger = read_ledger(f"sqlite:///{cluster[0]}/mlflow.db", straight_id)
    plan, victims = kill_plan(KILL_SEED, straight_ledger), {"rollout": actors[0], "host": hosts[0]}
    real_turn, killed = episodes.EpisodeRollout._sample_turn, {}

    def sample_turn(self, active, sampling, turn):
        step = sampling.seed - episodes.SEED_STRIDE_PER_TURN * turn + 1  # run.seed 0: step s samples with seed s - 1
        if step in plan and step not in killed:
            assert turn == 0 and any(ep.environment for ep in active)  # reset on the host, not sampled yet
            killed[step] = sigkill(victims[plan[step]])
        return real_turn(self, active, sampling, turn)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(episodes.EpisodeRollout, "_sample_turn", sample_turn)
        outcome, run_id = run(cluster, model_path, make_cfg(cluster[0], name, max_steps=steps, staleness=staleness))
    assert isinstance(outcome, RunOutcome) and outcome.status == "FINISHED", outcome
    assert sorted(killed) == sorted(plan)
    a, b = assert_lossless(cluster[0], straight_id, [(run_id, None)], steps=steps, staleness=staleness, name=name,
                           counted=FAULT_COUNTERS)
    assert sum(v for _, v in b["rollout/actor_failures"]) == 1 and sum(v for _, v in a["rollout/actor_failures"]) == 0
    rerun_steps = {s for s, v in b["env/episodes_rerun"] if v}  # the first steps' rollouts run side by side
    assert set(plan) <= rerun_steps <= {s for k in plan for s in range(k - staleness, k + 1)}
    assert not any(v for _, v in a["env/episodes_rerun"])
    assert all(vb >= va for (_, va), (_, vb) in zip(a["rollout/engine_calls"], b["rollout/engine_calls"], strict=True))
    return plan


def test_a_killed_rollout_actor_and_environment_host_are_restarted_and_the_run_stays_exact(cluster, tiny_model_path,
                                                                                          straight):
    """One run, two real kills (SIGKILL) at seeded steps with episodes in flight. Ray restarts the process; the step's
    rollout runs again, whole, with the same seeds and weights (``rlray.run.rerun``), so the run ends with the
    uninterrupted run's ledger and every metric bit for bit, but the counters of the work the kills cost."""
    assert kill_and_check(cluster, tiny_model_path, straight, "killed", steps=4, staleness=1) == {3: "rollout", 4: "host"}


@pytest.fixture(scope="module")
def straight6(cluster, tiny_model_path):
    """The uninterrupted run at full size: 6 steps at max_staleness 2."""
    outcome, run_id = run(cluster, tiny_model_path, make_cfg(cluster[0], "straight6", max_steps=6, staleness=2))
    assert isinstance(outcome, RunOutcome) and outcome.status == "FINISHED", outcome
    return run_id


@pytest.mark.slow  # 2 Ray runs more (one shared with the crashes below); make test kills at the small size above
def test_kills_at_full_size_leave_the_run_exact(cluster, tiny_model_path, straight6):
    """The kills at the full size: 6 steps at max_staleness 2 (the first three steps' rollouts run side by side)."""
    plan = kill_and_check(cluster, tiny_model_path, straight6, "killed6", steps=6, staleness=2)
    assert plan == {5: "rollout", 3: "host"}  # seed 0 (step 6 has single-turn rows only)


@pytest.mark.slow  # ~3 Ray runs more; make test runs the one crash above
def test_two_crashes_at_staleness_2_resume_losslessly(cluster, tiny_model_path, straight6):
    """The full size: 6 steps at max_staleness 2 (two steps in flight at each snapshot), crashed in steps 3 and 5."""
    kw, straight_id = {"max_steps": 6, "staleness": 2}, straight6
    runs = crash_and_resume(cluster, tiny_model_path, "crashed6", (3, 5), **kw)
    assert len(runs) == 3 and [r[1].rsplit("/", 1)[-1] for r in runs[1:]] == ["step_00000002", "step_00000004"]
    assert len(checkpoint.read_manifest(runs[2][1]).data_cursor["in_flight"]) == 2
    metrics, _ = assert_lossless(cluster[0], straight_id, runs, steps=6, staleness=2, name="crashed6")
    assert max(v for _, v in metrics["rollout/staleness_max"]) == 2.0
