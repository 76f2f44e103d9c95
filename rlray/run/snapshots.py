"""Taking a run's snapshots: every rank writes its part, rank 0 writes the manifest last, reports the
snapshot to Ray Train, registers it in the Model Registry and prunes old ones. A failure alerts and
never stops training. Storage itself is ``rlray.checkpoint.storage``; what a snapshot holds, ``rlray.checkpoint.contents``.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

import ray.train
from ray.train import Checkpoint, CheckpointUploadMode

from rlray.checkpoint import contents, lineage
from rlray.checkpoint import storage as checkpoint
from rlray.checkpoint.manifest import SnapshotManifest
from rlray.checkpoint.storage import SnapshotError
from rlray.observe.monitor import Alerter
from rlray.plan import RunPlan
from rlray.run.context import RunContext
from rlray.run.state import RunServices, RunState

log = logging.getLogger(__name__)


def alert(ctx: RunContext, services: RunServices, kind: str, message: str, step: int) -> None:
    """Rank 0: sends an alert through the monitor, or straight to ``monitor.alerts`` when there is none."""
    if services.monitor is not None:
        services.monitor.alert.remote(kind, message, step)
        return
    m = ctx.settings.monitor
    url = m.webhook_url.get_secret_value() if m.webhook_url else None
    Alerter(m.alerts, tracker=ctx.tracker, webhook_url=url, webhook_attempts=m.webhook_attempts).send(
        kind, message, {"run_id": ctx.tracker.run_id, "step": step, "time": time.time()})


def local_log_path(plan: RunPlan, run: RunState) -> Path:
    """Returns the local file of the run's log (<run.output_dir>/logs/run-<id>.log; a temp folder for s3://)."""
    cfg = plan.settings
    base = Path(cfg.run.output_dir) if "://" not in cfg.run.output_dir else Path(tempfile.gettempdir()) / "rlray"
    return base / checkpoint.LOGS_DIR / f"{checkpoint.run_dir_name(run.run_id)}.log"


def snapshot_due(plan: RunPlan, step: int) -> bool:
    """Returns True when a snapshot is due after ``step``: every ``checkpoint.every_steps`` and at the last step
    (``rlray.plan.Snapshots.due``)."""
    return plan.snapshots.due(step)


def snapshot(ctx: RunContext, run: RunState, services: RunServices, *, kind: str, metrics: dict[str, float]) -> str | None:
    """Writes the snapshot of step ``run.step`` (payload first, manifest last), reports it to Ray Train,
    registers it in the Model Registry and prunes old ones; returns its URI, or None when it failed.

    A failure never stops training: the previous snapshot stays the one to resume from, and rank 0
    alerts with the cause (e.g. a full disk).
    """
    t0 = time.perf_counter()
    uri = checkpoint.join(run.run_dir, checkpoint.snapshot_name(run.step, run.rollbacks))
    error = _write(ctx, run, uri, kind, metrics, services)
    if error is not None:
        if ctx.rank == 0:
            _snapshot_failed(ctx, run, services, uri, error)
        return None
    report(run, metrics, ctx.rank)
    run.last_snapshot = uri
    if ctx.rank == 0:
        _after_snapshot(ctx, run, services, uri, metrics)
        ctx.tracker.log_metrics({"timing/snapshot_s": time.perf_counter() - t0}, step=run.step)
    return uri


def _write(ctx: RunContext, run: RunState, uri: str, kind: str, metrics: dict[str, float], services: RunServices) -> str | None:
    """Writes the snapshot on every rank; returns None, or rank 0's error text (the same on every rank)."""
    error = None
    try:
        if ctx.rank == 0:
            checkpoint.clear(uri, run.options)
        ctx.coll.barrier()
        if ctx.rank == 0:
            contents.write_rank0(uri, learner=ctx.learner, tokenizer=ctx.tokenizer, config_yaml=ctx.plan.to_yaml(),
                                options=run.options)
            in_flight = ctx.in_flight_rollouts()  # async mode: the samples of the steps ahead, collected now
            if in_flight:
                contents.write_in_flight(uri, in_flight, run.options)
        else:  # its RNG states, and its optimizer shard when sharded (with rank 0's gathers: every rank is here)
            contents.write_rank(uri, rank=ctx.rank, learner=ctx.learner, tokenizer=ctx.tokenizer,
                                config_yaml=ctx.plan.to_yaml(), options=run.options)
    except SnapshotError as err:
        error = str(err)
    failed = ctx.coll.all_reduce_sum({"failed": float(error is not None)})["failed"]
    if ctx.rank == 0 and error is None:
        if failed:
            error = "another learner rank could not write its RNG state"
        else:
            try:
                checkpoint.write_manifest(uri, _manifest(ctx, run, kind, metrics, services), checkpoint.file_sizes(uri, run.options),
                                          run.options)
            except SnapshotError as err:
                error = str(err)
    return ctx.coll.broadcast(error)


def _manifest(ctx: RunContext, run: RunState, kind: str, metrics: dict[str, float], services: RunServices) -> SnapshotManifest:
    cursor = ctx.cursor_state()  # async mode: also where the steps still in flight took their prompts
    return SnapshotManifest(
        kind=kind,
        step=run.step,
        epoch=cursor["epoch"],
        policy_version=ctx.policy_version,
        rollbacks=run.rollbacks,
        data_cursor=cursor,
        world_size=ctx.world,
        run_id=run.run_id,
        config_hash=ctx.plan.config_hash,
        dataset_hash=cursor["rows_fingerprint"],
        git_commit=services.git_commit,
        parent_version=run.model_version,
        metrics={k: float(v) for k, v in metrics.items()},
    )


def known_to_ray(uri: str) -> bool:
    """Returns True when ``uri`` is the checkpoint Ray Train restored this worker group with."""
    ckpt = ray.train.get_checkpoint()
    return ckpt is not None and ckpt.path.rstrip("/").rsplit("/", 1)[-1] == uri.rsplit("/", 1)[-1]


def report(run: RunState, metrics: dict[str, float], rank: int, name: str | None = None) -> None:
    """Registers the written snapshot with Ray Train (``NO_UPLOAD``: the files are already in place)."""
    if not run.in_ray_train:
        return
    name = name or checkpoint.snapshot_name(run.step, run.rollbacks)
    storage = ray.train.get_context().get_storage()
    ckpt = Checkpoint(path=f"{storage.experiment_fs_path}/{name}", filesystem=storage.storage_filesystem) if rank == 0 else None
    ray.train.report({"step": run.step, **{k: float(v) for k, v in metrics.items()}}, checkpoint=ckpt,
                     checkpoint_dir_name=name, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)


def _after_snapshot(ctx: RunContext, run: RunState, services: RunServices, uri: str, metrics: dict[str, float]) -> None:
    plan, cfg = ctx.plan, ctx.settings
    manifest = checkpoint.read_manifest(uri, run.options, verify=False)
    try:
        run.model_version = lineage.register(ctx.tracker, plan.tracking.experiment, uri, manifest, metrics)
    except Exception as err:  # the registry being down must not stop training
        alert(ctx, services, "registry_failed", f"could not register snapshot {uri}: {err}", run.step)
    ctx.tracker.set_tags({"rlray.last_snapshot": uri})
    if services.monitor is not None:
        services.monitor.record_snapshot.remote(run.step)
    log_file = local_log_path(plan, run)
    try:
        if log_file.exists():
            checkpoint.put_file(log_file, checkpoint.join(plan.snapshots.uri, checkpoint.LOGS_DIR, log_file.name), run.options)
        removed = checkpoint.prune(
            plan.snapshots.uri, checkpoint.run_dir_name(run.run_id), max_age_s=cfg.checkpoint.max_age_days * 86400,
            log_max_age_s=cfg.checkpoint.log_max_age_days * 86400,
            keep_last=None if run.in_ray_train else cfg.checkpoint.keep_last, options=run.options)
    except SnapshotError as err:
        alert(ctx, services, "prune_failed", str(err), run.step)
        removed = []
    log.info("snapshot %s written (version %s); pruned %d", uri, run.model_version, len(removed))


def _snapshot_failed(ctx: RunContext, run: RunState, services: RunServices, uri: str, error: str) -> None:
    try:
        checkpoint.clear(uri, run.options)  # best effort; readers ignore it anyway (no manifest)
    except SnapshotError:
        pass
    previous = run.last_snapshot or "none"
    alert(ctx, services, "snapshot_failed", f"snapshot at step {run.step} failed: {error}; the last complete one is {previous}",
          run.step)
    ctx.tracker.log_metrics({"checkpoint/failures": 1.0}, step=run.step)
    if services.monitor is not None:
        services.monitor.record_snapshot.remote(None)


