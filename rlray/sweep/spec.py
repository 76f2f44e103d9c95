"""The sweep file schema: what ``rlray sweep`` searches, how it ranks trials, and the scheduler.

A sweep file is its own YAML document (not part of the experiment config): a ``space`` of dotted
config keys with grid/choice/uniform/loguniform values, the ranking ``metric`` and ``mode``, and a
``scheduler`` (fifo, asha, pbt). ``load_sweep`` validates the file on its own; ``check_sweep``
checks it against the experiment config it varies. Errors name the file, the dotted key and the fix.
Example: configs/sweeps/grpo_lr_beta.yaml.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from rlray.config import Config, ConfigError, config_from_dict, validation_error_lines
from rlray.config.base import _Section
from rlray.observe.metrics import METRIC_KEYS, RENAMED_KEYS, term_keys


class SweepError(ConfigError):
    """A sweep file that cannot be used. The message names the file, the dotted key and the fix."""


# --------------------------------------------------------------------------------------------
# Sweep file schema
# --------------------------------------------------------------------------------------------
class _Strict(_Section):
    """Base of the sweep file's sections: the config's rules (unknown keys are errors, a boolean is not a number)."""


class Space(_Strict):
    """The values one config key takes: exactly one of grid, choice, uniform, loguniform."""

    grid: list[Any] | None = Field(None, min_length=1, description="Every value, once per repeat (tune.grid_search).")
    choice: list[Any] | None = Field(None, min_length=1, description="One value drawn per trial (tune.choice).")
    uniform: tuple[float, float] | None = Field(None, description="[low, high): uniform draw (tune.uniform).")
    loguniform: tuple[float, float] | None = Field(
        None, description="[low, high), low > 0: log-uniform draw (tune.loguniform), for rates."
    )

    @model_validator(mode="after")
    def _one_kind(self) -> Space:
        given = [k for k in ("grid", "choice", "uniform", "loguniform") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of grid, choice, uniform, loguniform (got {given or 'none'})")
        low, high = self.uniform or self.loguniform or (0.0, 1.0)
        if not low < high:
            raise ValueError(f"{given[0]}=[{low}, {high}]: low must be below high")
        if self.loguniform is not None and low <= 0:
            raise ValueError(f"loguniform=[{low}, {high}]: low must be > 0; use uniform for ranges that include 0")
        return self

    @property
    def kind(self) -> str:
        """Returns 'grid', 'choice', 'uniform' or 'loguniform'."""
        return next(k for k in ("grid", "choice", "uniform", "loguniform") if getattr(self, k) is not None)

    def probe_values(self) -> list[Any]:
        """Returns values that must be valid config values: all listed values, or both bounds."""
        return list(getattr(self, self.kind))


class SchedulerSpec(_Strict):
    """The Tune trial scheduler. Time is counted in RL steps (one Tune result per step)."""

    name: Literal["fifo", "asha", "pbt"] = Field(
        "asha", description="fifo runs every trial to run.max_steps; asha stops weak trials early; pbt exploits/explores."
    )
    grace_period_steps: int = Field(
        1, ge=1, description="ASHA: steps every trial runs before it may be stopped; below run.max_steps."
    )
    reduction_factor: float = Field(
        2.0, gt=1.0, description="ASHA: a trial continues past a rung when in the top 1/reduction_factor there."
    )
    perturbation_interval_steps: int = Field(
        2, ge=1, description="PBT: steps between exploit/explore decisions; below run.max_steps. Trials snapshot at "
        "each (checkpoint.every_steps is set to it)."
    )
    quantile_fraction: float = Field(
        0.25, gt=0.0, le=0.5, description="PBT: the bottom fraction of trials copies a trial of the top fraction."
    )
    resample_probability: float = Field(
        0.25, ge=0.0, le=1.0, description="PBT: chance to redraw a value from its space instead of perturbing it."
    )


class SweepConfig(_Strict):
    """A sweep file: what to search, how to rank trials, and the scheduler."""

    metric: str = Field("reward/mean", description="Per-step metric that ranks trials (a key of metrics.METRIC_KEYS, or reward/<term name>).")
    mode: Literal["max", "min"] = Field("max", description="Whether a higher or a lower metric is better.")
    space: dict[str, Space] = Field(
        ..., min_length=1, description="Dotted config key -> its values, e.g. learner.lr: {loguniform: [1e-6, 1e-4]}."
    )
    num_samples: int = Field(
        1, ge=1, description="Tune num_samples: repeats of the grid; each repeat draws choice/uniform/loguniform anew."
    )
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    max_concurrent_trials: int | None = Field(
        None, ge=1, description="Trials at once; None: as many as the cluster's CPUs/GPUs fit (config resources per trial)."
    )
    trial_driver_cpus: float = Field(
        0.1, gt=0.0, description="Ray CPUs Tune reserves per trial for the trial function (it only orchestrates)."
    )
    seed: int = Field(0, ge=0, description="Seed of Tune's random draws (choice, uniform, loguniform).")

    @model_validator(mode="after")
    def _check(self) -> SweepConfig:
        if self.metric in RENAMED_KEYS:
            raise ValueError(f"metric={self.metric!r} was renamed {RENAMED_KEYS[self.metric]!r} (a reward function's term)")
        if self.metric not in METRIC_KEYS and not self.metric.startswith("reward/"):  # terms: check_sweep
            raise ValueError(
                f"metric={self.metric!r} is not a per-step metric; use one of rlray.observe.metrics.METRIC_KEYS, e.g. 'reward/mean', "
                "or a reward term's reward/<name>"
            )
        if self.scheduler.name == "pbt":
            grids = [k for k, s in self.space.items() if s.kind == "grid"]
            if grids:
                raise ValueError(f"scheduler.name='pbt' mutates values, so space.{grids[0]} cannot be a grid; use choice, uniform or loguniform")
        return self


def _sweep_key_hint(key: str) -> str:
    return (f" (sweep keys: {', '.join(SweepConfig.model_fields)}; space entries: grid, choice, uniform, loguniform; "
            f"scheduler: {', '.join(SchedulerSpec.model_fields)})")


def load_sweep(path: str | Path) -> SweepConfig:
    """Returns the validated sweep file at ``path``.

    Raises:
        SweepError: missing file, not valid YAML, not a YAML mapping, or a schema error (naming the dotted key).
    """
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"sweep file '{path}' does not exist")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise SweepError(f"sweep file '{path}' is not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise SweepError(f"sweep file '{path}' must hold a mapping, got {type(tree).__name__}")
    try:
        return SweepConfig.model_validate(tree)
    except ValidationError as err:
        lines = validation_error_lines(err, unknown_key_hint=_sweep_key_hint)
        raise SweepError(f"invalid sweep file '{path}':\n  - " + "\n  - ".join(lines)) from None


def check_sweep(sweep: SweepConfig, base: Config) -> None:
    """Checks the sweep against the experiment config it varies.

    Every value of every space (both bounds of a range) must give a valid config, the ASHA grace
    period must end before the last step (``run.max_steps``), and PBT must have a perturbation time
    before the last step and keep the snapshots it copies.

    Raises:
        SweepError: naming ``space.<key>`` (with the config's own message), the scheduler field, or a
            ``metric`` that is neither a per-step metric nor one of the config's reward terms.
    """
    terms = [k for k in term_keys(base.reward.term_names) if k.startswith("reward/")]
    if sweep.metric not in METRIC_KEYS and sweep.metric not in terms:
        raise SweepError(
            f"metric={sweep.metric!r} is neither a per-step metric (rlray.observe.metrics.METRIC_KEYS, e.g. 'reward/mean') nor "
            f"one of the config's reward terms {terms}"
        )
    tree = base.model_dump(mode="json")
    for key, space in sweep.space.items():
        for value in space.probe_values():
            try:
                config_from_dict(tree, [f"{key}={json.dumps(value)}"])
            except ConfigError as err:
                raise SweepError(f"space.{key} value {value!r} ({space.kind}) gives an invalid config: {err}") from None
    if sweep.scheduler.name == "asha" and sweep.scheduler.grace_period_steps >= base.run.max_steps:
        raise SweepError(
            f"scheduler.grace_period_steps={sweep.scheduler.grace_period_steps} must be below run.max_steps="
            f"{base.run.max_steps} (ASHA judges trials before their last step); lower it or raise run.max_steps"
        )
    if sweep.scheduler.name == "pbt":
        _check_pbt(sweep, base)


def _check_pbt(sweep: SweepConfig, base: Config) -> None:
    """Checks that PBT can perturb before the last step and finds the snapshots it copies.

    Raises:
        SweepError: naming the scheduler field or the config key to change.
    """
    interval = sweep.scheduler.perturbation_interval_steps
    if interval >= base.run.max_steps:
        raise SweepError(
            f"scheduler.perturbation_interval_steps={interval} must be below run.max_steps={base.run.max_steps} "
            "(the last step is never a perturbation time); lower it or raise run.max_steps"
        )
    if base.checkpoint.keep_last < 2:
        raise SweepError(
            f"checkpoint.keep_last={base.checkpoint.keep_last}: PBT copies the snapshot of a trial's last "
            "perturbation time, which a newer snapshot must not prune; set checkpoint.keep_last>=2"
        )
