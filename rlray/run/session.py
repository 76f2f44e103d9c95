"""The session around a learner rank's steps, the same for online and offline runs.

``train`` is the one run loop: restore (a restart, a resume or a PBT exploit), then steps until
``run.max_steps``, a guard or a hook ends the run, then finish. What differs between online and
offline runs is the ``RunContext`` built by the ``build`` function passed in (``rlray.run.online``,
``rlray.run.offline``). A step returns a ``StepResult``; stage 8 of every step (``step_boundary``: eval when
due, guards, log, hooks, snapshot) is here, called by the loop with it.

Every function runs on every learner rank unless it says "rank 0". Ranks agree on each decision
(trip, stop request, snapshot success) through the collective, so they call Ray Train's report and
the collectives the same number of times.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import psutil
import ray
import ray.train
import torch

from rlray import hangs
from rlray.checkpoint import contents, lineage
from rlray.checkpoint import storage as checkpoint
from rlray.checkpoint.manifest import SnapshotManifest
from rlray.learner.collective import Collective, RayTrainCollective
from rlray.observe.monitor import Heartbeat
from rlray.plan import RunPlan, plan_from_tree
from rlray.run import collective_watch, guards, snapshots
from rlray.run.context import RunContext, StepResult
from rlray.run.hooks import StepEnd, StepHook, run_hooks, run_observers
from rlray.run.rank_hangs import hang_action, hang_alert, step_deadline
from rlray.run.state import RUNNING, RunOutcome, RunServices, RunState

log = logging.getLogger(__name__)

BuildContext = Callable[[RunPlan, Collective], RunContext]
"""Builds a rank's ``RunContext`` from the plan in force (called again after an out-of-memory fallback)."""


class FatalStepError(RuntimeError):
    """A step hit an error a retry cannot fix (a reward function returning the wrong number of values,
    bad data, a hang under ``watchdog.on_hang=stop``) on rank 0; raised on every rank with rank 0's message. Ray Train
    does not restart the run. With ``stop_snapshot`` the run first keeps a snapshot of its last finished step."""

    def __init__(self, message: str, *, stop_snapshot: bool = False) -> None:
        super().__init__(message)
        self.stop_snapshot = stop_snapshot


# --------------------------------------------------------------------------------------------
# The run loop
# --------------------------------------------------------------------------------------------
def train(build: BuildContext, plan: RunPlan, coll: Collective, *, run_id: str | None, services: RunServices | None = None,
          hooks: Sequence[StepHook] = ()) -> RunOutcome:
    """Runs steps until ``run.max_steps``, a guard or a hook stops the run; returns how it ended.

    A hook (``rlray.run.hooks``: SIGTERM from ``ray job stop``, Tune's reporter) that asks to stop ends
    the run at that step boundary with a snapshot of the last finished step and status 'stopped: <reason>'.

    An out-of-memory error while loading or in the first step is retried once with half the
    micro-batch and gradient checkpointing on (``guards.oom_fallback_plan``); the change is logged
    and recorded on the MLflow run. With several learner ranks the retry lines up only when every
    rank runs out of memory at the same point; otherwise the collectives fail and Ray Train's restart
    (``monitor.max_failures``) takes over.

    Args:
        build: builds this rank's ``RunContext`` (``rlray.run.online.setup`` or ``rlray.run.offline.setup``).
        plan: the run plan (``rlray.plan.resolve_plan`` of the validated config).
        coll: the learner group's collectives.
        run_id: the MLflow run to log to (created by the driver; None creates one).
        services: the monitor, run control, start time, commit and resume snapshot from the driver.
        hooks: per-step hooks, called on rank 0 at each step boundary (the same list on every rank):
            control hooks before the step's snapshot, observers after it (``rlray.run.hooks``).

    Raises:
        guards.EarlyOOM: out of memory again after the fallback.
        FatalStepError: a step hit an error a restart cannot fix (recorded: tag rlray.error, the outcome).
    """
    services = services or RunServices()
    in_ray_train = isinstance(coll, RayTrainCollective)
    source, restarted = restore_source(plan, services, run_id, in_ray_train) if run_id else (services.resume_from, False)
    plan = restart_delay(plan, coll, services, source, restarted)
    try:
        return _train(build, plan, coll, services, source, hooks)
    except guards.EarlyOOM as oom:
        plan, note = guards.oom_fallback_plan(plan)
        log.warning("out of memory at %s; retrying once with %s", oom.where, note)
        guards.free_memory()
        return _train(build, plan, coll, services, source, hooks, oom_note=f"{oom.where}: {note}")


def _train(build: BuildContext, plan: RunPlan, coll: Collective, services: RunServices, source: str | None,
           hooks: Sequence[StepHook], oom_note: str | None = None) -> RunOutcome:
    guards.apply_gpu_memory_cap(plan.settings.guard)
    in_ray_train = isinstance(coll, RayTrainCollective)  # asked before the wrapping below
    coll = collective_watch.watch(coll, plan.deadlines.collective_s, plan.deadlines.stacks_timeout_s)
    ctx = _early_oom("load", lambda: build(plan, coll))
    if ctx.rank == 0 and oom_note:
        ctx.tracker.set_tags({"rlray.oom_fallback": oom_note})
        ctx.tracker.log_text(ctx.plan.to_yaml(), "config/oom_fallback.yaml")
    run = begin(ctx, services, source, in_ray_train=in_ray_train)
    metrics: dict[str, float] = {}
    retrying, error = False, ""

    deadline = step_deadline(ctx, run, services)
    if isinstance(coll, collective_watch.WatchedCollective):  # each timed collective's own deadline (watchdog.collective_s)
        coll.start(hang_alert(ctx, run, services), hang_action(ctx, run, services))

    def one_step() -> dict[str, float]:  # stages 1-7 of the run's kind, then stage 8 here
        deadline.arm(run.step + 1)
        result = ctx.run_step(run.step)
        step_boundary(ctx, run, services, hooks, result)
        deadline.disarm()
        return result.metrics

    try:
        if run.step == 0:
            first, hang = evaluate_or_hang(ctx, lambda: ctx.start_metrics())
            hang = ctx.coll.broadcast(hang)  # once a run: every rank stops together when rank 0's evaluation hung
            if hang is not None:
                raise FatalStepError(hang)  # nothing trained yet: no snapshot to keep
            if ctx.rank == 0 and first:
                ctx.tracker.log_metrics(first, step=0)
        while run.step < ctx.plan.max_steps and run.status == RUNNING:
            metrics = _early_oom("first step", one_step) if run.step == run.first_step else one_step()
        if run.status == RUNNING:
            run.status = "FINISHED"
    except guards.EarlyOOM:
        retrying = True
        raise
    except FatalStepError as err:
        error = str(err)
        if ctx.rank == 0:
            log.error("the run stops at step %d: %s", run.step + 1, err)
            ctx.tracker.set_tags({"rlray.error": error[:5000]})
            snapshots.alert(ctx, services, "run_failed", f"the run stops: {error[:2000]}", run.step + 1)
        # every rank: a snapshot of the last finished step, unless it has one (due) or was restored from it
        if err.stop_snapshot and run.step > run.first_step and not snapshots.snapshot_due(ctx.plan, run.step):
            snapshots.snapshot(ctx, run, services, kind="stop", metrics={})
        raise
    finally:
        deadline.disarm()
        if isinstance(coll, collective_watch.WatchedCollective):
            coll.stop()
        finish(ctx, run, services, record=not retrying)
        if not retrying and ctx.rank == 0 and services.control is not None:
            outcome = RunOutcome(run.status, run.step, run.last_snapshot, error, dict(metrics))
            ray.get(services.control.record_outcome.remote(outcome))
        ctx.close()
    coll.barrier()
    return RunOutcome(run.status, run.step, run.last_snapshot, error, metrics)


def _early_oom(where: str, fn: Callable[[], Any]) -> Any:
    """Returns ``fn()``; an out-of-memory error becomes ``guards.EarlyOOM`` (retried once by ``train``)."""
    try:
        return fn()
    except Exception as err:
        if guards.is_oom(err):
            raise guards.EarlyOOM(where, err) from err
        raise


def step_boundary(ctx: RunContext, run: RunState, services: RunServices, hooks: Sequence[StepHook],
                  result: StepResult) -> None:
    """Stage 8 of a step, on every rank: eval when due, guards, log once (the result's metrics and rank 0's kept
    samples), the step's prompt ledger (rank 0 of online runs), a progress line, hooks, snapshot.

    The progress line goes to this process's output (its Ray log file); the console's one bar is drawn by the
    driver from what ``record`` sent to the monitor (``rlray.launch.console.DriverProgress``).

    ``run.step`` counts the step just done. Rank 0's control hooks may ask to stop; the decision is
    broadcast so every rank leaves the loop at this boundary. Observer hooks see the snapshot written here.
    """
    run.step += 1
    metrics = result.metrics
    evaluated, hang = evaluate_or_hang(ctx, lambda: ctx.evaluate_when_due(run.step))
    metrics.update(evaluated)
    trip = check_guards(ctx, run, metrics, services, hang)
    if trip is not None and trip.reason == "hang":  # every rank: the step is kept, then the run stops FAILED
        if ctx.rank == 0:
            record(ctx, run, result, services)
        snapshots.snapshot(ctx, run, services, kind="stop", metrics=metrics)
        raise FatalStepError(trip.message)
    stop_reason = None
    if ctx.rank == 0:
        record(ctx, run, result, services)
        print(ctx.progress_text(run.step, metrics), flush=True)  # one plain line per step, in this worker's log file
        stop_reason = run_hooks(hooks, StepEnd(run.step, ctx.plan.max_steps, dict(metrics)))
    if hooks:  # every rank leaves together at this step boundary when rank 0's hooks asked to stop
        stop_reason = ctx.coll.broadcast(stop_reason)
    written = snapshot_or_stop(ctx, run, services, trip, stop_reason, metrics)
    if ctx.rank == 0:
        run_observers(hooks, StepEnd(run.step, ctx.plan.max_steps, dict(metrics), snapshot=written))


def evaluate_or_hang(ctx: RunContext, evaluate: Callable[[], dict[str, float]]) -> tuple[dict[str, float], str | None]:
    """Returns (``evaluate()``'s metrics, None), or ({}, the report) when it raised ``HangError`` (rank 0's evaluation
    hung under ``watchdog.on_hang=stop``, or met a weight push that hung so), which every rank then stops on together."""
    try:
        return evaluate(), None
    except hangs.HangError as err:
        log.error("rank %d: evaluation hung under watchdog.on_hang=stop; the run stops", ctx.rank)
        return {}, f"HangError in evaluation: {err}"


def restart_delay(plan: RunPlan, coll: Collective, services: RunServices, source: str | None, restarted: bool) -> RunPlan:
    """Counts this learner start with the monitor (a second start is a restart, alerted), waits
    ``monitor.restart_delay_s`` after a restart, and returns the plan to run: restoring this run's own
    snapshot (``restarted``, the same on every rank) adopts the config it was trained with; a snapshot
    the run was started from (``checkpoint.resume_from``, a PBT exploit) keeps ``plan``, on every start."""
    cfg = plan.settings
    restart = restarted
    if coll.rank == 0 and services.monitor is not None:
        restart = ray.get(services.monitor.learner_started.remote()) > 1 or restarted
    if restart:
        log.warning("learner restarted; waiting monitor.restart_delay_s=%g s before resuming", cfg.monitor.restart_delay_s)
        time.sleep(cfg.monitor.restart_delay_s)
    return plan_for_restore(plan, source, restarted)


# --------------------------------------------------------------------------------------------
# Start
# --------------------------------------------------------------------------------------------
def restore_source(plan: RunPlan, services: RunServices, run_id: str, in_ray_train: bool) -> tuple[str | None, bool]:
    """Returns (snapshot URI to restore or None, True when it is one of this run's own snapshots).

    Inside Ray Train: a checkpoint Ray hands over from another run's folder wins; like
    ``services.resume_from`` it is a start from that snapshot, not a restart (the config as given, e.g. a
    PBT trial's mutated values, stays in force). Otherwise a complete snapshot in this run's own
    folder means the learner was restarted: the newest one wins, even one Ray Train never registered
    (its ``ray.train.report`` was cut off by the failure, or the controller had not taken it in yet;
    ``begin`` reports it again so Ray's bookkeeping catches up). Without either, ``services.resume_from``.
    """
    cfg = plan.settings
    if in_ray_train:
        run_dir = checkpoint.join(plan.snapshots.uri, checkpoint.run_dir_name(run_id))
        ckpt = ray.train.get_checkpoint()
        parent, name = ckpt.path.rstrip("/").rsplit("/", 2)[-2:] if ckpt is not None else (None, None)
        if ckpt is not None and parent != checkpoint.run_dir_name(run_id):
            return _uri_of(ckpt), False
        newest = checkpoint.latest_snapshot(run_dir, cfg.checkpoint.s3.storage_options())
        if newest or ckpt is not None:
            return newest or checkpoint.join(run_dir, name), True
    return services.resume_from, False


def _uri_of(ckpt: Any) -> str:
    """Returns the fsspec URI of a Ray Train checkpoint (a local path, or the URI of its fsspec filesystem)."""
    handler = getattr(ckpt.filesystem, "handler", None)
    fs = getattr(handler, "fs", None)
    return fs.unstrip_protocol(ckpt.path) if fs is not None and "file" not in fs.protocol else ckpt.path


def plan_for_restore(plan: RunPlan, source: str | None, restarted: bool) -> RunPlan:
    """Returns the plan to build the learner with: when ``source`` is this run's own snapshot (``restarted``,
    a Ray Train restart), the trained sections come from it (a rollback or OOM fallback may have changed
    them; ``rlray.plan.resolve_plan`` of the adopted config); otherwise ``plan`` as given (a resume or a PBT
    exploit: the user's or the mutated values win)."""
    if source is None or not restarted:
        return plan
    stored = contents.snapshot_config(source, plan.settings.checkpoint.s3.storage_options())
    return plan_from_tree(contents.adopt_trained_tree(plan.source, stored))


def begin(ctx: RunContext, services: RunServices, source: str | None, *, in_ray_train: bool) -> RunState:
    """Restores ``source`` (when given) on every rank, pushes the policy to the rollouts, starts rank 0's
    heartbeat and every rank's memory watchdog, and sends every rank's hang reports to the alerts; returns the run's
    state."""
    cfg = ctx.settings
    run_id = ctx.coll.broadcast(ctx.tracker.run_id if ctx.rank == 0 else None)
    opts = cfg.checkpoint.s3.storage_options()
    run = RunState(run_id, checkpoint.join(ctx.plan.snapshots.uri, checkpoint.run_dir_name(run_id)), opts, in_ray_train)
    if source is not None:
        manifest = _restore(ctx, run, source)
        run.step = run.first_step = manifest.step
        run.rollbacks = manifest.rollbacks
        run.last_snapshot = source
        run.source = (run.step, source)
        if in_ray_train and source.startswith(run.run_dir + "/") and not snapshots.known_to_ray(source):
            snapshots.report(run, {}, ctx.rank, name=source.rsplit("/", 1)[-1])  # its report was cut off by the failure
    ctx.reload_rollouts()  # the engines may hold newer weights (a restart) or other ones (a resume)
    if not torch.cuda.is_available():
        cap = guards.memory_cap_bytes(cfg.guard, cuda=False)
        run.watchdog = guards.MemoryWatchdog(cap, cfg.guard.memory_check_s, ctx.rank).start()
    ctx.watch_hangs(hang_alert(ctx, run, services))  # every rank: its calls past their deadline reach the alerts
    if ctx.rank == 0:
        _begin_rank0(ctx, services, run, source)
    return run


def _restore(ctx: RunContext, run: RunState, uri: str) -> SnapshotManifest:
    manifest = contents.restore_learner(uri, learner=ctx.learner, rank=ctx.rank, options=run.options)
    contents.set_optimizer_hparams(ctx.learner, ctx.settings.learner)
    ctx.policy_version = manifest.policy_version
    ctx.load_cursor_state(manifest.data_cursor)  # rank 0 online; every rank offline (each walks the same cursor)
    in_flight = contents.read_in_flight(uri, manifest, run.options) if ctx.rank == 0 else None
    if in_flight is not None:  # async: the steps in flight train on the samples an uninterrupted run trains them on
        ctx.load_in_flight_rollouts(in_flight)
    log.info("rank %d restored snapshot %s (step %d, policy version %d)", ctx.rank, uri, manifest.step, ctx.policy_version)
    return manifest


def _begin_rank0(ctx: RunContext, services: RunServices, run: RunState, source: str | None) -> None:
    tracker, plan = ctx.tracker, ctx.plan
    tracker.set_tags({"rlray.snapshot_dir": run.run_dir, "rlray.status": RUNNING, "rlray.git_commit": services.git_commit})
    run.logged_through = tracker.last_logged_step()
    if source is not None:
        run.model_version = lineage.version_of(plan.tracking.mlflow_uri, plan.tracking.experiment, source)
        if run.model_version is None:  # written, but the process died before registering it: keep the chain whole
            manifest = checkpoint.read_manifest(source, run.options, verify=False)
            run.model_version = lineage.register(tracker, plan.tracking.experiment, source, manifest, manifest.metrics)
        tracker.set_tags({"rlray.restored_from": source})
        tracker.log_metrics({"run/restored_step": float(run.step)}, step=run.step)
    run.log_handler = _attach_log_file(ctx.plan, run)
    started = time.time()

    def beat() -> None:
        rss = psutil.Process().memory_info().rss / guards.GIB
        log.info("heartbeat run=%s step=%d epoch=%d policy_version=%d rss_gib=%.2f", run.run_id, run.step,
                 ctx.data_epoch(), ctx.policy_version, rss)
        tracker.log_metrics({"monitor/heartbeat_s": time.time() - started, "monitor/rss_gib": rss}, step=run.step)
        if services.monitor is not None:
            services.monitor.beat.remote(run.step, ctx.data_epoch(), ctx.policy_version)

    run.heartbeat = Heartbeat(beat, plan.settings.monitor.heartbeat_s).start()


def _attach_log_file(plan: RunPlan, run: RunState) -> logging.Handler:
    """Adds a file handler for rlray's log lines of this run (copied to <checkpoint uri>/logs at snapshots)."""
    path = snapshots.local_log_path(plan, run)
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
def check_guards(ctx: RunContext, run: RunState, metrics: dict[str, float], services: RunServices,
                 hang: str | None = None) -> guards.Trip | None:
    """Returns the guard the step trips (the same on every rank), or None; counts non-finite steps. Rank 0's ``hang``
    (``evaluate_or_hang``) trips "hang", which the step boundary turns into a stop after a snapshot."""
    finite = guards.is_finite_step(metrics)
    run.nonfinite_in_row = 0 if finite else run.nonfinite_in_row + 1
    if not finite:
        log.error("step %d: non-finite loss or gradient norm; the update was skipped", run.step)
    memory = run.watchdog.message if run.watchdog else None
    flags = ctx.coll.all_reduce_sum({"memory": float(memory is not None)})
    if flags["memory"] and memory is None:
        memory = "another learner rank exceeded the memory cap"
    trip = None
    if ctx.rank == 0 and hang is not None:
        trip = guards.Trip("hang", hang, keep_state=True)
    elif ctx.rank == 0:
        trip = guards.check_step(metrics, step=run.step, nonfinite_in_row=run.nonfinite_in_row, guard=ctx.settings.guard,
                                elapsed_s=time.time() - services.started_at, max_wall_time_s=ctx.settings.run.max_wall_time_s,
                                memory_message=memory)
        metrics["guard/nonfinite_in_row"] = float(run.nonfinite_in_row)
        metrics["run/rollbacks"] = float(run.rollbacks)
    return ctx.coll.broadcast(trip)


def record(ctx: RunContext, run: RunState, result: StepResult, services: RunServices) -> None:
    """Rank 0: logs the step's metrics and kept samples (once per step, across restarts), the step's prompt ledger
    (every time the step runs, so a step run again after a restart or rollback replaces its own file and only the
    steps that survive count; ``Tracker.log_ledger``), sends the step's alerts (failures, no signal: the driver's
    console prints them) and updates the monitor (its page's curves and sample viewer)."""
    metrics, samples = result.metrics, result.samples
    for alert in result.alerts:
        snapshots.alert(ctx, services, alert.kind, alert.message, run.step)
    if result.prompt_ids is not None:
        ctx.tracker.log_ledger(list(result.prompt_ids), step=run.step)
    if run.step > run.logged_through:
        metrics["monitor/mlflow_outages"] = float(ctx.tracker.take_outages())
        ctx.tracker.log_metrics(metrics, step=run.step)
        ctx.tracker.log_samples(list(samples), step=run.step)
        run.logged_through = run.step
    if services.monitor is not None:
        services.monitor.record_step.remote(run.step, ctx.data_epoch(), ctx.policy_version, metrics)
        if samples:
            services.monitor.record_samples.remote(run.step, list(samples))


def handle_trip(ctx: RunContext, run: RunState, trip: guards.Trip, services: RunServices) -> None:
    """Rolls back (``guard.on_trip=rollback``, within ``guard.max_rollbacks``, with a good snapshot to
    return to) or stops the run with status 'stopped: <reason>'; alerts and tags either way."""
    g = ctx.settings.guard
    target = None
    if trip.reason == "kl_guard" and g.on_trip == "rollback" and run.rollbacks < g.max_rollbacks:
        target = ctx.coll.broadcast(last_good_snapshot(run) if ctx.rank == 0 else None)
    if ctx.rank == 0:
        what = f"rolling back to {target}" if target else "stopping"
        if trip.reason == "wall_time":  # a planned end, not a fault
            what = "stopping with a snapshot of this step: the run's time budget is spent (MLflow status FINISHED)"
        snapshots.alert(ctx, services, "guard_trip", f"{trip.reason}: {trip.message}; {what}", run.step)
    if target:
        rollback(ctx, run, target)
        return
    if trip.keep_state:
        snapshots.snapshot(ctx, run, services, kind="stop", metrics={})
    run.status = f"stopped: {trip.reason}"
    if ctx.rank == 0:
        ctx.tracker.set_tags({"rlray.stop_reason": trip.reason, "rlray.stop_step": str(run.step),
                              "rlray.stop_message": trip.message})


def snapshot_or_stop(ctx: RunContext, run: RunState, services: RunServices, trip: guards.Trip | None,
                     stop_reason: str | None, metrics: dict[str, float]) -> str | None:
    """The end of stage 8, the same for online and offline runs; returns the snapshot written, or None.

    A tripped guard is handled (stop or rollback, ``handle_trip``). Otherwise a hook's stop request before
    the last step writes a "stop" snapshot and ends the run with status 'stopped: <reason>' (MLflow tags
    rlray.stop_reason and rlray.stop_step); otherwise a due snapshot ("periodic", or "final" after the last
    step) is written. Every rank calls it with the same ``trip`` and ``stop_reason``.

    Raises:
        rlray.checkpoint.SnapshotError: a snapshot could not be written (the previous one is intact).
    """
    if trip is not None:
        handle_trip(ctx, run, trip, services)
        return None
    if stop_reason and run.step < ctx.plan.max_steps:
        written = snapshots.snapshot(ctx, run, services, kind="stop", metrics=metrics)
        run.status = f"stopped: {stop_reason}"
        if ctx.coll.rank == 0:
            ctx.tracker.set_tags({"rlray.stop_reason": stop_reason, "rlray.stop_step": str(run.step)})
        return written
    if snapshots.snapshot_due(ctx.plan, run.step):
        kind = "final" if run.step == ctx.plan.max_steps else "periodic"
        return snapshots.snapshot(ctx, run, services, kind=kind, metrics=metrics)
    return None


def last_good_snapshot(run: RunState) -> str | None:
    """Rank 0: returns the newest complete snapshot that a KL trip at ``run.step`` does not implicate, or None.

    The KL measured in step k is that of the policy after step k-1's update, so a trip at step k
    condemns the snapshot of step k-1; the last good one was taken at step k-2 or earlier (this run's,
    or the snapshot it was resumed from).
    """
    limit = run.step - 2
    found = [(s.step, s.manifest.written_at, s.uri) for s in checkpoint.list_snapshots(run.run_dir, run.options)
             if s.complete and s.step <= limit]
    if run.source and run.source[0] <= limit:
        found.append((run.source[0], 0.0, run.source[1]))
    return max(found)[2] if found else None


def rollback(ctx: RunContext, run: RunState, target: str) -> None:
    """Restores the snapshot ``target`` with ``guard.rollback_overrides`` applied, and continues from it.

    The config change is recorded as a new config artifact and tags (never as a changed param); the
    steps that run again are logged again.
    """
    new_plan, changes = guards.rollback_plan(ctx.plan)
    tripped_at = run.step
    ctx.adopt_plan(new_plan)  # online rank 0 rebuilds its reward client when reward.* changed
    manifest = _restore(ctx, run, target)
    run.step = manifest.step
    run.rollbacks += 1
    run.nonfinite_in_row = 0
    run.logged_through = min(run.logged_through, run.step)
    ctx.reload_rollouts()
    if ctx.rank == 0:
        text = ", ".join(f"{k}: {old} -> {new}" for k, (old, new) in changes.items())
        ctx.tracker.log_text(new_plan.to_yaml(), f"config/rollback_{run.rollbacks}.yaml")
        ctx.tracker.set_tags({f"rlray.rollback.{run.rollbacks}": f"step {tripped_at} -> step {run.step}; {text}",
                              "rlray.rollbacks": str(run.rollbacks), "rlray.config_hash_now": new_plan.config_hash})
        run.model_version = lineage.version_of(new_plan.tracking.mlflow_uri, new_plan.tracking.experiment, target)
        log.warning("rollback %d: step %d -> snapshot step %d with %s", run.rollbacks, tripped_at, run.step, text)


# --------------------------------------------------------------------------------------------
# End
# --------------------------------------------------------------------------------------------
def finish(ctx: RunContext, run: RunState, services: RunServices, *, record: bool = True) -> None:
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
        ctx.tracker.close(spill_path=snapshots.local_log_path(ctx.plan, run).with_name(f"mlflow-unsent-{run.run_id}.jsonl"))
        if services.monitor is not None:
            # waiting on it also waits for the alerts sent before (an actor runs one caller's calls in order)
            ray.get(services.monitor.set_status.remote("stopped", run.status.split(": ", 1)[-1].lower()), timeout=120)
    except Exception as err:
        log.error("could not record the end of run %s: %s", run.run_id, err)
    log.info("run %s ended at step %d: %s", run.run_id, run.step, run.status)
