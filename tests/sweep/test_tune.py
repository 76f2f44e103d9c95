"""Ray Tune sweeps: a real 2-trial sweep on tiny-random, and the pieces of the Tune wiring."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rlray.config import load_config
from rlray.observe.tracking import Tracker, child_runs, get_run, get_run_metrics
from rlray.run.hooks import StepEnd
from rlray.sweep.reporter import TuneStepReporter
from rlray.sweep.spec import SweepConfig
from rlray.sweep.tune import (
    TrialRunCloser,
    concurrent_trials,
    make_scheduler,
    param_space,
    trial_config,
    trial_demand,
)

REPO = Path(__file__).resolve().parents[2]
PER_STEP = ["reward/mean", "algo/kl", "learner/loss", "learner/lr", "perf/tokens_per_s"]


@pytest.mark.ray
def test_two_trial_sweep_logs_child_runs(tiny_sweep):
    result, uri, sweep = tiny_sweep
    assert result.status == "FINISHED"
    parent = get_run(uri, result.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["rlray.sweep.metric"] == "learner/lr" and parent.data.tags["rlray.sweep.scheduler"] == "asha"
    children = child_runs(uri, parent_run_id=result.parent_run_id)
    assert len(children) == 2 == len(result.trials)
    by_lr = {float(c.data.params["learner.lr"]): c for c in children}
    assert sorted(by_lr) == [1e-4, 1e-3]  # one child run per grid value
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == result.parent_run_id
        assert child.info.experiment_id == parent.info.experiment_id
        assert child.data.tags["rlray.output_dir"].endswith(f"/trials/{child.data.tags['rlray.tune_trial_id']}")
    # lr=1e-4 ran the whole training: 2 steps, its final snapshot, FINISHED
    done = by_lr[1e-4]
    assert done.info.status == "FINISHED"
    metrics = get_run_metrics(uri, done.info.run_id)
    for key in PER_STEP:
        assert [s for s, _ in metrics[key]] == [1, 2], key
    manifest = Path(done.data.tags["rlray.last_snapshot"]) / "manifest.json"
    assert json.loads(manifest.read_text())["step"] == 2
    assert done.data.tags["rlray.last_snapshot"].startswith(done.data.tags["rlray.output_dir"] + "/snapshots/")
    # lr=1e-3 ranked worse at the rung after step 1 (mode min): ASHA stopped it before step 2,
    # and the sweep closed its MLflow run as KILLED
    stopped = by_lr[1e-3]
    assert stopped.info.status == "KILLED"
    assert stopped.data.tags["rlray.stop_reason"] == "stopped early by the Tune scheduler"
    assert [s for s, _ in get_run_metrics(uri, stopped.info.run_id)["learner/lr"]] == [1]
    # the summary: Tune's clock was one result per step; the best trial is the lowest lr
    assert {t.run_id: t.steps for t in result.trials} == {done.info.run_id: 2, stopped.info.run_id: 1}
    assert result.best_run_id == done.info.run_id == parent.data.tags["rlray.sweep.best_run_id"]
    assert {t.trial_id for t in result.trials} == {c.data.tags["rlray.tune_trial_id"] for c in children}
    # the rollout actors of both trials are gone, the stopped trial's too (they die with their trial)
    import ray

    namespaces = {c.data.tags["rlray.namespace"] for c in children}  # the run's actors' Ray namespace
    assert len(namespaces) == 2 and all(n.startswith("rlray-") for n in namespaces)
    deadline = time.monotonic() + 60
    while left := [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] in namespaces]:
        assert time.monotonic() < deadline, left
        time.sleep(1)


def _cfg(tmp_path, *overrides):
    return load_config(REPO / "configs/grpo_gsm8k_tiny.yaml", [f"run.output_dir={tmp_path}", *overrides])


def test_trial_config_applies_sampled_values(tmp_path):
    base = _cfg(tmp_path).model_dump(mode="json")
    cfg = trial_config(base, {"learner.lr": 3e-5, "algo.kl_coef": 0.0, "rollout.temperature": 0.7}, "abc_00001")
    assert cfg.learner.lr == 3e-5 and cfg.algo.kl_coef == 0.0 and cfg.rollout.temperature == 0.7
    assert cfg.run.output_dir == f"{tmp_path}/trials/abc_00001"
    assert cfg.run.name == "kl_coef=0,lr=3e-05,temperature=0.7"
    # the rest of the base config is untouched
    assert cfg.learner.prompts_per_step == 2 and cfg.model.path == "tiny-random"


def test_trial_demand_and_concurrency(tmp_path):
    cfg = _cfg(tmp_path, "resources.rollout.num_workers=2", "resources.rollout.cpus=1", "resources.learner.gpus=1",
               "resources.learner.num_workers=2")
    demand = trial_demand(cfg, 0.1)
    # 0.1 driver + 2 rollout x 1 CPU + 2 learners x 0.25 CPU (the default); 2 learners x 1 GPU
    assert demand == pytest.approx({"CPU": 2.6, "GPU": 2.0})
    assert concurrent_trials(demand, {"CPU": 16.0, "GPU": 8.0}) == 4  # GPU-bound: 8 // 2
    assert concurrent_trials(demand, {"CPU": 5.0, "GPU": 8.0}) == 1  # CPU-bound: 5 // 2.6
    with_reward = _cfg(tmp_path, "reward.server.enabled=true", "resources.reward.replicas=2", "resources.reward.cpus=0.5")
    # 0.1 + 1 rollout x 0.25 + 1 learner x 0.25 + 2 reward replicas x 0.5
    assert trial_demand(with_reward, 0.1)["CPU"] == pytest.approx(1.6)
    assert concurrent_trials({"CPU": 1.1, "GPU": 0.0}, {"CPU": 2.0}) == 1
    assert concurrent_trials({"CPU": 1.0, "GPU": 0.0}, {"CPU": 2.0}) == 2  # exact fit counts
    assert concurrent_trials(demand, {"CPU": 1.0}) == 1  # never 0: Tune waits for the autoscaler


def test_scheduler_and_param_space():
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search.sample import Float

    sweep = SweepConfig.model_validate({
        "space": {"learner.lr": {"loguniform": [1e-6, 1e-4]}, "algo.kl_coef": {"grid": [0.0, 0.04]},
                  "rollout.temperature": {"uniform": [0.6, 1.0]}, "algo.kl_estimator": {"choice": ["k1", "k3"]}},
        "scheduler": {"name": "asha", "grace_period_steps": 2, "reduction_factor": 3},
    })
    asha = make_scheduler(sweep, max_steps=19)
    assert isinstance(asha, ASHAScheduler)
    # rungs at 2, 6, 18 steps: grace period x reduction factor^k, all before the last step (19)
    assert sorted(milestone for milestone, _ in asha._brackets[0]._rungs) == [2, 6, 18]
    assert asha._max_t == 18 and not asha._stop_last_trials
    space = param_space(sweep)
    assert space["algo.kl_coef"] == {"grid_search": [0.0, 0.04]}
    lr = space["learner.lr"]
    assert isinstance(lr, Float) and (lr.lower, lr.upper) == (1e-6, 1e-4) and type(lr.sampler).__name__ == "_LogUniform"
    assert space["algo.kl_estimator"].categories == ["k1", "k3"]
    fifo = SweepConfig.model_validate({"space": {"learner.lr": {"grid": [1e-5]}}, "scheduler": {"name": "fifo"}})
    assert isinstance(make_scheduler(fifo, max_steps=3), FIFOScheduler)


def test_step_reporter_hands_metrics_over_and_waits_for_the_ack(list_queue):
    results, acks = list_queue(), list_queue([True])
    reporter = TuneStepReporter(results, acks)
    assert reporter(StepEnd(3, 10, {"reward/mean": 0.5, "algo/kl": 0.01})) is None  # never asks to stop
    assert results == [({"step": 3, "reward/mean": 0.5, "algo/kl": 0.01}, None)]  # no snapshot at this step
    assert acks == []  # it consumed the trial function's ack
    with pytest.raises(IndexError):  # no ack: it would wait (here: the list is empty)
        reporter(StepEnd(4, 10, {}))


def test_trial_run_closer_ends_runs_the_way_tune_ended_the_trials(tmp_path):
    from types import SimpleNamespace

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    parent = Tracker(uri, "cb", run_name="parent")
    runs = {}
    for trial_id, name in [("t_0", "stopped"), ("t_1", "done"), ("t_2", "crashed"), ("t_3", "failed-then-stopped")]:
        runs[name] = Tracker(uri, "cb", run_name=name)
        runs[name].set_tags({"mlflow.parentRunId": parent.run_id, "rlray.tune_trial_id": trial_id})
    runs["done"].finish("FINISHED")
    runs["failed-then-stopped"].finish("FAILED")  # the dying learner raised before its process was killed
    closer = TrialRunCloser(uri, "cb")
    closer.on_trial_complete(0, [], SimpleNamespace(trial_id="t_0"))  # stopped by ASHA: left RUNNING
    closer.on_trial_complete(0, [], SimpleNamespace(trial_id="t_1"))  # finished on its own
    closer.on_trial_error(0, [], SimpleNamespace(trial_id="t_2"))
    closer.on_trial_complete(0, [], SimpleNamespace(trial_id="t_3"))
    status = {name: get_run(uri, t.run_id).info.status for name, t in runs.items()}
    assert status == {"stopped": "KILLED", "done": "FINISHED", "crashed": "FAILED", "failed-then-stopped": "KILLED"}
    assert get_run(uri, runs["stopped"].run_id).data.tags["rlray.stop_reason"] == "stopped early by the Tune scheduler"
    assert get_run(uri, runs["crashed"].run_id).data.tags["rlray.stop_reason"] == "trial failed"
    assert "rlray.stop_reason" not in get_run(uri, runs["done"].run_id).data.tags
    # a late write from a dying trial process is undone by the final pass after Tuner.fit
    Tracker(uri, "cb", run_id=runs["stopped"].run_id).finish("FAILED")
    closer.reconcile()
    assert get_run(uri, runs["stopped"].run_id).info.status == "KILLED"
    assert [r.info.run_id for r in child_runs(uri, parent_run_id=parent.run_id)] == [t.run_id for t in runs.values()]
