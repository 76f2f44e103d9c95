"""Lossless async resume, multi-turn: an async run (``rollout.overlap: on``, ``rollout.max_staleness: 1``) whose steps
mix environment episodes (``guess``, ``retry_arith``) and gateway agent episodes (``tests/fixtures/agents.py:tool_agent``)
crashes in step 3 at its weight push, with step 4's episodes submitted and not collected, and is resumed from its
step-2 snapshot, which kept the samples of step 3 (in flight when it was written). The resumed run trains each prompt
exactly once (the prompt ledger) and logs the uninterrupted run's metrics bit for bit (``benchmarks/compare_runs.py``'s
comparison, every key but wall-clock readings).

One Ray cluster, one rollout actor and one environment host (an ``AgentHost``) serve three in-process runs
(``worker.train``, world size 1, as tests/run/test_session.py): A runs 4 steps straight; B crashes in step 3; C resumes
B's latest snapshot. The full size (6 steps, staleness 2, two crashes) is marked slow. The crashed run's episode
threads are waited for before the resume (a killed driver takes them with it; here they would sample on the shared
actors)."""

from __future__ import annotations

import importlib
import json
import sys
import threading
import time
from pathlib import Path

import pytest

from rlray.checkpoint import contents
from rlray.checkpoint import storage as checkpoint
from rlray.config import Config, load_config
from rlray.observe.tracking import Tracker, read_ledger
from rlray.plan import resolve_plan
from rlray.run import ledger, online, worker
from rlray.run.state import RunOutcome, RunServices, WorkerArgs

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
pytestmark = pytest.mark.ray
ROWS = [  # 2 guess, 2 retry_arith, 2 agent, 2 single-turn rows: 2 prompts per step, 4 steps per epoch
    {"prompt": "Guess a number between 1 and 8.", "environment": "guess", "secret": 3, "low": 1, "high": 8, "max_guesses": 3},
    {"prompt": "What is 7 + 5?", "environment": "retry_arith", "a": 7, "op": "+", "b": 5, "answer": 12},
    {"prompt": "What is 2 + 2? calls=1", "environment": "adder"},
    {"prompt": "Guess a number between 1 and 16.", "environment": "guess", "secret": 11, "low": 1, "high": 16,
     "max_guesses": 3},
    {"prompt": "What is 9 - 4?", "environment": "retry_arith", "a": 9, "op": "-", "b": 4, "answer": 5},
    {"prompt": "Add 1 and 3. calls=1", "environment": "adder"},
    {"prompt": "Reply with the word yes.", "solution": "yes"},  # single-turn rows, scored by reward.functions
    {"prompt": "Reply with the word no.", "solution": "no"},
]


def _compare_module():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module("compare_runs")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def make_cfg(base: Path, name: str, *overrides: str, max_steps: int = 4, staleness: int = 1) -> Config:
    """The mixed tiny config: environments, an agent and single-turn rows, async (overlap on), a snapshot every 2 steps,
    no eval, lr 1e-3 and a length reward (every row: a random model gets a signal, so the weights change each step)."""
    from rlray.launch.driver import resolve_paths

    cfg = load_config(REPO / "configs/envs/mixed_tiny.yaml", [
        f"data.train_files=[{base}/rows.jsonl]", "eval.num_problems=0", f"run.max_steps={max_steps}",
        f"run.output_dir={base}/out", f"tracking.mlflow_uri=sqlite:///{base}/mlflow.db", f"tracking.experiment={name}",
        "env.environments={guess: 'rlray.envs.builtin.guess:GuessNumberEnv', "
        "retry_arith: 'rlray.envs.builtin.retry_arith:RetryArithmeticEnv'}",
        f"env.agents={{adder: '{FIXTURES}/agents.py:tool_agent'}}",
        "rollout.backend=hf", f"rollout.max_staleness={staleness}", "rollout.overlap=on", "rollout.max_new_tokens=8",
        "learner.prompts_per_step=2", "learner.sequences_per_minibatch=4", "learner.sequences_per_microbatch=2",
        "learner.lr=1e-3", "learner.torch_threads=1", "resources.rollout.num_workers=1", "resources.env.num_workers=1",
        "checkpoint.every_steps=2", "guard.kl_threshold=null", "monitor.heartbeat_s=5",
        f"reward.functions=[{{function: '{FIXTURES}/rewards.py:completion_length', weight: 1.0}}]", *overrides])
    return resolve_paths(cfg)


@pytest.fixture(scope="module")
def cluster(ray_session, tmp_path_factory, tiny_model_path):
    """(base folder, rollout actors, environment hosts) shared by every run of the module."""
    from rlray.launch.actors import kill_actors, start_env_hosts, start_rollout_actors
    from rlray.launch.driver import max_model_len

    base = tmp_path_factory.mktemp("async_resume")
    (base / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    plan = resolve_plan(make_cfg(base, "probe"))
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
    while any(t.name in ("rlray-episodes", "rlray-agents") for t in threading.enumerate()):
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


def histories(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Returns compare_runs' {key: [(step, value)]} of a run, wall-clock readings left out."""
    from mlflow.tracking import MlflowClient

    compare = _compare_module()
    return compare.metric_histories(MlflowClient(uri), run_id, compare.DEFAULT_IGNORE)


def joined(uri: str, runs: list[tuple[str, str | None]]) -> dict[str, list[tuple[int, float]]]:
    """Returns the metric histories of a crashed-and-resumed run: each run's steps up to the step the next one
    restored (``run/restored_step``, logged by a resume only, left out)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for i, (run_id, _) in enumerate(runs):
        until = checkpoint.read_manifest(runs[i + 1][1]).step if i + 1 < len(runs) else 10**9
        for key, series in histories(uri, run_id).items():
            if key != "run/restored_step":
                out.setdefault(key, []).extend((s, v) for s, v in series if s <= until and (s > 0 or i == 0))
    return out


def joined_ledger(uri: str, runs: list[tuple[str, str | None]]) -> dict[int, list[str]]:
    """Returns the prompt ledger of a crashed-and-resumed run: each run's steps up to the step the next one restored."""
    out: dict[int, list[str]] = {}
    for i, (run_id, _) in enumerate(runs):
        until = checkpoint.read_manifest(runs[i + 1][1]).step if i + 1 < len(runs) else 10**9
        out.update({s: ids for s, ids in read_ledger(uri, run_id).items() if s <= until})
    return out


def assert_lossless(base: Path, straight_id: str, runs: list[tuple[str, str | None]], *, steps: int, staleness: int,
                    name: str) -> dict[str, list[tuple[int, float]]]:
    """Asserts that the crashed-and-resumed ``runs`` trained every prompt exactly once, in the uninterrupted run's
    order, and logged its metrics bit for bit; returns the uninterrupted run's metric histories."""
    uri = f"sqlite:///{base}/mlflow.db"
    cfg = make_cfg(base, name, max_steps=steps, staleness=staleness)
    rows = ledger.training_rows(resolve_plan(cfg))
    got = joined_ledger(uri, runs)
    report = ledger.check_ledger(got, rows, seed=cfg.run.seed, shuffle=cfg.data.shuffle, last_step=steps,
                                 prompts_per_step=2, max_staleness=staleness)
    assert report.ok, report.summary()
    assert report.consumed == 2 * steps and got == read_ledger(uri, straight_id)
    compare = _compare_module()
    a, b = histories(uri, straight_id), joined(uri, runs)
    diffs = [(k, n, d, status, compare.first_difference(a.get(k, []), b.get(k, []), 0.0))
             for k, n, d, status in compare.compare_runs(a, b, 0.0) if status != "equal"]
    assert not diffs, "\n".join(map(str, diffs))
    assert {k for k in a if k.startswith("env/")} >= {"env/episodes", "env/gateway_calls"}
    assert all(v > 0 for _, v in a["learner/grad_norm"])  # every step changed the weights: later samples depend on them
    return a


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
    straight_metrics = assert_lossless(cluster[0], straight, runs, steps=4, staleness=1, name="crashed")
    assert [v for _, v in straight_metrics["rollout/staleness_max"]] == [0.0, 1.0, 1.0, 1.0]


@pytest.mark.slow  # ~3 Ray runs more; make test runs the one crash above
def test_two_crashes_at_staleness_2_resume_losslessly(cluster, tiny_model_path):
    """The full size: 6 steps at max_staleness 2 (two steps in flight at each snapshot), crashed in steps 3 and 5."""
    kw = {"max_steps": 6, "staleness": 2}
    outcome, straight_id = run(cluster, tiny_model_path, make_cfg(cluster[0], "straight6", **kw))
    assert isinstance(outcome, RunOutcome) and outcome.status == "FINISHED", outcome
    runs = crash_and_resume(cluster, tiny_model_path, "crashed6", (3, 5), **kw)
    assert len(runs) == 3 and [r[1].rsplit("/", 1)[-1] for r in runs[1:]] == ["step_00000002", "step_00000004"]
    assert len(checkpoint.read_manifest(runs[2][1]).data_cursor["in_flight"]) == 2
    metrics = assert_lossless(cluster[0], straight_id, runs, steps=6, staleness=2, name="crashed6")
    assert max(v for _, v in metrics["rollout/staleness_max"]) == 2.0
