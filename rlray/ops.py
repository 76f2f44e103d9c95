"""Operations around the step loop: restore, guards, rollback, heartbeat, status (snapshots: rlray/snapshots.py).

``rlray.training.train`` calls these between steps (stage 8: log, guard, snapshot) and at the start and
end of a run; every function runs on every learner rank unless it says "rank 0". Ranks agree on
each decision (trip, snapshot success) through the collective, so they call Ray Train's report and
the collectives the same number of times.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import psutil

from rlray import checkpoint, guard, lineage, snapshots, trainstate
from rlray.config import Config
from rlray.runstate import RUNNING, RunOps, RunState

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Start
# --------------------------------------------------------------------------------------------
def restore_source(cfg: Config, ops: RunOps, run_id: str, in_ray_train: bool) -> tuple[str | None, bool]:
    """Returns (snapshot URI to restore or None, True when it is one of this run's own snapshots).

    Inside Ray Train: a checkpoint Ray hands over from another run's folder wins; like
    ``ops.resume_from`` it is a start from that snapshot, not a restart (the config as given, e.g. a
    PBT trial's mutated values, stays in force). Otherwise a complete snapshot in this run's own
    folder means the learner was restarted: the newest one wins, even one Ray Train never registered
    (its ``ray.train.report`` was cut off by the failure, or the controller had not taken it in yet;
    ``begin`` reports it again so Ray's bookkeeping catches up). Without either, ``ops.resume_from``.
    """
    if in_ray_train:
        import ray.train

        run_dir = checkpoint.join(cfg.checkpoint_uri, checkpoint.run_dir_name(run_id))
        ckpt = ray.train.get_checkpoint()
        parent, name = ckpt.path.rstrip("/").rsplit("/", 2)[-2:] if ckpt is not None else (None, None)
        if ckpt is not None and parent != checkpoint.run_dir_name(run_id):
            return _uri_of(ckpt), False
        newest = checkpoint.latest_snapshot(run_dir, cfg.checkpoint.s3.storage_options())
        if newest or ckpt is not None:
            return newest or checkpoint.join(run_dir, name), True
    return ops.resume_from, False


def _uri_of(ckpt: Any) -> str:
    """Returns the fsspec URI of a Ray Train checkpoint (a local path, or the URI of its fsspec filesystem)."""
    handler = getattr(ckpt.filesystem, "handler", None)
    fs = getattr(handler, "fs", None)
    return fs.unstrip_protocol(ckpt.path) if fs is not None and "file" not in fs.protocol else ckpt.path


def config_for_restore(cfg: Config, source: str | None, restarted: bool) -> Config:
    """Returns the config to build the learner with: when ``source`` is this run's own snapshot (``restarted``,
    a Ray Train restart), the trained sections come from it (a rollback or OOM fallback may have changed
    them); otherwise ``cfg`` as given (a resume or a PBT exploit: the user's or the mutated values win)."""
    if source is None or not restarted:
        return cfg
    return trainstate.adopt_trained_config(cfg, trainstate.snapshot_config(source, cfg.checkpoint.s3.storage_options()))


def begin(ctx: Any, ops: RunOps, source: str | None, *, in_ray_train: bool, reload_rollouts: Callable[[], None]) -> RunState:
    """Restores ``source`` (when given) on every rank, pushes the policy to the rollouts, starts rank 0's
    heartbeat and every rank's memory watchdog; returns the run's state."""
    cfg = ctx.cfg
    run_id = ctx.coll.broadcast(ctx.tracker.run_id if ctx.rank == 0 else None)
    opts = cfg.checkpoint.s3.storage_options()
    run = RunState(run_id, checkpoint.join(cfg.checkpoint_uri, checkpoint.run_dir_name(run_id)), opts, in_ray_train)
    if source is not None:
        manifest = _restore(ctx, run, source)
        run.step = run.first_step = manifest["step"]
        run.rollbacks = manifest.get("rollbacks", 0)
        run.last_snapshot = source
        run.source = (run.step, source)
        if in_ray_train and source.startswith(run.run_dir + "/") and not snapshots.known_to_ray(source):
            snapshots.report(run, {}, ctx.rank, name=source.rsplit("/", 1)[-1])  # its report was cut off by the failure
    reload_rollouts()  # the engines may hold newer weights (a restart) or other ones (a resume)
    if not _on_cuda():
        cap = guard.memory_cap_bytes(cfg.guard, cuda=False)
        run.watchdog = guard.MemoryWatchdog(cap, cfg.guard.memory_check_s, ctx.rank).start()
    if ctx.rank == 0:
        _begin_rank0(ctx, ops, run, source)
    return run


def _on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _restore(ctx: Any, run: RunState, uri: str) -> dict[str, Any]:
    manifest = trainstate.restore_learner(uri, learner=ctx.learner, rank=ctx.rank, options=run.options)
    trainstate.set_optimizer_hparams(ctx.learner, ctx.cfg)
    ctx.policy_version = int(manifest["policy_version"])
    if ctx.stream is not None:  # rank 0 online; every rank offline (each walks the same cursor)
        ctx.stream.load_state_dict(manifest["data_cursor"])
    log.info("rank %d restored snapshot %s (step %d, policy version %d)", ctx.rank, uri, manifest["step"], ctx.policy_version)
    return manifest


def _begin_rank0(ctx: Any, ops: RunOps, run: RunState, source: str | None) -> None:
    tracker, cfg = ctx.tracker, ctx.cfg
    tracker.set_tags({"rlray.snapshot_dir": run.run_dir, "rlray.status": RUNNING, "rlray.git_commit": ops.git_commit})
    run.logged_through = tracker.last_logged_step()
    if source is not None:
        run.model_version = lineage.version_of(cfg.tracking.mlflow_uri, cfg.tracking.experiment, source)
        if run.model_version is None:  # written, but the process died before registering it: keep the chain whole
            manifest = checkpoint.read_manifest(source, run.options, verify=False)
            run.model_version = lineage.register(tracker, cfg.tracking.experiment, source, manifest, manifest["metrics"])
        tracker.set_tags({"rlray.restored_from": source})
        tracker.log_metrics({"run/restored_step": float(run.step)}, step=run.step)
    run.log_handler = _attach_log_file(cfg, run)
    started = time.time()

    def beat() -> None:
        rss = psutil.Process().memory_info().rss / guard.GIB
        log.info("heartbeat run=%s step=%d epoch=%d policy_version=%d rss_gib=%.2f", run.run_id, run.step,
                 ctx.stream.epoch, ctx.policy_version, rss)
        tracker.log_metrics({"monitor/heartbeat_s": time.time() - started, "monitor/rss_gib": rss}, step=run.step)
        if ops.monitor is not None:
            ops.monitor.beat.remote(run.step, ctx.stream.epoch, ctx.policy_version)

    from rlray.monitor import Heartbeat

    run.heartbeat = Heartbeat(beat, cfg.monitor.heartbeat_s).start()


def _attach_log_file(cfg: Config, run: RunState) -> logging.Handler:
    """Adds a file handler for rlray's log lines of this run (copied to <checkpoint uri>/logs at snapshots)."""
    path = snapshots.local_log_path(cfg, run)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    root = logging.getLogger("rlray")
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    return handler


# --------------------------------------------------------------------------------------------
# After each step
# --------------------------------------------------------------------------------------------
def check_guards(ctx: Any, run: RunState, metrics: dict[str, float], ops: RunOps) -> guard.Trip | None:
    """Returns the guard the step trips (the same on every rank), or None; counts non-finite steps."""
    finite = guard.is_finite_step(metrics)
    run.nonfinite_in_row = 0 if finite else run.nonfinite_in_row + 1
    if not finite:
        log.error("step %d: non-finite loss or gradient norm; the update was skipped", run.step)
    memory = run.watchdog.message if run.watchdog else None
    flags = ctx.coll.all_reduce_sum({"memory": float(memory is not None)})
    if flags["memory"] and memory is None:
        memory = "another learner rank exceeded the memory cap"
    trip = None
    if ctx.rank == 0:
        trip = guard.check_step(metrics, step=run.step, nonfinite_in_row=run.nonfinite_in_row, guard=ctx.cfg.guard,
                                elapsed_s=time.time() - ops.started_at, max_wall_time_s=ctx.cfg.run.max_wall_time_s,
                                memory_message=memory)
        metrics["guard/nonfinite_in_row"] = float(run.nonfinite_in_row)
        metrics["run/rollbacks"] = float(run.rollbacks)
        # synchronous steps roll out with the previous version; async mode (issue 4) reports its own
        metrics.setdefault("rollout/staleness_mean", max(0.0, ctx.policy_version - 1 - metrics.get("rollout/policy_version", 0.0)))
    return ctx.coll.broadcast(trip)


def record(ctx: Any, run: RunState, metrics: dict[str, float], ops: RunOps) -> None:
    """Rank 0: logs the step's metrics (once per step, across restarts) and updates the monitor."""
    if run.step > run.logged_through:
        ctx.tracker.log_metrics(metrics, step=run.step)
        run.logged_through = run.step
    if ops.monitor is not None:
        ops.monitor.record_step.remote(run.step, ctx.stream.epoch, ctx.policy_version, metrics)


def handle_trip(ctx: Any, run: RunState, trip: guard.Trip, ops: RunOps, reload_rollouts: Callable[[], None]) -> None:
    """Rolls back (``guard.on_trip=rollback``, within ``guard.max_rollbacks``, with a good snapshot to
    return to) or stops the run with status 'stopped: <reason>'; alerts and tags either way."""
    g = ctx.cfg.guard
    target = None
    if trip.reason == "kl_guard" and g.on_trip == "rollback" and run.rollbacks < g.max_rollbacks:
        target = ctx.coll.broadcast(last_good_snapshot(run) if ctx.rank == 0 else None)
    if ctx.rank == 0:
        what = f"rolling back to {target}" if target else "stopping"
        snapshots.alert(ctx, ops, "guard_trip", f"{trip.reason}: {trip.message}; {what}", run.step)
    if target:
        rollback(ctx, run, target, reload_rollouts)
        return
    if trip.keep_state:
        snapshots.snapshot(ctx, run, ops, kind="stop", metrics={})
    run.status = f"stopped: {trip.reason}"
    if ctx.rank == 0:
        ctx.tracker.set_tags({"rlray.stop_reason": trip.reason, "rlray.stop_step": str(run.step),
                              "rlray.stop_message": trip.message})


def end_step(ctx: Any, run: RunState, ops: RunOps, trip: guard.Trip | None, stop_reason: str | None,
             metrics: dict[str, float], reload_rollouts: Callable[[], None]) -> str | None:
    """Stage 8 at a step boundary, the same for online and offline runs; returns the snapshot written, or None.

    A tripped guard is handled (stop or rollback, ``handle_trip``). Otherwise a hook's stop request before
    the last step writes a "stop" snapshot and ends the run with status 'stopped: <reason>' (MLflow tags
    rlray.stop_reason and rlray.stop_step); otherwise a due snapshot ("periodic", or "final" after the last
    step) is written. Every rank calls it with the same ``trip`` and ``stop_reason``.

    Raises:
        rlray.checkpoint.SnapshotError: a snapshot could not be written (the previous one is intact).
    """
    if trip is not None:
        handle_trip(ctx, run, trip, ops, reload_rollouts=reload_rollouts)
        return None
    if stop_reason and run.step < ctx.cfg.run.max_steps:
        written = snapshots.snapshot(ctx, run, ops, kind="stop", metrics=metrics)
        run.status = f"stopped: {stop_reason}"
        if ctx.coll.rank == 0:
            ctx.tracker.set_tags({"rlray.stop_reason": stop_reason, "rlray.stop_step": str(run.step)})
        return written
    if snapshots.snapshot_due(ctx.cfg, run.step):
        kind = "final" if run.step == ctx.cfg.run.max_steps else "periodic"
        return snapshots.snapshot(ctx, run, ops, kind=kind, metrics=metrics)
    return None


def last_good_snapshot(run: RunState) -> str | None:
    """Rank 0: returns the newest complete snapshot that a KL trip at ``run.step`` does not implicate, or None.

    The KL measured in step k is that of the policy after step k-1's update, so a trip at step k
    condemns the snapshot of step k-1; the last good one was taken at step k-2 or earlier (this run's,
    or the snapshot it was resumed from).
    """
    limit = run.step - 2
    found = [(s.step, s.manifest["written_at"], s.uri) for s in checkpoint.list_snapshots(run.run_dir, run.options)
             if s.complete and s.step <= limit]
    if run.source and run.source[0] <= limit:
        found.append((run.source[0], 0.0, run.source[1]))
    return max(found)[2] if found else None


def rollback(ctx: Any, run: RunState, target: str, reload_rollouts: Callable[[], None]) -> None:
    """Restores the snapshot ``target`` with ``guard.rollback_overrides`` applied, and continues from it.

    The config change is recorded as a new config artifact and tags (never as a changed param); the
    steps that run again are logged again.
    """
    new_cfg, changes = guard.rollback_config(ctx.cfg, ctx.cfg.guard.rollback_overrides)
    tripped_at = run.step
    ctx.cfg = new_cfg
    manifest = _restore(ctx, run, target)
    run.step = manifest["step"]
    run.rollbacks += 1
    run.nonfinite_in_row = 0
    run.logged_through = min(run.logged_through, run.step)
    reload_rollouts()
    if ctx.rank == 0:
        text = ", ".join(f"{k}: {old} -> {new}" for k, (old, new) in changes.items())
        ctx.tracker.log_text(new_cfg.to_yaml(), f"config/rollback_{run.rollbacks}.yaml")
        ctx.tracker.set_tags({f"rlray.rollback.{run.rollbacks}": f"step {tripped_at} -> step {run.step}; {text}",
                              "rlray.rollbacks": str(run.rollbacks), "rlray.config_hash_now": new_cfg.config_hash()})
        run.model_version = lineage.version_of(new_cfg.tracking.mlflow_uri, new_cfg.tracking.experiment, target)
        log.warning("rollback %d: step %d -> snapshot step %d with %s", run.rollbacks, tripped_at, run.step, text)


# --------------------------------------------------------------------------------------------
# End
# --------------------------------------------------------------------------------------------
def finish(ctx: Any, run: RunState, ops: RunOps, *, record: bool = True) -> None:
    """Stops the heartbeat and watchdog; rank 0 records the final status (tag ``rlray.status``) unless
    ``record`` is False (the attempt is about to be retried)."""
    if run.watchdog is not None:
        run.watchdog.stop()
    if ctx.rank != 0:
        return
    if run.heartbeat is not None:
        run.heartbeat.stop()
    if run.log_handler is not None:
        logging.getLogger("rlray").removeHandler(run.log_handler)
        run.log_handler.close()
    if not record:
        return
    if run.status == RUNNING:
        run.status = "FAILED"
    try:  # runs on the way out of a failure too: never hide the original error
        ctx.tracker.set_tags({"rlray.status": run.status, "rlray.final_step": str(run.step)})
        ctx.tracker.close(spill_path=snapshots.local_log_path(ctx.cfg, run).with_name(f"mlflow-unsent-{run.run_id}.jsonl"))
        if ops.monitor is not None:
            import ray

            # waiting on it also waits for the alerts sent before (an actor runs one caller's calls in order)
            ray.get(ops.monitor.set_status.remote("stopped", run.status.split(": ", 1)[-1].lower()), timeout=120)
    except Exception as err:
        log.error("could not record the end of run %s: %s", run.run_id, err)
    log.info("run %s ended at step %d: %s", run.run_id, run.step, run.status)
