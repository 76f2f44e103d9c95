"""Population based training on rlray's snapshots: the scheduler and the pointer checkpoints of trials.

A PBT sweep (``scheduler.name: pbt``) runs its trials like any sweep (``rlray.sweep.tune``), plus:

- every trial writes a snapshot at each perturbation time (``pbt_base_config`` sets
  ``checkpoint.every_steps`` to ``scheduler.perturbation_interval_steps``). The trial's reporter, an
  observer hook that runs after the step's snapshot, hands its URI to the trial function, which
  reports it to Tune as a *pointer checkpoint*: a folder holding ``snapshot.json`` (the snapshot URI,
  its step and the trial that wrote it). Tune copies only that file; the weights stay where the run
  wrote them.
- ``SnapshotPBT`` (Ray Tune's asynchronous PopulationBasedTraining; Jaderberg et al. 2017, "Population
  Based Training of Neural Networks", section 3) ranks trials by the sweep metric at each perturbation
  time. A trial in the bottom ``quantile_fraction`` *exploits* one of the top fraction: Tune stops it and
  restarts it with that trial's pointer and its hyperparameters *explored* (each value x0.8 or x1.2, a
  neighbour in a choice list, or with ``resample_probability`` a fresh draw from the sweep space).
  ``rlray.sweep.tune.run_trial`` reads the pointer (``tune.get_checkpoint``) and starts a new MLflow child run
  with ``checkpoint.resume_from`` set to the snapshot: weights, optimizer, scheduler, RNG, data cursor,
  step and policy version come from the better trial, the mutated values from the trial's new config
  (``rlray.run.session.plan_for_restore`` keeps them).

Where ``SnapshotPBT`` differs from Ray's PopulationBasedTraining, and why (an rlray trial is a whole
training run that takes minutes to restart):

- every trial's snapshot at a perturbation time can be exploited, not only the snapshots of trials that
  were in the top quantile when they reported (Ray checkpoints only those, so a trial that reaches a
  perturbation time before its peers can never be copied from it);
- finished trials stay in the population, so trials that run one after another (one fits the cluster
  at a time) still copy the best earlier trial;
- a trial is never paused to let a waiting trial run (the sweep starts no more trials than fit), and
  the last step (``run.max_steps``) is never a perturbation time: the run ends there anyway;
- explored values are clipped to the bounds of their uniform/loguniform space, which
  ``rlray.sweep.check_sweep`` validated.
"""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path
from typing import Any

from ray import tune
from ray.train._internal.session import _FutureTrainingResult
from ray.tune.experiment import Trial
from ray.tune.schedulers import PopulationBasedTraining, TrialScheduler

from rlray.config import Config, config_from_dict
from rlray.sweep.spec import SweepConfig

log = logging.getLogger(__name__)

POINTER_FILE = "snapshot.json"
TIME_ATTR = "step"  # PBT's clock: the RL step each result carries (it survives an exploit; Tune's iteration count does not)


# --------------------------------------------------------------------------------------------
# Pointer checkpoints
# --------------------------------------------------------------------------------------------
def write_pointer(folder: str | Path, *, snapshot: str, step: int, trial_id: str) -> Path:
    """Writes ``snapshot.json`` ({"snapshot", "step", "trial_id"}) into ``folder``; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / POINTER_FILE).write_text(json.dumps({"snapshot": snapshot, "step": int(step), "trial_id": trial_id}))
    return folder


def read_pointer(ckpt: Any) -> dict[str, Any] | None:
    """Returns the pointer ({"snapshot", "step", "trial_id"}) a Tune checkpoint holds, or None without one.

    Args:
        ckpt: a ``ray.tune.Checkpoint`` (from ``tune.get_checkpoint()``), or None.
    """
    if ckpt is None:
        return None
    with ckpt.as_directory() as folder:
        path = Path(folder) / POINTER_FILE
        return json.loads(path.read_text()) if path.is_file() else None


# --------------------------------------------------------------------------------------------
# Search space
# --------------------------------------------------------------------------------------------
def hyperparam_mutations(sweep: SweepConfig) -> dict[str, Any]:
    """Returns PBT's ``hyperparam_mutations``: a choice list (explored by a shift to a neighbour) or a
    ``tune.uniform`` / ``tune.loguniform`` domain (explored by x0.8 / x1.2) per swept key."""
    out: dict[str, Any] = {}
    for key, space in sweep.space.items():
        out[key] = list(space.choice) if space.kind == "choice" else getattr(tune, space.kind)(*getattr(space, space.kind))
    return out


class ClipToSpace:
    """PBT ``custom_explore_fn``: clips explored values into their uniform/loguniform bounds.

    Args:
        bounds: {dotted key: (low, high)} of the range spaces.
    """

    def __init__(self, bounds: dict[str, tuple[float, float]]) -> None:
        self.bounds = dict(bounds)

    def __call__(self, config: dict[str, Any]) -> dict[str, Any]:
        """Returns ``config`` with every bounded value clipped into [low, high]."""
        for key, (low, high) in self.bounds.items():
            if key in config:
                config[key] = min(max(config[key], low), high)
        return config


def pbt_base_config(cfg: Config, sweep: SweepConfig) -> Config:
    """Returns ``cfg`` with ``checkpoint.every_steps`` set to the perturbation interval: each trial writes
    a snapshot exactly at its perturbation times (and after its last step), the ones PBT may copy."""
    return config_from_dict(cfg.dump_with_secrets(), [f"checkpoint.every_steps={sweep.scheduler.perturbation_interval_steps}"])


def make_pbt(sweep: SweepConfig, max_steps: int) -> SnapshotPBT:
    """Returns the PBT scheduler of a sweep (time in RL steps; the last step ``max_steps`` never perturbs)."""
    s = sweep.scheduler
    bounds = {k: tuple(getattr(v, v.kind)) for k, v in sweep.space.items() if v.kind in ("uniform", "loguniform")}
    return SnapshotPBT(
        last_step=max_steps,
        time_attr=TIME_ATTR,
        perturbation_interval=s.perturbation_interval_steps,
        quantile_fraction=s.quantile_fraction,
        resample_probability=s.resample_probability,
        hyperparam_mutations=hyperparam_mutations(sweep),
        custom_explore_fn=ClipToSpace(bounds),
    )


# --------------------------------------------------------------------------------------------
# The scheduler
# --------------------------------------------------------------------------------------------
class SnapshotPBT(PopulationBasedTraining):
    """Asynchronous PBT over rlray trials (see the module docstring for where it differs from Ray's).

    Args:
        last_step: ``run.max_steps``: results at this step are never a perturbation time.
        **kwargs: ``PopulationBasedTraining`` arguments (time_attr, perturbation_interval, ...).
    """

    def __init__(self, *, last_step: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.last_step = last_step

    def on_trial_result(self, tune_controller: Any, trial: Trial, result: dict) -> str:
        """Returns Tune's decision: CONTINUE, or NOOP for a trial that was just stopped to exploit another."""
        if result.get(self._time_attr, 0) >= self.last_step:
            return TrialScheduler.CONTINUE
        decision = super().on_trial_result(tune_controller, trial, result)
        if decision == TrialScheduler.PAUSE and trial.status != Trial.PAUSED:
            return TrialScheduler.CONTINUE  # Ray pauses it so that a waiting trial runs: none waits here
        return decision

    def _checkpoint_or_exploit(self, trial: Trial, tune_controller: Any, upper_quantile: list[Trial],
                               lower_quantile: list[Trial]) -> None:
        """Records the trial's pointer checkpoint of this perturbation time; exploits a top trial when it
        is in the bottom quantile (its pointer and explored config; Tune restarts it)."""
        state = self._trial_state[trial]
        state.last_checkpoint = tune_controller._schedule_trial_save(trial, result=state.last_result)
        self._num_checkpoints += 1
        if trial not in lower_quantile:
            return
        clone = random.choice(upper_quantile)
        clone_state = self._trial_state[clone]
        if isinstance(clone_state.last_checkpoint, _FutureTrainingResult):
            resolved = clone_state.last_checkpoint.resolve()
            clone_state.last_checkpoint = resolved.checkpoint if resolved else None
            if resolved:
                clone_state.last_result = resolved.metrics
        if not clone_state.last_checkpoint:
            log.info("pbt: trial %s has no snapshot at step %s; trial %s keeps going", clone.trial_id,
                     clone_state.last_train_time, trial.trial_id)
            return
        self._exploit(tune_controller, trial, clone)

    def _quantiles(self) -> tuple[list[Trial], list[Trial]]:
        """Returns (bottom, top) trials by their score at their last perturbation time; finished trials
        count, errored ones do not. Both are empty while fewer than two trials have a score."""
        scored = [t for t, s in self._trial_state.items()
                  if s.last_score is not None and not math.isnan(s.last_score) and t.status != Trial.ERROR]
        scored.sort(key=lambda t: self._trial_state[t].last_score)
        n = min(math.ceil(len(scored) * self._quantile_fraction), len(scored) // 2)
        return (scored[:n], scored[len(scored) - n:]) if n else ([], [])
