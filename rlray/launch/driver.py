"""The driver: starts Ray, checks the resources, starts every role and owns the MLflow run.

``rlray train``, ``jobs/train.py`` and sweeps call ``run_training``. The run loop itself runs inside
the Ray Train training function (``rlray.run.worker.train_worker``); this module only wires it up. It takes a run plan,
or a config that it resolves once (``rlray.plan.paths.resolve_paths``, then ``rlray.plan.resolve_plan``), and every
role is started from that run plan (issue 38):

0. check every input (model, tokenizer, data, reward functions, snapshot storage; ``rlray.launch.preflight``)
   and build the step hooks of ``run.hooks`` (``rlray.run.hooks.load_step_hooks``) before Ray or MLflow start
   (MLflow and its SQL store modules are imported while Ray starts; the store and the run once the resources fit;
   the rest of what this module needs after that is imported where it is used: issue 39),
1. check that every role's resources fit the cluster (before any actor starts),
2. the rollout actors on the nodes a released placement group chose (rlray:rollout-<i>), asked for as soon as the
   resources fit, so that their engines load beside MLflow's start and the other roles' (issue 39),
3. the reward Serve application rlray-reward (when reward.server.enabled) and one Serve application per judge,
   rlray-judge-<name> (when reward.judges is set; ``rlray.launch.judges``),
4. the reference actor rlray:reference-0 (when resources.reference.placement == "actor") and the teacher actor
   rlray:teacher-0 (when teacher.path is set and resources.teacher.placement == "actor"),
5. the Ray Train TorchTrainer (DDP or FSDP over resources.learner.num_workers workers).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from rlray.checkpoint import storage as checkpoint
from rlray.data import load_prompt_rows, prepare_prompts
from rlray.launch import console, ray_setup
from rlray.launch.judges import deploy_judges, judge_apps
from rlray.launch.placement import bundle, check_cluster, rollout_nodes
from rlray.launch.preflight import preflight
from rlray.launch.ray_setup import RayInfo, embedded_ray_env, init_ray, worker_env  # noqa: F401 - re-exported
from rlray.models import load_tokenizer, resolve_model_path
from rlray.observe.startup import StartupClock, startup_summary
from rlray.observe.tracking_store import start_store_imports
from rlray.plan import RunPlan, resolve_plan
from rlray.plan.paths import resolve_paths
from rlray.plan.settings import Settings
from rlray.rollout import RolloutSource
from rlray.run.hooks import StepHook, StopWhenRequested, load_step_hooks
from rlray.run.state import RunServices, WorkerArgs

if TYPE_CHECKING:
    from rlray.rollout.fleet import RolloutFleet

# Imported where they are used, after Ray has started (issue 39): Ray Train, MLflow (rlray.observe.tracking, whose
# import runs beside ray.init in start_store_imports' thread), the actors and the learner's modules
# (rlray.launch.actors, rlray.run.*) are none of the checks' business, and cost ~3 s of CPU before the first step.

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """Outcome of a run: the MLflow run id, the resolved tracking URI, the last complete snapshot's URI,
    the status (FINISHED, FAILED, KILLED, or 'stopped: <reason>' when a guard stopped it), the
    monitor's URL, when a step hit an error a restart cannot fix its message, the log folder and where the time
    went before the first step and after the last (``startup/<phase>_s`` seconds; ``rlray.observe.startup``)."""

    run_id: str
    tracking_uri: str
    final_snapshot: str
    status: str
    monitor_url: str = ""
    error: str = ""
    log_dir: str = ""
    startup: dict[str, float] = field(default_factory=dict)


def max_model_len(cfg: Settings) -> int:
    """Returns the engine's context length in tokens: the plan's ``lengths.context_tokens`` (longest prompt plus the
    longest generation; with environments at least the longest episode)."""
    return resolve_plan(cfg).lengths.context_tokens


def start_reward_server(plan: RunPlan) -> bool:
    """Deploys (or updates in place) the reward Serve application of ``plan`` and waits until it serves.

    Serve's HTTP proxy binds reward.server.host:port (127.0.0.1 by default); ``POST /score`` works
    for outside tools. Deploying again with a new reward.version hot-swaps the scorer.

    Returns:
        True when this call created the application, False when it updated a running one.
    """
    # deferred: Ray Serve's import takes seconds and only runs with reward.server.enabled need it
    from ray import serve

    from rlray.reward.server import build_reward_app, deploy_reward_app
    from rlray.run import build

    srv, res = plan.settings.reward.server, plan.roles.reward
    existed = srv.app_name in serve.status().applications  # empty when Serve has not started
    app = build_reward_app(
        scorer_kwargs=build.scorer_kwargs(plan.settings),
        version=plan.reward.version,
        replicas=res.count,
        cpus=res.cpus,
        gpus=res.gpus,
        custom_resources=dict(res.custom),
        max_batch_size=srv.max_batch_size,
        batch_wait_timeout_s=srv.batch_wait_timeout_s,
        timeout_s=srv.timeout_s,
    )
    deploy_reward_app(app, name=srv.app_name, host=srv.host, port=srv.port)
    return not existed


def learner_trainer(plan: RunPlan, args: WorkerArgs) -> Any:
    """Returns the Ray Train ``TorchTrainer`` of the learner group: snapshots as its checkpoints, restarts by FailureConfig.

    Ray Train's storage is ``checkpoint.uri`` (s3fs for ``s3://``), its run name ``run-<run_id>``,
    ``keep_last`` its ``num_to_keep`` and ``monitor.max_failures`` its ``max_failures``; workers use
    ``resources.learner`` (its custom resources too) under ``resources.placement_strategy``. Offline methods train on preference
    pairs in the same run loop (``rlray.run.worker`` picks the kind).
    """

    from ray.train import CheckpointConfig as RayCheckpointConfig
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from rlray.launch.trainer import LearnerTrainer
    from rlray.run import worker

    res, snaps = plan.roles.learner, plan.snapshots
    storage_path, storage_fs = checkpoint.ray_storage(snaps.uri, plan.settings.checkpoint.s3.storage_options())
    return LearnerTrainer(
        worker.train_worker,
        train_loop_config={"args": args},
        scaling_config=ScalingConfig(
            num_workers=res.count,
            use_gpu=plan.parallelism.gpu,
            resources_per_worker=bundle(res.cpus, res.gpus, dict(res.custom)),
            placement_strategy=plan.roles.placement_strategy,
        ),
        run_config=RunConfig(
            name=checkpoint.run_dir_name(args.run_id),
            storage_path=storage_path,
            storage_filesystem=storage_fs,
            checkpoint_config=RayCheckpointConfig(num_to_keep=snaps.keep_last),
            failure_config=FailureConfig(max_failures=plan.settings.monitor.max_failures),
        ),
    )


def run_training(
    run: RunPlan | Settings, *, step_hooks: Sequence[StepHook] = (), tags: dict[str, str] | None = None,
    verbose: bool | None = None, ray_start: ray_setup.RayStart | None = None,
) -> TrainResult:
    """Runs a whole training job and returns its result.

    Starts the monitor (/health on ``monitor.port``) and the rollout actors, then a Ray Train
    ``TorchTrainer`` whose checkpoints are rlray's snapshots under ``checkpoint.uri``; learner
    failures are restarted from the latest snapshot (``monitor.max_failures``). SIGTERM (``ray job
    stop``) on the driver's main thread asks the run to stop at the next step boundary, with a
    snapshot of the last finished step. The MLflow run ends FINISHED (also when ``run.max_wall_time_s`` stopped it),
    KILLED (a guard, SIGTERM or a hook stopped it; tags ``rlray.status`` and ``rlray.stop_reason`` say which) or FAILED.

    The console (``rlray.launch.console``): start lines (MLflow run, live page, dashboard, snapshot and log
    folders), the driver's progress bar when ``verbose`` is given, and last lines naming the log folder
    ``<run.output_dir>/logs/<run id>`` (``driver.log``, and Ray's log files of the run copied to ``ray/``).

    Args:
        run: the run plan, taken as it is (resolve it with ``resolve_plan(resolve_paths(cfg))``: Ray's workers may run
            in another folder), or a validated config, whose paths are resolved here (``rlray.plan.paths.resolve_paths``)
            and whose plan then decides (``rlray.plan.resolve_plan``).
        step_hooks: extra per-step hooks run on learner rank 0 (``rlray.run.hooks``; Tune's reporter), after
            those of ``run.hooks``.
        tags: extra MLflow tags of the run (a sweep sets ``mlflow.parentRunId``).
        verbose: ``rlray train``'s console: False keeps other processes' output in their log files (Ray's log
            forwarding off) and draws the progress bar; True forwards everything and draws the bar; None (a
            library call, a sweep trial) changes neither forwarding nor draws a bar.
        ray_start: Ray's start, begun by the caller (``rlray train`` begins it before importing this module, so that
            Ray comes up beside those imports); None: begun here, before the input checks, which run beside it. A
            run whose inputs fail the checks shuts the Ray started for it down again (``RayStart.cancel``) and starts
            no actor.

    Raises:
        rlray.models.ModelError, rlray.data.DataError, rlray.reward.RewardFunctionError,
            rlray.checkpoint.storage.SnapshotError: an input of the run is unusable (``rlray.launch.preflight``; no actor
            was started, and the Ray started beside the checks is shut down).
        rlray.config.ConfigError: a ``run.hooks`` entry cannot be loaded or built (as above).
        rlray.launch.placement.PlacementError: the resources do not fit the cluster (nothing was started).
        ray.train.TrainingFailedError: learner workers failed more than ``monitor.max_failures`` times (not when a
            rank ended the run for a hang under ``watchdog.on_hang=stop``: that run ends FAILED, its report the error).
        rlray.checkpoint.storage.SnapshotError: ``checkpoint.resume_from`` names no complete snapshot.
        OSError: ``monitor.port`` is taken.
    """
    started_at = time.time()
    clock = StartupClock(started_at)
    if verbose is not None:  # rlray train's console: libraries imported since configure_console (MLflow) set up their
        console.route_library_logs()  # loggers again; before Ray starts and before the first MLflow call
    if ray_start is None:  # Ray comes up beside the checks (issue 39); nothing is started when it runs already
        ray_start = ray_setup.RayStart(log_to_driver=verbose is not False)
    with clock.phase("checks"):
        try:
            plan = run if isinstance(run, RunPlan) else resolve_plan(resolve_paths(run))
            cfg = plan.settings
            model_dir = preflight(plan)
            user_hooks = load_step_hooks(plan)
        except BaseException:
            ray_start.cancel()  # bad input: the Ray started for this run goes again, and no actor was asked for
            raise
        roles = plan.roles
        teacher_dir = resolve_model_path(cfg.teacher.path) if roles.teacher != "off" else None  # preflight checked it
    with clock.phase("ray"):  # the rest of Ray's start (MLflow and its SQL store imported beside it), then the
        # rollout actors asked for: their engines load beside MLflow's start (issue 39)
        store = start_store_imports()
        ray_info = ray_start.result()
        check_cluster(plan)
        # keeps actor names of concurrent runs (sweep trials) apart; the MLflow tag rlray.namespace names it
        namespace = f"rlray-{uuid.uuid4().hex}"
        early = launch_rollout(plan, model_dir, namespace) if roles.online else []
    try:
        tracker, services, run_dir = open_tracking(clock, plan, store, model_dir, namespace, tags, verbose, started_at)
    except BaseException:
        from rlray.launch.actors import kill_actors

        kill_actors([one.handle for one in early])
        raise
    tracking = plan.tracking
    log.info("MLflow run %s in %s", tracker.run_id, tracking.mlflow_uri)
    log_dir = Path(cfg.run.output_dir, "logs", tracker.run_id)
    log_file = console.keep_logs(log_dir) if "://" not in cfg.run.output_dir else None
    actors, reference, teacher, own_app, env_hosts, own_judges = [one.handle for one in early], None, None, False, [], []
    status, outcome, url, progress, started, learner_times, watch = "FAILED", None, "", None, {}, None, None
    control = None  # the monitor actor, which also holds the run's stop flag and outcome (``RunControl``)
    try:
        with clock.phase("actors"):  # every actor asked for at once, waited on together (issue 39)
            from rlray.launch.actors import (
                StartWatch,
                launch_env_hosts,
                launch_reference_actor,
                wait_started,
            )
            from rlray.launch.monitor_actor import launch_monitor, monitor_port

            monitor = launch_monitor(plan, tracker.run_id)
            services.monitor = control = services.control = monitor.handle
            launched = [monitor]
            if roles.online:  # offline methods train on preference pairs: no rollout actors (asked for above)
                launched += early
                hosts = launch_env_hosts(plan, namespace=namespace, model_dir=model_dir,
                                         log_dir=log_dir if log_file is not None else None)
                env_hosts, launched = [one.handle for one in hosts], launched + hosts
            if roles.reference == "actor":
                launched.append(launch_reference_actor(plan, model_dir, namespace=namespace))
                reference = launched[-1].handle
            if roles.online and roles.teacher == "actor":
                launched.append(launch_reference_actor(plan, teacher_dir, namespace=namespace, role="teacher"))
                teacher = launched[-1].handle
            port = monitor_port(monitor)  # the page first: the start lines name it while the engines load
            url = f"http://{cfg.monitor.host}:{port}"
            tracker.set_tags({"rlray.monitor_url": url, "rlray.log_dir": str(log_dir)})
            print("\n".join(console.start_lines(
                run_id=tracker.run_id, tracking_uri=tracking.mlflow_uri, monitor_url=url,
                dashboard_url=ray_info.dashboard_url, snapshot_dir=run_dir, log_dir=str(log_dir),
                verbose=verbose is not False)), flush=True)
            if verbose is not None:
                handle = monitor.handle
                budget_s = cfg.run.max_wall_time_s - (time.time() - started_at)  # counted from the driver's start
                progress = console.DriverProgress(plan.max_steps, lambda: ray.get(handle.progress.remote(), timeout=30),
                                                  ends_by=time.monotonic() + budget_s).start()
            if roles.reward_server:  # Serve deploys while the actors load
                own_app = start_reward_server(plan)
            if roles.judges:
                own_judges = deploy_judges(plan)
            watch = StartWatch().watch(launched[1:])  # the learner group starts beside the engines (main thread)
            started = wait_started(launched[:1])
        trainer = learner_trainer(plan, WorkerArgs(
            config=plan.source,  # python mode: SecretStr values travel, and are never logged
            model_dir=model_dir,
            run_id=tracker.run_id,
            rollout_actors=actors,
            reference_actor=reference,
            teacher_dir=teacher_dir,
            teacher_actor=teacher,
            env_hosts=env_hosts,
            services=services,
            step_hooks=[StopWhenRequested(control), *user_hooks, *step_hooks],
        ))
        clock.stamp("fit_start")
        try:
            with stop_on_sigterm(control):
                try:
                    trainer.fit()
                except ray.train.TrainingFailedError:  # a rank that ended the run for a hang exited: no retry left
                    if ray.get(control.failure.remote()) is None:
                        raise
        finally:
            watch.disarm()
            watch.raise_failure()  # an actor that failed to start stopped fit: its error is the run's
        clock.stamp("fit_end")
        watch.disarm(timeout_s=30)
        started.update(watch.started)
        if progress is not None:
            progress.close()  # one last poll while the monitor lives: a finished run's bar ends at 100%
        outcome = ray.get(control.outcome.remote())
        status = outcome.status if outcome is not None else "FAILED"
        if ray.get(control.failure.remote()) is not None:  # the rank that ended it could not tag the MLflow run
            tracker.set_tags({"rlray.error": outcome.error[:5000]})
        learner_times = ray.get(services.monitor.learner_startup.remote())
    except KeyboardInterrupt:
        if watch is not None and watch.error is not None:  # an actor's start failure interrupted fit
            raise watch.error from None
        status = "KILLED"
        raise
    finally:
        if watch is not None:
            watch.disarm()  # the start watch's signal handler goes, whatever ended the run
        if progress is not None:
            progress.close()
        # a sweep closes a stopped trial's run as KILLED before its process dies; the dying run keeps that
        tracker.finish_unless_ended(_mlflow_status(status), {"rlray.status": status})
        monitor = [services.monitor] if services.monitor is not None else []
        from rlray.launch.actors import kill_actors

        kill_actors([*actors, *env_hosts, *[a for a in (reference, teacher) if a is not None], *monitor])
        if own_app or own_judges:  # a server started by `rlray serve-reward` (or a sweep) before the run stays up
            from ray import serve  # deferred: only runs with reward.server.enabled or judges import Ray Serve

            for name in ([cfg.reward.server.app_name] if own_app else []) + own_judges:
                serve.delete(name)
        if log_file is not None:
            finish_logs(log_file, log_dir, ray_info, started_at, status, outcome, plan.max_steps)
    startup = startup_summary(clock, started, learner_times, time.time())
    log.info("start-up and shutdown seconds: %s", startup)
    return TrainResult(tracker.run_id, tracking.mlflow_uri, (outcome.last_snapshot if outcome else None) or "", status,
                       url, outcome.error if outcome else "", str(log_dir) if log_file is not None else "", startup)


def launch_rollout(plan: RunPlan, model_dir: str, namespace: str) -> list[Any]:
    """Asks for the run's rollout actors (``rlray.launch.actors.launch_rollout_actors``) in ``namespace``, on the nodes
    of ``rlray.launch.placement.rollout_nodes``, and returns them unwaited (``Launched``): their engines load while the
    driver opens the MLflow run and starts the other roles."""
    from rlray.launch.actors import launch_rollout_actors

    return launch_rollout_actors(plan, model_dir, plan.lengths.context_tokens, rollout_nodes(plan), namespace=namespace)


def open_tracking(clock: StartupClock, plan: RunPlan, store: threading.Thread, model_dir: str, namespace: str,
                  tags: dict[str, str] | None, verbose: bool | None, started_at: float) -> tuple[Any, RunServices, str]:
    """Opens the run's MLflow run (the ``mlflow`` phase of ``clock``) and returns (``Tracker``, ``RunServices``, the run's
    snapshot folder): the config logged, the lineage tags set (model, output, snapshot folder, git commit, the actors'
    Ray namespace, the snapshot resumed from) with ``tags``.

    Raises:
        rlray.checkpoint.storage.SnapshotError: ``checkpoint.resume_from`` names no complete snapshot.
    """
    cfg = plan.settings
    with clock.phase("mlflow"):
        store.join()
        from rlray.checkpoint import lineage  # MLflow is imported by now (start_store_imports)
        from rlray.observe.tracking import Tracker

        if verbose is not None:
            console.route_library_logs()  # MLflow set its logger up again at its import, in the thread
        opts = cfg.checkpoint.s3.storage_options()
        snaps, tracking = plan.snapshots, plan.tracking
        resume = checkpoint.resolve_snapshot(snaps.resume_from, snaps.uri, opts) if snaps.resume_from else None
        tracker = Tracker(tracking.mlflow_uri, tracking.experiment, run_name=tracking.run_name)
        tracker.log_config(cfg)
        services = RunServices(started_at=started_at, git_commit=lineage.git_commit(), resume_from=resume)
        run_dir = checkpoint.join(snaps.uri, checkpoint.run_dir_name(tracker.run_id))
        tracker.set_tags({"rlray.model_dir": model_dir, "rlray.output_dir": cfg.run.output_dir, "rlray.snapshot_dir": run_dir,
                          "rlray.git_commit": services.git_commit, "rlray.namespace": namespace,
                          **({"rlray.resumed_from": resume} if resume else {}), **(tags or {})})
    return tracker, services, run_dir


def finish_logs(log_file: logging.Handler, log_dir: Path, ray_info: RayInfo, started_at: float, status: str,
                outcome: Any, total_steps: int) -> None:
    """Copies this node's Ray log files of the run into ``log_dir/ray`` (when the log folder is known), prints the
    last lines (status, step, snapshot, log folder) and closes ``driver.log``."""
    ray_files = console.copy_ray_logs(Path(ray_info.logs_dir), log_dir / console.RAY_LOGS, started_at) if ray_info.logs_dir else []
    print("\n".join(console.end_lines(
        status=status, step=outcome.step if outcome else 0, total_steps=total_steps,
        final_snapshot=(outcome.last_snapshot if outcome else None) or "", log_dir=str(log_dir), ray_files=len(ray_files),
        ray_logs_dir=ray_info.logs_dir)), flush=True)
    console.release_logs(log_file)


def _mlflow_status(status: str) -> str:
    """Returns the MLflow run status of an rlray status: FINISHED, KILLED or FAILED as they are, 'stopped: wall_time'
    (the run's time budget, ``run.max_wall_time_s``, spent: a planned end) as FINISHED and any other 'stopped: <reason>'
    (a guard, SIGTERM, a hook) as KILLED; the tag ``rlray.status`` keeps the rlray status."""
    if status == "stopped: wall_time":
        return "FINISHED"
    return "KILLED" if status.startswith("stopped") else status


@contextlib.contextmanager
def stop_on_sigterm(control: ray.actor.ActorHandle) -> Iterator[None]:
    """Within the block, SIGTERM asks the run to stop at its next step boundary (main thread only).

    ``ray job stop`` sends SIGTERM to the job's entry process and SIGKILLs it after
    ``RAY_JOB_STOP_WAIT_TIME_S`` (3 s by default; jobs/runtime_env.yaml raises it): the step in
    flight, the final snapshot and the MLflow status must fit in that grace period. A second
    SIGTERM stops at once (KeyboardInterrupt, MLflow status KILLED). Off the main thread (a Tune
    trial), signals cannot be handled and the block runs unchanged. The previous handler is
    restored on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = 0

    def handler(signum: int, frame: object) -> None:
        nonlocal received
        received += 1
        if received > 1:
            raise KeyboardInterrupt(f"signal {signum} received twice")
        log.warning("SIGTERM: stopping at the next step boundary (send it again to stop at once)")
        control.request_stop.remote("SIGTERM")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class EvalSetup:
    """What evaluating a snapshot needs, as ``eval_setup`` yields it: ``rollouts`` (the rollout fleet, or the
    episode rollout over it when env.environments is set), ``reward`` (the in-process reward client), ``prompts``
    (the first ``eval.num_problems`` eval rows, each with its prompt token ids), ``tokenizer`` and ``judges`` (the
    judges' clients, their applications deployed for the evaluation; None without reward.judges)."""

    rollouts: RolloutSource
    reward: Any
    prompts: list[tuple[Any, list[int]]]
    tokenizer: Any
    judges: Any = None


@contextlib.contextmanager
def eval_setup(cfg: Settings, checkpoint_path: str) -> Iterator[EvalSetup]:
    """Yields the pieces of a greedy evaluation of a snapshot (or any model path) on ``data.eval_files``.

    Starts one rollout actor on the checkpoint's model, with all of this node's cores (and the environment hosts
    when env.environments is set: rows then run as episodes), and stops them on exit. ``evaluate_checkpoint``
    scores with it; a benchmark that needs each row's outcome calls ``rollouts.generate`` itself.

    Raises:
        rlray.checkpoint.storage.SnapshotError: ``checkpoint_path`` is an incomplete snapshot.
        ValueError: ``eval.num_problems`` is 0.
    """
    from rlray.launch.actors import kill_actors, start_env_hosts, start_rollout_actors
    from rlray.run import build

    if cfg.eval.num_problems == 0:
        raise ValueError("eval.num_problems=0: set eval.num_problems>=1 to evaluate")
    init_ray(include_dashboard=False)
    cfg = resolve_paths(cfg)
    opts = cfg.checkpoint.s3.storage_options()
    is_snapshot = Path(checkpoint_path, "manifest.json").exists() or "://" in checkpoint_path
    model_dir = checkpoint.local_model_dir(checkpoint_path, options=opts) if is_snapshot else resolve_model_path(checkpoint_path)
    tokenizer = load_tokenizer(model_dir, cfg.model.chat_template)
    rows = load_prompt_rows(cfg.data.eval_files, prompt_column=cfg.data.prompt_column)[: cfg.eval.num_problems]
    rows, ids, _ = prepare_prompts(
        rows, tokenizer, max_prompt_tokens=10**9, instruction=cfg.data.instruction, system_prompt=cfg.data.system_prompt
    )
    one = cfg.model_copy(deep=True)
    one.resources.rollout.num_workers = 1
    one.resources.rollout.cpu_threads = None  # this node's cores, all to the one actor
    plan = resolve_plan(cfg)
    actors = start_rollout_actors(resolve_plan(one), model_dir, plan.lengths.context_tokens)
    hosts = start_env_hosts(plan, model_dir=model_dir)
    try:
        fleet = eval_fleet(plan, actors)  # the plan's deadlines over every call it waits on (episodes: build.rollouts)
        reward = build.local_reward_client(cfg, build.dataset_columns(rows), fleet.watch)
        rollouts = build.rollouts(cfg, fleet, hosts, tokenizer)
        try:
            with judge_apps(plan):
                judges = build.judge_panel(cfg, watch=fleet.watch)
                try:
                    yield EvalSetup(rollouts, reward, list(zip(rows, ids, strict=True)), tokenizer, judges)
                finally:
                    if judges is not None:
                        judges.close()
        finally:
            reward.close()
    finally:
        kill_actors([*actors, *hosts])


def eval_fleet(plan: RunPlan, actors: list[Any]) -> RolloutFleet:
    """Returns ``rlray eval``'s rollout fleet over ``actors``, watched as a run's (``rlray.run.lead.hang_watch``: the
    plan's ``watchdog.*`` deadlines; ``eval_setup`` hands the same watch to the episodes, the reward functions and the
    judges). A call past its deadline is reported with the stuck process's stacks (an ``rlray: hang`` line and a
    ``hang`` alert to ``monitor.alerts``' log and webhook sinks: no MLflow run here), then ``watchdog.on_hang`` applies:
    "restart" restarts the actor and its prompts run again, "stop" ends ``rlray eval`` with ``HangError``."""
    from rlray.observe.monitor import Alerter
    from rlray.rollout.fleet import RolloutFleet
    from rlray.run.lead import hang_watch

    watch = hang_watch(plan)
    m = plan.settings.monitor
    url = m.webhook_url.get_secret_value() if m.webhook_url else None
    alerter = Alerter(m.alerts, webhook_url=url, webhook_attempts=m.webhook_attempts)

    def alert(message: str) -> None:
        alerter.send("hang", message, {"command": "rlray eval", "time": time.time()})

    watch.alert = alert
    return RolloutFleet(actors, node_wait_s=plan.settings.resources.node_wait_s, watch=watch)


def evaluate_checkpoint(cfg: Settings, checkpoint_path: str) -> dict[str, float]:
    """Returns greedy eval metrics of a snapshot (or any model path) on ``data.eval_files``.

    Scores the first ``eval.num_problems`` problems on one rollout actor (``eval_setup``; rows with an environment
    run as episodes) with training's evaluation (``rlray.run.evaluation.evaluate_prompts``: the same keys), plus
    eval/pass@k when ``eval.pass_k`` > 1.

    Raises:
        rlray.checkpoint.storage.SnapshotError: ``checkpoint_path`` is an incomplete snapshot.
        ValueError: ``eval.num_problems`` is 0.
    """
    from rlray.run import evaluation

    plan = resolve_plan(cfg)
    with eval_setup(cfg, checkpoint_path) as setup:
        return evaluation.evaluate_prompts(setup.rollouts, setup.reward, setup.prompts, setup.tokenizer,
                                           plan.sampling.eval, plan.episodes.reward_weight, plan.sampling.pass_at_k(),
                                           judges=setup.judges, judge_seed=plan.sampling.seed)
