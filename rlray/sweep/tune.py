"""Hyperparameter sweeps: Ray Tune over any dotted config key, each trial a whole ``rlray train`` run.

``rlray sweep CONFIG SWEEP.yaml`` loads the experiment config and a sweep file (its own schema,
``rlray.sweep.SweepConfig``), opens one MLflow parent run, and runs a Tune function trainable per trial. A
trial applies its sampled values as dotted overrides and calls ``driver.run_training`` (the same
rollout actors, Ray Train learner and MLflow logging as ``rlray train``), with its MLflow run tagged
``mlflow.parentRunId``. Rank 0 of the trial's learner puts each step's metrics on a Ray queue (a
per-step hook, ``rlray.run.hooks``) and the trial function relays them with ``tune.report``, so ASHA
sees one result per RL step (``training_iteration`` == step) and decides before the next step.

Resources: a trial's rollout actors and learner workers take ``resources.*`` from the config, as
in ``rlray train``; Tune itself reserves only ``trial_driver_cpus`` for the trial function (Ray
Train V2 places its workers outside Tune's placement group). Trials run concurrently as far as the
cluster's resources divided by one trial's demand allow, or ``max_concurrent_trials``.

Snapshots: the reporter is an observer hook (it runs after the step's snapshot), and each snapshot
a trial writes is reported to Tune as a pointer checkpoint (``rlray.sweep.pbt``: a ``snapshot.json`` naming
the snapshot URI). A trial that Tune (re)starts with a checkpoint, a PBT exploit above all, runs with
``checkpoint.resume_from`` set to the snapshot it names, in a new MLflow child run; the run it
replaces is closed as KILLED. PBT itself: ``rlray.sweep.pbt``.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import ray
import yaml
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search import BasicVariantGenerator
from ray.util.queue import Queue

from rlray.config import Config, config_from_dict
from rlray.launch.driver import init_ray, resolve_paths, run_training
from rlray.launch.judges import judge_apps
from rlray.launch.placement import role_requests
from rlray.observe.tracking import Tracker, child_runs, get_run_metrics
from rlray.plan import resolve_plan
from rlray.sweep.pbt import make_pbt, pbt_base_config, read_pointer, write_pointer
from rlray.sweep.reporter import TuneStepReporter  # noqa: F401 - re-exported (rlray.sweep.tune.TuneStepReporter)
from rlray.sweep.spec import SweepConfig, check_sweep

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Tune wiring
# --------------------------------------------------------------------------------------------
def param_space(sweep: SweepConfig) -> dict[str, Any]:
    """Returns Tune's param_space: {dotted key: tune.grid_search | choice | uniform | loguniform}."""

    make = {"grid": tune.grid_search, "choice": tune.choice}
    out = {}
    for key, space in sweep.space.items():
        if space.kind in make:
            out[key] = make[space.kind](list(getattr(space, space.kind)))
        else:
            out[key] = getattr(tune, space.kind)(*getattr(space, space.kind))
    return out


def make_scheduler(sweep: SweepConfig, max_steps: int) -> Any:
    """Returns the Tune scheduler of the sweep (time in RL steps, capped at ``max_steps``): FIFO, ASHA, or
    ``rlray.sweep.pbt.SnapshotPBT``."""


    s = sweep.scheduler
    if s.name == "pbt":
        return make_pbt(sweep, max_steps)
    if s.name == "fifo":
        return FIFOScheduler()
    # Rungs lie before the last step (max_t = max_steps - 1, no stop at max_t): a trial that reaches
    # its last step always ends by itself, with its final snapshot and MLflow status FINISHED.
    return ASHAScheduler(
        time_attr="training_iteration",
        max_t=max_steps - 1,
        grace_period=s.grace_period_steps,
        reduction_factor=s.reduction_factor,
        stop_last_trials=False,
    )


def trial_demand(cfg: Config, driver_cpus: float) -> dict[str, float]:
    """Returns one trial's Ray resources: its driver plus every role's request (``placement.role_requests``:
    rollout actors, learner workers, and the reward replicas and reference actor when configured)."""

    demand = {"CPU": driver_cpus, "GPU": 0.0}
    for request in role_requests(resolve_plan(cfg)):
        for key, value in request.total().items():
            if key in demand:
                demand[key] += value
    return demand


def concurrent_trials(demand: dict[str, float], cluster: dict[str, float]) -> int:
    """Returns how many trials of ``demand`` fit in ``cluster`` resources at once (at least 1)."""
    fits = [math.floor(cluster.get(k, 0.0) / v + 1e-9) for k, v in demand.items() if v > 0]
    return max(1, min(fits, default=1))


def trial_config(base: dict[str, Any], params: dict[str, Any], trial_id: str, resume_from: str | None = None) -> Config:
    """Returns the config of one trial: ``base`` with the sampled ``params``, its own output folder (and so
    its own snapshot folder), a free monitor port, and ``checkpoint.resume_from`` when it starts from a
    snapshot (Tune's checkpoint: a PBT exploit or a restart).

    Raises:
        ConfigError: a sampled value is invalid (``check_sweep`` catches this before any trial).
    """
    overrides = [f"{k}={json.dumps(v)}" for k, v in sorted(params.items())]
    name = ",".join(f"{k.rsplit('.', 1)[-1]}={v:.3g}" if isinstance(v, float) else f"{k.rsplit('.', 1)[-1]}={v}"
                    for k, v in sorted(params.items()))
    overrides += [f"run.output_dir={base['run']['output_dir']}/trials/{trial_id}", f"run.name={json.dumps(name)}",
                  "monitor.port=0"]  # trials run side by side: each /health on a free port (tagged on its run)
    if resume_from:
        overrides.append(f"checkpoint.resume_from={json.dumps(resume_from)}")
    return config_from_dict(base, overrides)


def close_replaced_runs(cfg: Config, parent_run_id: str, trial_id: str, pointer: dict[str, Any]) -> list[str]:
    """Closes the unfinished MLflow runs of a trial that Tune restarted from ``pointer``'s snapshot as KILLED
    (tags ``rlray.stop_reason`` and ``rlray.replaced_by_snapshot``); returns their run ids.

    The run a PBT exploit (or a Tune restart) replaces was left RUNNING when Tune stopped its process.
    """
    source = pointer["trial_id"]
    reason = (f"PBT exploit: restarted from trial {source}'s snapshot at step {pointer['step']}" if source != trial_id
              else f"restarted by Tune from the trial's snapshot at step {pointer['step']}")
    closed = []
    for run in child_runs(cfg.tracking.mlflow_uri, parent_run_id=parent_run_id, trial_id=trial_id):
        if run.info.status not in ("FINISHED", "KILLED"):
            tracker = Tracker(cfg.tracking.mlflow_uri, cfg.tracking.experiment, run_id=run.info.run_id)
            tracker.set_tags({"rlray.stop_reason": reason, "rlray.replaced_by_snapshot": pointer["snapshot"]})
            tracker.finish("KILLED")
            closed.append(run.info.run_id)
    return closed


def _report(result: dict[str, Any], snapshot: str | None, trial_id: str) -> None:
    """Relays one step to Tune, with a pointer checkpoint to ``snapshot`` when one was written."""



    if snapshot is None:
        tune.report(result)
        return
    with tempfile.TemporaryDirectory(prefix="rlray-pointer-") as tmp:
        write_pointer(tmp, snapshot=snapshot, step=result["step"], trial_id=trial_id)
        tune.report(result, checkpoint=tune.Checkpoint.from_directory(tmp))  # Tune copies the folder


def run_trial(params: dict[str, Any], *, base: dict[str, Any], parent_run_id: str) -> None:
    """The Tune function trainable: runs one ``rlray train`` and relays its per-step metrics to Tune.

    ``run_training`` runs in a helper thread; this thread (Tune's) reads the queue that rank 0 of
    the learner fills after each step and calls ``tune.report`` (with a pointer checkpoint on
    snapshot steps), so ASHA and PBT decide between steps. Started with a Tune checkpoint, the run
    resumes from the snapshot it points at (tag ``rlray.tune_source_trial_id``: the trial that wrote
    it), and the trial's earlier unfinished runs are closed as KILLED. The last step
    (``run.max_steps``) is reported only after the run ended: Tune may end a trial at any report, and
    ending it kills this process, which owns the run's actors (monitor, queues), before the run could
    write its final status.

    Raises:
        BaseException: whatever the run raised (Tune records the trial as errored).
    """


    trial_id = tune.get_context().get_trial_id()
    pointer = read_pointer(tune.get_checkpoint())
    cfg = trial_config(base, params, trial_id, resume_from=pointer["snapshot"] if pointer else None)
    tags = {"mlflow.parentRunId": parent_run_id, "rlray.tune_trial_id": trial_id}
    if pointer:
        replaced = close_replaced_runs(cfg, parent_run_id, trial_id, pointer)
        tags.update({"rlray.tune_source_trial_id": pointer["trial_id"], "rlray.replaces_runs": ",".join(replaced)})
    results, acks = (Queue(actor_options={"num_cpus": 0}) for _ in range(2))
    outcome: dict[str, BaseException] = {}

    def fit() -> None:
        try:
            run_training(cfg, step_hooks=[TuneStepReporter(results, acks)], tags=tags)
        except BaseException as err:  # re-raised in Tune's thread below
            outcome["error"] = err
        finally:
            results.put(None)

    thread = threading.Thread(target=fit, name=f"rlray-trial-{trial_id}", daemon=True)
    thread.start()
    last = None  # the last step's result, reported once the run ended (see the docstring)
    while (item := results.get()) is not None:
        if item[0]["step"] >= cfg.run.max_steps:
            last = item
        else:
            _report(*item, trial_id)  # returns once the scheduler lets the trial continue
        acks.put(True)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    if last is not None:
        _report(*last, trial_id)


# --------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------
@dataclass
class TrialSummary:
    """One child run of a trial as MLflow recorded it: swept values, status, steps logged, the last value of
    the sweep metric, and for a run that started from a snapshot (a PBT exploit) the trial that wrote
    it and its URI ("" otherwise)."""

    trial_id: str
    run_id: str
    params: dict[str, str]
    status: str
    steps: int
    metric: float | None
    source_trial_id: str = ""
    resumed_from: str = ""


@dataclass
class SweepResult:
    """Outcome of a sweep: the parent run, the best child run (by the last metric value) and all trials."""

    parent_run_id: str
    tracking_uri: str
    status: str
    best_run_id: str | None
    trials: list[TrialSummary]


class TrialRunCloser(tune.Callback):
    """Tune callback (sweep driver): ends the MLflow run of each trial the way Tune ended the trial.

    A trial that the scheduler stops is killed with its process, so its run is left RUNNING (or
    FAILED, when the dying learner raised first). ``on_trial_complete`` closes it at once as KILLED
    with ``rlray.stop_reason``; ``on_trial_error`` as FAILED. ``reconcile`` repeats this after
    ``Tuner.fit`` returns, when no trial process can write any more, so the final statuses hold.
    A run that finished by itself (FINISHED) is never touched; one that a restart of its trial replaced
    (a PBT exploit; tag ``rlray.replaced_by_snapshot``) stays KILLED with its own reason.

    Args:
        uri: MLflow tracking URI of the sweep.
        experiment: MLflow experiment of the sweep.
    """

    STOPPED = ("KILLED", "stopped early by the Tune scheduler")
    ERRORED = ("FAILED", "trial failed")

    def __init__(self, uri: str, experiment: str) -> None:
        self.uri, self.experiment = uri, experiment
        self.outcomes: dict[str, tuple[str, str]] = {}  # trial id -> (MLflow status, reason)

    def _close(self, trial_id: str) -> None:
        status, reason = self.outcomes[trial_id]
        for run in child_runs(self.uri, parent_run_id=None, trial_id=trial_id, experiment=self.experiment):
            replaced = "rlray.replaced_by_snapshot" in run.data.tags  # closed by the trial's restart (PBT)
            want = "KILLED" if replaced else status
            if run.info.status not in ("FINISHED", want):
                tracker = Tracker(self.uri, self.experiment, run_id=run.info.run_id)
                if not replaced:
                    tracker.set_tags({"rlray.stop_reason": reason})
                tracker.finish(want)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.outcomes[trial.trial_id] = self.STOPPED
        self._close(trial.trial_id)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.outcomes[trial.trial_id] = self.ERRORED
        self._close(trial.trial_id)

    def reconcile(self) -> None:
        """Closes every ended trial's run again (after ``Tuner.fit``: no trial process is left)."""
        for trial_id in self.outcomes:
            self._close(trial_id)


def summarize(uri: str, parent_run_id: str, sweep: SweepConfig) -> tuple[list[TrialSummary], str | None]:
    """Returns the trials of a sweep (from MLflow, oldest first) and the best child run id (None if none)."""

    trials = []
    for run in child_runs(uri, parent_run_id=parent_run_id):
        history = get_run_metrics(uri, run.info.run_id).get(sweep.metric, [])
        trials.append(
            TrialSummary(
                trial_id=run.data.tags.get("rlray.tune_trial_id", ""),
                run_id=run.info.run_id,
                params={k: run.data.params[k] for k in sweep.space if k in run.data.params},
                status=run.info.status,
                steps=len(history),
                metric=history[-1][1] if history else None,
                source_trial_id=run.data.tags.get("rlray.tune_source_trial_id", ""),
                resumed_from=run.data.tags.get("rlray.resumed_from", ""),
            )
        )
    scored = [t for t in trials if t.metric is not None and math.isfinite(t.metric)]
    sign = 1.0 if sweep.mode == "max" else -1.0
    best = max(scored, key=lambda t: sign * t.metric).run_id if scored else None
    return trials, best


def run_sweep(cfg: Config, sweep: SweepConfig) -> SweepResult:
    """Runs the sweep on the cluster in RAY_ADDRESS (or a local Ray) and returns its result.

    The MLflow parent run holds the base config as params, the sweep file as ``sweep/sweep.yaml``,
    ``sweep/trials.json`` at the end, and tags ``rlray.sweep.best_run_id`` / ``.best_value``.

    Raises:
        SweepError: the sweep does not fit the config (``check_sweep``).
    """


    check_sweep(sweep, cfg)
    if sweep.scheduler.name == "pbt":
        cfg = pbt_base_config(cfg, sweep)
    scheduler = make_scheduler(sweep, cfg.run.max_steps)
    init_ray()
    cfg = resolve_paths(cfg)
    uri, experiment = cfg.tracking.mlflow_uri, cfg.tracking.experiment
    parent = Tracker(uri, experiment, run_name=cfg.run.name or "sweep")
    parent.log_config(cfg)
    parent.log_text(yaml.safe_dump(sweep.model_dump(mode="json"), sort_keys=False), "sweep/sweep.yaml")
    parent.set_tags({"rlray.sweep.metric": sweep.metric, "rlray.sweep.mode": sweep.mode,
                     "rlray.sweep.scheduler": sweep.scheduler.name})
    demand = trial_demand(cfg, sweep.trial_driver_cpus)
    concurrency = sweep.max_concurrent_trials or concurrent_trials(demand, ray.cluster_resources())
    log.info("sweep %s: %s per trial, %d trial(s) at once", parent.run_id, demand, concurrency)
    closer = TrialRunCloser(uri, experiment)
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, base=cfg.dump_with_secrets(), parent_run_id=parent.run_id),
        {"CPU": sweep.trial_driver_cpus},
    )
    tuner = tune.Tuner(
        trainable,
        param_space=param_space(sweep),
        tune_config=tune.TuneConfig(
            metric=sweep.metric, mode=sweep.mode, scheduler=scheduler, num_samples=sweep.num_samples,
            search_alg=BasicVariantGenerator(random_state=sweep.seed, max_concurrent=concurrency),
        ),
        run_config=tune.RunConfig(
            name=f"sweep-{parent.run_id[:12]}", storage_path=f"{cfg.run.output_dir}/tune",
            callbacks=[closer], verbose=1,
        ),
    )
    status = "FAILED"
    try:
        with judge_apps(resolve_plan(cfg)):  # deployed once for every trial: a trial's run finds them up and leaves them up
            status = "FAILED" if tuner.fit().errors else "FINISHED"
    finally:
        closer.reconcile()
        trials, best = summarize(uri, parent.run_id, sweep)
        parent.log_text(json.dumps([t.__dict__ for t in trials], indent=2), "sweep/trials.json")
        if best:
            value = next(t.metric for t in trials if t.run_id == best)
            parent.set_tags({"rlray.sweep.best_run_id": best, "rlray.sweep.best_value": f"{value:.6g}"})
        parent.finish(status)
    return SweepResult(parent.run_id, uri, status, best, trials)
