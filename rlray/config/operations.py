"""Config sections checkpoint (with s3), guard and monitor: operations."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator

from rlray.config.base import _Section


class S3Config(_Section):
    """Options of s3fs for ``s3://`` snapshot storage; unset values use the AWS defaults (env, profile)."""

    endpoint_url: str | None = Field(
        None, description="S3 API endpoint (MinIO, moto, a private cloud); None uses AWS's."
    )
    region: str | None = Field(None, description="S3 region name; None uses the AWS default chain.")
    access_key_id: SecretStr | None = Field(
        None, description="Access key id; None uses the AWS credential chain. Never logged."
    )
    secret_access_key: SecretStr | None = Field(
        None, description="Secret access key (set together with access_key_id). Never logged."
    )

    @model_validator(mode="after")
    def _keys_in_pairs(self) -> S3Config:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError(
                "checkpoint.s3.access_key_id and checkpoint.s3.secret_access_key must be set together "
                "(or both left unset to use the AWS credential chain)"
            )
        return self

    def storage_options(self) -> dict[str, Any]:
        """Returns s3fs keyword arguments (secrets revealed: pass them to s3fs only, never log them)."""
        opts: dict[str, Any] = {}
        if self.endpoint_url:
            opts["endpoint_url"] = self.endpoint_url
        if self.region:
            opts["client_kwargs"] = {"region_name": self.region}
        if self.access_key_id is not None and self.secret_access_key is not None:
            opts["key"] = self.access_key_id.get_secret_value()
            opts["secret"] = self.secret_access_key.get_secret_value()
        return opts


class CheckpointConfig(_Section):
    """Snapshots: Ray Train checkpoints under ``uri`` carrying rlray's manifest (rlray/checkpoint/storage.py)."""

    uri: str | None = Field(
        None,
        description=(
            "Snapshot storage, the Ray Train storage_path: a local folder or s3://bucket/prefix. "
            "None means <run.output_dir>/snapshots. Each run writes <uri>/run-<mlflow run id>/step_<N>/."
        ),
    )
    every_steps: int = Field(
        1000, ge=1, description="Take a snapshot every N RL steps; one is also taken after the last step."
    )
    keep_last: int = Field(
        3, ge=1, description="Complete snapshots kept per run (Ray Train num_to_keep); the newest is never removed."
    )
    max_age_days: float = Field(
        30.0,
        gt=0.0,
        description=(
            "Snapshots of earlier runs under checkpoint.uri older than this many days are deleted at each "
            "snapshot; the newest complete snapshot is always kept."
        ),
    )
    log_max_age_days: float = Field(
        7.0, gt=0.0, description="Run logs under <checkpoint.uri>/logs older than this many days are deleted."
    )
    resume_from: str | None = Field(
        None,
        description=(
            "Start from a snapshot: 'latest' (the newest complete one under checkpoint.uri) or a snapshot "
            "URI. Set by `rlray train --resume` and `rlray rollback`."
        ),
    )
    s3: S3Config = Field(default_factory=S3Config)


class GuardConfig(_Section):
    """Guards that stop (or roll back) a run that goes wrong."""

    kl_threshold: float | None = Field(
        0.03,
        gt=0.0,
        description=(
            "Trip when a step's mean per-token k3 KL to the reference model (algo/kl, nats per token) "
            "exceeds this; None disables the KL guard."
        ),
    )
    on_trip: Literal["stop", "rollback"] = Field(
        "stop",
        description="What a KL trip does: stop the run, or restore the last good snapshot and continue.",
    )
    rollback_overrides: list[str] = Field(
        default_factory=lambda: ["learner.lr*=0.5"],
        description=(
            "Config changes applied at each rollback: 'key=value' sets, 'key*=factor' multiplies the "
            "current value. Keys under learner., algo. or reward. only."
        ),
    )
    max_rollbacks: int = Field(
        2, ge=0, description="Rollbacks allowed per run; the next KL trip stops the run."
    )
    max_nonfinite_steps: int = Field(
        3,
        ge=1,
        description=(
            "A step with a NaN/inf loss or gradient norm is skipped (no optimizer update); the run stops "
            "after this many such steps in a row."
        ),
    )
    max_failed_steps: int = Field(
        2,
        ge=1,
        description=(
            "The run ends FAILED, with the first failure messages, after this many steps in a row in which every "
            "sample failed (its episode, a reward function or the reward model): such a run cannot learn. The same "
            "count of steps in a row in which no prompt group's rewards differ (no signal) sends a warning alert."
        ),
    )
    memory_fraction: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description=(
            "Memory cap of each learner worker as a fraction of its GPU's memory "
            "(torch.cuda.set_per_process_memory_fraction) or, on CPU, of the machine's RAM (RSS watchdog)."
        ),
    )
    memory_cap_gib: float | None = Field(
        None, gt=0.0, description="Absolute memory cap per learner worker in GiB; overrides memory_fraction."
    )
    memory_check_s: float = Field(1.0, gt=0.0, description="Seconds between RSS checks of the CPU watchdog.")


class WatchdogConfig(_Section):
    """Deadlines of the remote calls a run waits on, and what a call past one does (``rlray.hangs``).

    A call past its deadline is reported with the stuck process's Python stacks (an ``rlray: hang`` line and a
    ``hang`` alert naming the actor, the call and where it is stuck), then ``on_hang`` applies.
    """

    env_call_s: float = Field(
        600.0, gt=0.0,
        description=(
            "Seconds rank 0 waits for one call to an environment host (a batch of episodes' reset, step, "
            "reward_at_limit or close; each episode's own call is also under env.step_timeout_s inside the host)."
        ),
    )
    engine_call_s: float = Field(
        1800.0, gt=0.0,
        description=(
            "Seconds one generate call (a chunk of a step's prompts or episode turns) may run on a rollout actor, "
            "time queued behind the actor's earlier calls excluded."
        ),
    )
    weight_push_s: float = Field(
        600.0, gt=0.0,
        description="Seconds one weight push (object-store sync) may run on a rollout actor, queueing excluded.",
    )
    reference_call_s: float = Field(
        1800.0, gt=0.0,
        description=(
            "Seconds a learner rank waits for one logprobs call (its shard of the step) to the reference or teacher "
            "actor (resources.reference/teacher.placement=actor), time queued behind the other ranks' calls included: "
            "the actor runs one call at a time, so the wait can cover every rank's shard. Rank r > 0 reports only "
            "after a further r x (stacks_timeout_s + 5) s, so that one rank restarts the shared actor."
        ),
    )
    learner_step_s: float = Field(
        7200.0, gt=0.0,
        description=(
            "Seconds one learner step (rollout to snapshot) may run on a rank: past it each rank still in the step "
            "reports its own stacks (a rank stuck in or short of a collective); a rank under Ray Train then exits: "
            "with on_hang=restart Ray Train restarts the group from the newest snapshot (monitor.max_failures), with "
            "stop the run ends FAILED, resumable from its newest snapshot."
        ),
    )
    collective_s: float = Field(
        600.0, gt=0.0,
        description=(
            "Seconds a learner rank may wait in one of the run's collectives between the ranks (all-reduce, "
            "all-gather, broadcast, barrier) after work every rank does alike (an online step's stages 5-6, an offline "
            "update): past it the rank reports the collective, the ranks that have not entered it and their stacks; "
            "a rank under Ray Train then exits: with on_hang=restart Ray Train restarts the group from the newest "
            "snapshot, with stop the run ends FAILED, resumable from its newest snapshot. Collectives that wait on "
            "rank 0's own work (rollouts, snapshots, evaluation) and the model's "
            "own (DDP, FSDP) stay under learner_step_s."
        ),
    )
    on_hang: Literal["restart", "stop"] = Field(
        "restart",
        description=(
            "What a call past its deadline does after the report: restart the actor's process (Ray restarts it up "
            "to its max_restarts; its work runs again, counted in rollout/rerun_prompts or env/episodes_rerun; a reference "
            "or teacher call is made once more), or "
            "stop the run (status FAILED, after a snapshot of the last finished step; a learner rank's own step or "
            "collective deadline ends it at the newest snapshot instead: a stuck rank cannot write its part)."
        ),
    )
    stacks_timeout_s: float = Field(10.0, gt=0.0, description="Seconds to wait for a stuck process's Python stacks.")


class BandConfig(_Section):
    """A healthy band of one metric the live page plots: shaded on its chart, with a marker at each step outside it.

    A step is outside when its value is not finite (``finite``), below ``low`` or above ``high``, or when the
    least-squares slope of the metric over the last ``window`` steps (this one included) is below ``min_slope``.
    """

    metric: str = Field(description="Plotted metric key, e.g. learner/pg_loss or reward/mean (a reward term: reward/<term>).")
    low: float | None = Field(None, description="Lowest healthy value, in the metric's unit; None: no lower bound.")
    high: float | None = Field(None, description="Highest healthy value, in the metric's unit; None: no upper bound.")
    finite: bool = Field(True, description="NaN or an infinity is outside the band.")
    min_slope: float | None = Field(
        None,
        description=(
            "Lowest healthy least-squares slope over the last `window` steps, in the metric's unit per step (0.0: "
            "'not falling'); None: no slope check."
        ),
    )
    window: int = Field(20, ge=2, description="Steps the slope is fitted over (only with min_slope).")

    @model_validator(mode="after")
    def _ordered(self) -> BandConfig:
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"band of {self.metric}: low={self.low} is above high={self.high}; swap them")
        return self


def _default_bands() -> list[BandConfig]:
    """Returns the bands that hold for every algorithm: finite losses and gradient norms, reward not falling over
    20 steps. (KL under guard.kl_threshold is always drawn; a PPO-style 'policy loss 0.1-0.5' band is opt-in.)"""
    finite = [BandConfig(metric=k) for k in ("learner/pg_loss", "learner/value_loss", "learner/grad_norm")]
    return [*finite, BandConfig(metric="reward/mean", min_slope=0.0, window=20)]


class MonitorConfig(_Section):
    """The monitor (the live page, GET /health and /metrics), heartbeats, alerts and automatic restarts."""

    port: int = Field(
        8888, ge=0, le=65535,
        description="Port of the live page (/), /health and /metrics; 0 picks a free port (printed and tagged).",
    )
    host: str = Field("127.0.0.1", description="Address the monitor binds; 0.0.0.0 exposes it to the network.")
    heartbeat_s: float = Field(
        300.0,
        gt=0.0,
        description="Seconds between heartbeats (a log line and an MLflow metric); 2 missed ones mean 'stalled'.",
    )
    alerts: list[Literal["log", "mlflow", "webhook"]] = Field(
        default_factory=lambda: ["log", "mlflow"],
        description="Where alerts go (guard trip, restart, stall, failed snapshot): log, MLflow tag, webhook.",
    )
    webhook_url: SecretStr | None = Field(
        None, description="URL that alerts are POSTed to as JSON (needs 'webhook' in monitor.alerts). Never logged."
    )
    page_sample_steps: int = Field(
        20,
        ge=1,
        description=(
            "Steps whose kept samples (tracking.samples_per_step) the monitor holds in memory for its page's sample "
            "viewer; older steps' samples stay in MLflow."
        ),
    )
    bands: list[BandConfig] = Field(
        default_factory=_default_bands,
        description=(
            "Healthy bands the live page shades, marking each step outside one (a list replaces the defaults: finite "
            "learner/pg_loss, learner/value_loss and learner/grad_norm, and reward/mean not falling over 20 steps, "
            "min_slope 0.0). KL under guard.kl_threshold is always drawn. PPO-style runs may add "
            "{metric: learner/pg_loss, low: 0.1, high: 0.5}."
        ),
    )
    webhook_attempts: int = Field(3, ge=1, description="Tries per webhook alert (exponential back-off).")
    max_failures: int = Field(
        3, ge=0, description="Learner failures Ray Train restarts from the latest snapshot (FailureConfig)."
    )
    restart_delay_s: float = Field(
        30.0, ge=0.0, description="Seconds a restarted learner waits before it restores and resumes."
    )


def monitor_defaults() -> dict[str, Any]:
    """Returns the monitor section's defaults as plain JSON data (``MonitorConfig().model_dump(mode="json")``:
    ``bands`` as a list of dicts of ``BandConfig``'s fields, ``heartbeat_s``, ...): what ``rlray monitor RUN_ID``
    shows for a run whose stored config lacks them (written by an older rlray; ``rlray.observe.stored.StoredRun``)."""
    return MonitorConfig().model_dump(mode="json")
