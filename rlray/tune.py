"""Hyperparameter sweeps: Ray Tune over any dotted config key, each trial a whole ``rlray train`` run.

``rlray sweep CONFIG SWEEP.yaml`` loads the experiment config and a sweep file (its own schema,
``rlray.sweep.SweepConfig``), opens one MLflow parent run, and runs a Tune function trainable per trial. A
trial applies its sampled values as dotted overrides and calls ``driver.run_training`` (the same
rollout actors, Ray Train learner and MLflow logging as ``rlray train``), with its MLflow run tagged
``mlflow.parentRunId``. Rank 0 of the trial's learner puts each step's metrics on a Ray queue (a
per-step hook, ``rlray.hooks``) and the trial function relays them with ``tune.report``, so ASHA
sees one result per RL step (``training_iteration`` == step) and decides before the next step.

Resources: a trial's rollout actors and learner workers take ``resources.*`` from the config, as
in ``rlray train``; Tune itself reserves only ``trial_driver_cpus`` for the trial function (Ray
Train V2 places its workers outside Tune's placement group). Trials run concurrently as far as the
cluster's resources divided by one trial's demand allow, or ``max_concurrent_trials``.

PBT is accepted by the schema (``scheduler.name: pbt`` and its fields) and refused at start: it
needs each trial to write periodic snapshots and to start from another trial's snapshot (see
``pbt_unavailable_reason``).
"""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any

import yaml
from ray import tune as ray_tune

from rlray.config import Config, config_from_dict
from rlray.hooks import StepEnd
from rlray.sweep import SweepConfig, SweepError, check_sweep
from rlray.tracking import Tracker, child_runs

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Tune wiring
# --------------------------------------------------------------------------------------------
def param_space(sweep: SweepConfig) -> dict[str, Any]:
    """Returns Tune's param_space: {dotted key: tune.grid_search | choice | uniform | loguniform}."""
    from ray import tune

    make = {"grid": tune.grid_search, "choice": tune.choice}
    out = {}
    for key, space in sweep.space.items():
        if space.kind in make:
            out[key] = make[space.kind](list(getattr(space, space.kind)))
        else:
            out[key] = getattr(tune, space.kind)(*getattr(space, space.kind))
    return out


def pbt_unavailable_reason() -> str:
    """Returns why PBT cannot run in this build: what the trials lack."""
    return (
        "scheduler.name='pbt' exploits by restarting a trial from another trial's snapshot, and rlray "
        "trials cannot do that yet: the loop writes only the end-of-run snapshot, run_training cannot "
        "resume from one, and the per-step hook event carries no snapshot URI to report to Tune. Use "
        "scheduler.name='asha' or 'fifo'"
    )


def make_scheduler(sweep: SweepConfig, max_steps: int) -> Any:
    """Returns the Tune scheduler of the sweep (time in RL steps, capped at ``max_steps``).

    Raises:
        SweepError: ``scheduler.name='pbt'`` (see ``pbt_unavailable_reason``).
    """
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    s = sweep.scheduler
    if s.name == "pbt":
        raise SweepError(pbt_unavailable_reason())
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
    from rlray.placement import role_requests

    demand = {"CPU": driver_cpus, "GPU": 0.0}
    for request in role_requests(cfg):
        for key, value in request.total().items():
            if key in demand:
                demand[key] += value
    return demand


def concurrent_trials(demand: dict[str, float], cluster: dict[str, float]) -> int:
    """Returns how many trials of ``demand`` fit in ``cluster`` resources at once (at least 1)."""
    fits = [math.floor(cluster.get(k, 0.0) / v + 1e-9) for k, v in demand.items() if v > 0]
    return max(1, min(fits, default=1))


class TuneStepReporter:
    """Per-step hook (rank 0): hands the step's metrics to the trial function and waits for Tune.

    It puts ``{"step": n, **metrics}`` on ``results`` and blocks on ``acks`` until the trial
    function's ``tune.report`` returned, that is until the scheduler let the trial go on. A trial
    the scheduler stops therefore never starts another step. It never asks the run to stop.

    Args:
        results: ``ray.util.queue.Queue`` the trial function reads.
        acks: ``ray.util.queue.Queue`` the trial function puts one item on per relayed result.
    """

    def __init__(self, results: Any, acks: Any) -> None:
        self.results = results
        self.acks = acks

    def __call__(self, event: StepEnd) -> None:
        self.results.put({"step": event.step, **event.metrics})
        self.acks.get()
        return None


def trial_config(base: dict[str, Any], params: dict[str, Any], trial_id: str) -> Config:
    """Returns the config of one trial: ``base`` with the sampled ``params``, its own output folder (and so
    its own snapshot folder) and a free monitor port.

    Raises:
        ConfigError: a sampled value is invalid (``check_sweep`` catches this before any trial).
    """
    overrides = [f"{k}={json.dumps(v)}" for k, v in sorted(params.items())]
    name = ",".join(f"{k.rsplit('.', 1)[-1]}={v:.3g}" if isinstance(v, float) else f"{k.rsplit('.', 1)[-1]}={v}"
                    for k, v in sorted(params.items()))
    overrides += [f"run.output_dir={base['run']['output_dir']}/trials/{trial_id}", f"run.name={json.dumps(name)}",
                  "monitor.port=0"]  # trials run side by side: each /health on a free port (tagged on its run)
    return config_from_dict(base, overrides)


def run_trial(params: dict[str, Any], *, base: dict[str, Any], parent_run_id: str) -> None:
    """The Tune function trainable: runs one ``rlray train`` and relays its per-step metrics to Tune.

    ``run_training`` runs in a helper thread; this thread (Tune's) reads the queue that rank 0 of
    the learner fills after each step and calls ``tune.report``, so ASHA can stop the trial
    between steps.

    Raises:
        BaseException: whatever the run raised (Tune records the trial as errored).
    """
    from ray import tune
    from ray.util.queue import Queue

    from rlray.driver import run_training

    trial_id = tune.get_context().get_trial_id()
    cfg = trial_config(base, params, trial_id)
    results, acks = (Queue(actor_options={"num_cpus": 0}) for _ in range(2))
    outcome: dict[str, BaseException] = {}

    def fit() -> None:
        try:
            run_training(
                cfg,
                step_hooks=[TuneStepReporter(results, acks)],
                tags={"mlflow.parentRunId": parent_run_id, "rlray.tune_trial_id": trial_id},
            )
        except BaseException as err:  # re-raised in Tune's thread below
            outcome["error"] = err
        finally:
            results.put(None)

    thread = threading.Thread(target=fit, name=f"rlray-trial-{trial_id}", daemon=True)
    thread.start()
    while (result := results.get()) is not None:
        tune.report(result)  # returns once the scheduler lets the trial continue
        acks.put(True)
    thread.join()
    if "error" in outcome:
        raise outcome["error"]


# --------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------
@dataclass
class TrialSummary:
    """One trial as MLflow recorded it: its child run, swept values, status and the sweep metric."""

    trial_id: str
    run_id: str
    params: dict[str, str]
    status: str
    steps: int
    metric: float | None


@dataclass
class SweepResult:
    """Outcome of a sweep: the parent run, the best child run (by the last metric value) and all trials."""

    parent_run_id: str
    tracking_uri: str
    status: str
    best_run_id: str | None
    trials: list[TrialSummary]


class TrialRunCloser(ray_tune.Callback):
    """Tune callback (sweep driver): ends the MLflow run of each trial the way Tune ended the trial.

    A trial that the scheduler stops is killed with its process, so its run is left RUNNING (or
    FAILED, when the dying learner raised first). ``on_trial_complete`` closes it at once as KILLED
    with ``rlray.stop_reason``; ``on_trial_error`` as FAILED. ``reconcile`` repeats this after
    ``Tuner.fit`` returns, when no trial process can write any more, so the final statuses hold.
    A run that finished by itself (FINISHED) is never touched.

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
            if run.info.status not in ("FINISHED", status):
                tracker = Tracker(self.uri, self.experiment, run_id=run.info.run_id)
                tracker.set_tags({"rlray.stop_reason": reason})
                tracker.finish(status)

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
    from rlray.tracking import get_run_metrics

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
        SweepError: the sweep does not fit the config (``check_sweep``) or asks for PBT.
    """
    import ray
    from ray import tune
    from ray.tune.search import BasicVariantGenerator

    from rlray.driver import init_ray, resolve_paths

    check_sweep(sweep, cfg)
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
