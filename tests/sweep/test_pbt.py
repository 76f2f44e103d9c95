"""Population based training on rlray's snapshots: a real 2-trial PBT sweep with one exploit, and its pieces."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlray.checkpoint import lineage
from rlray.checkpoint import storage as checkpoint
from rlray.config import load_config
from rlray.observe.tracking import Tracker, child_runs, get_run, get_run_metrics
from rlray.run.hooks import StepEnd, is_observer, run_hooks, run_observers
from rlray.sweep.pbt import ClipToSpace, SnapshotPBT, hyperparam_mutations, pbt_base_config, read_pointer, write_pointer
from rlray.sweep.reporter import TuneStepReporter
from rlray.sweep.spec import SweepConfig, SweepError, check_sweep
from rlray.sweep.tune import TrialRunCloser, close_replaced_runs, make_scheduler, trial_config

REPO = Path(__file__).resolve().parents[2]
# With seed 0, Tune draws learner.lr = 1.879e-4 for trial 0 and 3.464e-5 for trial 1 (asserted below).
PBT_SWEEP = {
    "metric": "learner/lr", "mode": "max", "space": {"learner.lr": {"loguniform": [1e-5, 1e-3]}}, "num_samples": 2,
    "scheduler": {"name": "pbt", "perturbation_interval_steps": 2, "quantile_fraction": 0.5, "resample_probability": 0.0},
    "max_concurrent_trials": 1, "seed": 0,
}


@pytest.fixture(scope="module")
def pbt_sweep(ray_session, tmp_path_factory, gsm8k_dir, tiny_model_path):
    """Runs a 2-trial PBT sweep (3 steps each, perturbation every 2 steps, tiny-random); returns (result, uri).

    The outcome is known in advance. Trials run one at a time. PBT ranks by learner/lr (mode max), so
    trial 1 (lr 3.5e-5) is worse than trial 0 (lr 1.9e-4) at its perturbation time (step 2): it is
    stopped and restarted from trial 0's step-2 snapshot with trial 0's lr x0.8 or x1.2 (resampling
    off), and runs step 3 in a new child run. Step 3, the last, is never a perturbation time.
    """
    from rlray.sweep.tune import run_sweep

    folder = tmp_path_factory.mktemp("pbt")
    uri = f"sqlite:///{folder}/mlflow.db"
    cfg = load_config(
        REPO / "configs/grpo_gsm8k_tiny.yaml",
        [f"run.output_dir={folder}/out", f"tracking.mlflow_uri={uri}", f"data.train_files=[{gsm8k_dir}/train.jsonl]",
         "run.max_steps=3", "eval.num_problems=0", "rollout.backend=hf", "run.name=pbt", "tracking.experiment=pbt",
         "checkpoint.every_steps=1000"],  # the sweep sets it to the perturbation interval
    )
    return run_sweep(cfg, SweepConfig.model_validate(PBT_SWEEP)), uri


def _lr(run) -> float:
    return float(run.data.params["learner.lr"])


@pytest.mark.ray
@pytest.mark.slow  # 283 s on the 2-core CI machine (a real 4-trial PBT sweep); the scheduler's logic is unit-tested below
def test_pbt_sweep_exploits_the_better_trials_snapshot(pbt_sweep):
    result, uri = pbt_sweep
    assert result.status == "FINISHED"
    parent = get_run(uri, result.parent_run_id)
    assert parent.data.tags["rlray.sweep.scheduler"] == "pbt" and parent.data.params["checkpoint.every_steps"] == "2"
    runs = child_runs(uri, parent_run_id=result.parent_run_id)
    assert len(runs) == 3 == len(result.trials)  # trial 0, trial 1 before and after its exploit
    first, worse, exploited = runs
    assert _lr(first) == pytest.approx(1.8789852661499492e-4) and _lr(worse) == pytest.approx(3.463964459891803e-05)
    better_id, worse_id = first.data.tags["rlray.tune_trial_id"], worse.data.tags["rlray.tune_trial_id"]
    assert exploited.data.tags["rlray.tune_trial_id"] == worse_id != better_id
    # trial 0 ran its 3 steps; its step-2 snapshot is what trial 1 copied
    assert first.info.status == "FINISHED"
    assert [s for s, _ in get_run_metrics(uri, first.info.run_id)["learner/lr"]] == [1, 2, 3]
    source = f"{first.data.tags['rlray.snapshot_dir']}/step_00000002"
    manifest = checkpoint.read_manifest(source)
    assert (manifest.step, manifest.run_id) == (2, first.info.run_id)
    # trial 1 ran to its perturbation time, then its run was closed: the exploit replaced it
    assert worse.info.status == "KILLED"
    assert worse.data.tags["rlray.stop_reason"] == f"PBT exploit: restarted from trial {better_id}'s snapshot at step 2"
    assert worse.data.tags["rlray.replaced_by_snapshot"] == source
    assert [s for s, _ in get_run_metrics(uri, worse.info.run_id)["learner/lr"]][:2] == [1, 2]
    # its new run resumed from trial 0's step-2 snapshot, with trial 0's lr explored (x0.8 or x1.2)
    tags = exploited.data.tags
    assert tags["rlray.resumed_from"] == tags["rlray.restored_from"] == source
    assert tags["rlray.tune_source_trial_id"] == better_id and tags["rlray.replaces_runs"] == worse.info.run_id
    assert exploited.info.status == "FINISHED"
    mutated = _lr(exploited)
    assert any(math.isclose(mutated, _lr(first) * f, rel_tol=1e-9) for f in (0.8, 1.2)), mutated
    metrics = get_run_metrics(uri, exploited.info.run_id)
    assert metrics["run/restored_step"] == [(2, 2.0)]
    assert metrics["learner/lr"] == [(3, pytest.approx(mutated))]  # the mutated value won
    # lineage: the exploited run's snapshots continue the version chain of trial 0's step-2 snapshot
    final = checkpoint.read_manifest(exploited.data.tags["rlray.last_snapshot"])
    assert (final.step, final.run_id, final.kind) == (3, exploited.info.run_id, "final")
    assert final.parent_version == lineage.version_of(uri, "pbt", source)
    assert final.data_cursor["epoch"] == manifest.data_cursor["epoch"]
    # the summary says which run came from which trial's snapshot; the best is the highest lr at the end
    summary = {t.run_id: t for t in result.trials}
    assert (summary[exploited.info.run_id].source_trial_id, summary[exploited.info.run_id].resumed_from) == (better_id, source)
    assert summary[first.info.run_id].source_trial_id == "" and summary[first.info.run_id].steps == 3
    best = first if _lr(first) > mutated else exploited
    assert result.best_run_id == best.info.run_id


# --------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------
def _cfg(tmp_path, *overrides):
    return load_config(REPO / "configs/grpo_gsm8k_tiny.yaml", [f"run.output_dir={tmp_path}", *overrides])


def test_make_scheduler_builds_snapshot_pbt_from_the_sweep():
    sweep = SweepConfig.model_validate({
        "space": {"learner.lr": {"loguniform": [1e-6, 1e-4]}, "rollout.temperature": {"uniform": [0.6, 1.0]},
                  "algo.kl_estimator": {"choice": ["k1", "k2", "k3"]}},
        "scheduler": {"name": "pbt", "perturbation_interval_steps": 4, "quantile_fraction": 0.25, "resample_probability": 0.1},
    })
    pbt = make_scheduler(sweep, max_steps=20)
    assert isinstance(pbt, SnapshotPBT)
    assert (pbt._time_attr, pbt._perturbation_interval, pbt._quantile_fraction, pbt._resample_probability) == ("step", 4, 0.25, 0.1)
    assert pbt.last_step == 20 and not pbt._synch
    mutations = hyperparam_mutations(sweep)
    assert mutations["algo.kl_estimator"] == ["k1", "k2", "k3"]  # explored by a shift to a neighbour
    lr = mutations["learner.lr"]
    assert (lr.lower, lr.upper, type(lr.sampler).__name__) == (1e-6, 1e-4, "_LogUniform")
    # explored values stay inside their bounds (both validated by check_sweep)
    assert pbt._custom_explore_fn({"learner.lr": 1.2e-4, "rollout.temperature": 0.48, "algo.kl_estimator": "k2"}) == {
        "learner.lr": 1e-4, "rollout.temperature": 0.6, "algo.kl_estimator": "k2"}
    assert ClipToSpace({"x": (0.0, 1.0)})({"x": 0.5, "y": 7}) == {"x": 0.5, "y": 7}


class _Controller:
    """The parts of Tune's controller that PBT calls (its saves, the trials, and a pause)."""

    def __init__(self, trials):
        self.trials, self.saves, self.paused = trials, [], []

    def get_trials(self):
        return self.trials

    def _schedule_trial_save(self, trial, result=None):
        self.saves.append(trial.trial_id)
        return SimpleNamespace(checkpoint=f"pointer-{trial.trial_id}-{result['step']}")  # stands in for a Tune checkpoint


def _trial(trial_id: str, status: str = "RUNNING"):
    from ray.tune.experiment import Trial

    t = Trial("run_trial", trial_id=trial_id, config={"learner.lr": 1e-5}, stub=True)
    t.status = status
    return t


def _pbt(last_step=6, interval=2) -> SnapshotPBT:
    pbt = SnapshotPBT(last_step=last_step, time_attr="step", perturbation_interval=interval, quantile_fraction=0.5,
                      resample_probability=0.0, hyperparam_mutations={"learner.lr": [1e-5, 1e-4]}, metric="m", mode="max")
    return pbt


def test_every_trial_is_checkpointed_and_the_worse_copies_the_better_whatever_came_first(monkeypatch):
    from ray.tune.schedulers.pbt import _PBTTrialState

    for order in (("a", "b"), ("b", "a")):
        pbt = _pbt()
        a, b = _trial("a"), _trial("b")
        controller = _Controller([a, b])
        for t in (a, b):
            pbt._trial_state[t] = _PBTTrialState(t)
        exploits = []
        monkeypatch.setattr(pbt, "_exploit", lambda ctl, trial, clone, seen=exploits: seen.append((trial.trial_id, clone.trial_id)))
        score = {"a": 2.0, "b": 1.0}
        trials = {"a": a, "b": b}
        for name in order:
            assert pbt.on_trial_result(controller, trials[name], {"step": 2, "m": score[name]}) == "CONTINUE"
        assert sorted(controller.saves) == ["a", "b"]  # every trial's step-2 pointer was recorded
        # b is worse: when it reports second it copies a at once; when it reported first nobody could be
        # ranked yet, and it copies a at its next perturbation time
        if order == ("a", "b"):
            assert exploits == [("b", "a")]
        else:
            assert exploits == []
            pbt.on_trial_result(controller, b, {"step": 4, "m": 1.0})
            assert exploits == [("b", "a")]


def test_finished_trials_stay_in_the_population_and_the_last_step_never_perturbs(monkeypatch):
    from ray.tune.schedulers.pbt import _PBTTrialState

    pbt = _pbt(last_step=4)
    a = _trial("a")
    controller = _Controller([a])
    pbt._trial_state[a] = _PBTTrialState(a)
    assert pbt.on_trial_result(controller, a, {"step": 2, "m": 2.0}) == "CONTINUE"
    assert pbt.on_trial_result(controller, a, {"step": 4, "m": 9.0}) == "CONTINUE"
    assert pbt._trial_state[a].last_score == 2.0 and controller.saves == ["a"]  # step 4 (the last) changed nothing
    a.status = "TERMINATED"
    b = _trial("b")
    pbt._trial_state[b] = _PBTTrialState(b)
    controller.trials.append(b)
    exploits = []
    monkeypatch.setattr(pbt, "_exploit", lambda ctl, trial, clone: exploits.append((trial.trial_id, clone.trial_id)))
    pbt.on_trial_result(controller, b, {"step": 2, "m": 1.0})
    assert exploits == [("b", "a")]  # one trial at a time: b still copies the finished a
    assert pbt._quantiles() == ([b], [a])
    a.status = "ERROR"
    assert pbt._quantiles() == ([], [])  # an errored trial is no model to copy


def test_a_trial_is_not_paused_for_a_waiting_trial():
    from ray.tune.schedulers.pbt import _PBTTrialState

    pbt = _pbt()
    a, waiting = _trial("a"), _trial("w", status="PENDING")
    pbt._trial_state[a] = _PBTTrialState(a)
    # Ray's PBT pauses a trial at its perturbation time while another waits; rlray keeps it running
    assert pbt.on_trial_result(_Controller([a, waiting]), a, {"step": 2, "m": 1.0}) == "CONTINUE"


def test_pointer_round_trip(tmp_path):
    from ray.tune import Checkpoint

    folder = write_pointer(tmp_path / "p", snapshot="s3://b/run-x/step_00000004", step=4, trial_id="t_00001")
    assert read_pointer(Checkpoint.from_directory(str(folder))) == {
        "snapshot": "s3://b/run-x/step_00000004", "step": 4, "trial_id": "t_00001"}
    (tmp_path / "empty").mkdir()
    assert read_pointer(Checkpoint.from_directory(str(tmp_path / "empty"))) is None
    assert read_pointer(None) is None


def test_step_reporter_is_an_observer_that_hands_over_the_snapshot(list_queue):
    results, acks = list_queue(), list_queue([True])
    reporter = TuneStepReporter(results, acks)
    assert is_observer(reporter)
    calls = []

    def control(event):
        calls.append(("control", event.snapshot))
        return "stop please"

    hooks = [control, reporter]
    assert run_hooks(hooks, StepEnd(3, 10, {"reward/mean": 0.5})) == "stop please"  # the reporter is not run here
    assert results == [] and calls == [("control", None)]
    run_observers(hooks, StepEnd(3, 10, {"reward/mean": 0.5}, snapshot="/s/run-x/step_00000003"))
    assert results == [({"step": 3, "reward/mean": 0.5}, "/s/run-x/step_00000003")] and acks == []
    assert calls == [("control", None)]  # control hooks are not observers


def test_check_sweep_refuses_pbt_that_cannot_work(tmp_path):
    base = _cfg(tmp_path, "run.max_steps=4")
    pbt = {"space": {"learner.lr": {"loguniform": [1e-6, 1e-4]}}, "scheduler": {"name": "pbt", "perturbation_interval_steps": 2}}
    check_sweep(SweepConfig.model_validate(pbt), base)
    late = {**pbt, "scheduler": {"name": "pbt", "perturbation_interval_steps": 4}}
    with pytest.raises(SweepError, match=r"perturbation_interval_steps=4 must be below run.max_steps=4"):
        check_sweep(SweepConfig.model_validate(late), base)
    with pytest.raises(SweepError, match=r"checkpoint.keep_last=1: .*set checkpoint.keep_last>=2"):
        check_sweep(SweepConfig.model_validate(pbt), _cfg(tmp_path, "run.max_steps=4", "checkpoint.keep_last=1"))
    # trials snapshot exactly at the perturbation times
    assert pbt_base_config(base, SweepConfig.model_validate(pbt)).checkpoint.every_steps == 2


def test_trial_config_resumes_from_the_pointed_snapshot(tmp_path):
    base = _cfg(tmp_path).model_dump(mode="json")
    cfg = trial_config(base, {"learner.lr": 2e-5}, "t_00001", resume_from="/snaps/run-a/step_00000002")
    assert cfg.checkpoint.resume_from == "/snaps/run-a/step_00000002" and cfg.learner.lr == 2e-5
    assert trial_config(base, {"learner.lr": 2e-5}, "t_00001").checkpoint.resume_from is None


def test_restart_closes_the_replaced_run_and_the_closer_keeps_its_reason(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = _cfg(tmp_path, f"tracking.mlflow_uri={uri}", "tracking.experiment=pbt")
    parent = Tracker(uri, "pbt", run_name="parent")
    old = Tracker(uri, "pbt", run_name="before")
    old.set_tags({"mlflow.parentRunId": parent.run_id, "rlray.tune_trial_id": "t_1"})
    pointer = {"snapshot": "/snaps/run-a/step_00000002", "step": 2, "trial_id": "t_0"}
    assert close_replaced_runs(cfg, parent.run_id, "t_1", pointer) == [old.run_id]
    run = get_run(uri, old.run_id)
    assert run.info.status == "KILLED" and run.data.tags["rlray.replaced_by_snapshot"] == pointer["snapshot"]
    assert run.data.tags["rlray.stop_reason"] == "PBT exploit: restarted from trial t_0's snapshot at step 2"
    assert close_replaced_runs(cfg, parent.run_id, "t_1", pointer) == []  # already closed
    # the dying process wrote FAILED late; at the end of the sweep the run is KILLED again, reason kept
    Tracker(uri, "pbt", run_id=old.run_id).finish("FAILED")
    closer = TrialRunCloser(uri, "pbt")
    closer.on_trial_error(0, [], SimpleNamespace(trial_id="t_1"))
    run = get_run(uri, old.run_id)
    assert run.info.status == "KILLED" and run.data.tags["rlray.stop_reason"].startswith("PBT exploit")
