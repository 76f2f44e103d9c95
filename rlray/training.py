"""The run on each learner rank: setup, the step loop with operations, and the Ray Train training function.

``train`` builds the learner (and on rank 0 the data stream, tracker, rollout fleet and reward
client), restores a snapshot when there is one, then repeats ``rlray.loop.run_step`` (stages 1-7)
and stage 8 (log, guard, snapshot, hooks: ``rlray.ops``, ``rlray.snapshots``, ``rlray.hooks``) until
``run.max_steps``, a guard or a hook ends the run. ``train_worker`` is the Ray Train training function.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import ray
import torch

from rlray import guard
from rlray import ops as ops_lib
from rlray.collective import Collective, RayTrainCollective, current_collective
from rlray.config import Config
from rlray.cores import parse_core_list, pin_process
from rlray.data import PromptStream, load_prompt_rows, prepare_prompts
from rlray.fleet import RolloutFleet, RolloutPipeline
from rlray.hooks import StepEnd, StepHook, run_hooks, run_observers
from rlray.learner import PolicyLearner
from rlray.learner.critic import build_critic
from rlray.learner.policy import to_local_gpu
from rlray.models import load_tokenizer, resolve_model_path
from rlray.runstate import RUNNING, RunOps, RunState
from rlray.tracking import Tracker
from rlray.weight_sync import make_weight_sync

from rlray import loop
from rlray.loop import Context, FatalStepError, evaluate, reward_client, sampling_for_step, scorer_kwargs, sync_weights, take_prompts

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """Seeds python, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_ppo_critic(cfg: Config, model_dir: str, wrap: Any) -> PolicyLearner:
    """Returns PPO's critic learner: a value head on ``critic.model_path`` (resolved), or on the policy checkpoint."""
    path = resolve_model_path(cfg.critic.model_path) if cfg.critic.model_path else model_dir
    return build_critic(path, dtype=cfg.model.dtype, lr=cfg.critic.lr, max_grad_norm=cfg.critic.max_grad_norm, wrap_model=wrap)


def setup(
    cfg: Config, model_dir: str, actors: list[Any], run_id: str | None, coll: Collective, reference_actor: Any = None
) -> Context:
    """Builds the learner on every rank; on rank 0 also the data stream, eval prompts, tracker, fleet and reward client."""
    torch.set_num_threads(cfg.learner.torch_threads)
    pin_learner(cfg, coll.rank)
    seed_everything(cfg.run.seed + coll.rank)
    tokenizer = load_tokenizer(model_dir, cfg.model.chat_template)
    kwargs = learner_kwargs(cfg, coll.world, with_reference=reference_actor is None)
    critic = build_ppo_critic(cfg, model_dir, kwargs["wrap_model"]) if cfg.algo.name == "ppo" else None
    learner = PolicyLearner(model_dir, critic=critic, **kwargs)
    ctx = Context(cfg, coll.rank, coll.world, coll, learner, tokenizer.pad_token_id, actors=actors, tokenizer=tokenizer)
    ctx.reference_actor = reference_actor
    if coll.rank == 0:
        render = dict(instruction=cfg.data.instruction, system_prompt=cfg.data.system_prompt)
        train_rows, train_ids, ctx.skipped_long_prompts = prepare_prompts(
            load_prompt_rows(cfg.data.train_files), tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens,
            long_prompts=cfg.data.long_prompts, **render,
        )
        ctx.stream = PromptStream(train_rows, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        ctx.prompt_ids = {r.prompt_id: ids for r, ids in zip(train_rows, train_ids)}
        if cfg.eval.num_problems:
            eval_rows = load_prompt_rows(cfg.data.eval_files)[: cfg.eval.num_problems]
            rows, ids, _ = prepare_prompts(eval_rows, tokenizer, max_prompt_tokens=10**9, **render)
            ctx.eval_prompts = list(zip(rows, ids))
        ctx.tracker = Tracker(cfg.tracking.mlflow_uri, cfg.tracking.experiment, run_id=run_id)
        ctx.reward, ctx.reward_kwargs = reward_client(cfg), scorer_kwargs(cfg)
        ctx.fleet = RolloutFleet(actors)
        ctx.pipeline = RolloutPipeline(
            ctx.fleet, functools.partial(take_prompts, ctx), functools.partial(sampling_for_step, cfg),
            cfg.rollout.max_staleness, cursor=ctx.stream.state_dict, restore_cursor=ctx.stream.load_state_dict,
        )
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    ctx.weight_sync = make_weight_sync(
        cfg.weight_sync_backend, ctx.fleet, dtype,
        wait=cfg.rollout.max_staleness == 0, tensor_parallel_size=cfg.resources.rollout.tensor_parallel_size,
    )
    return ctx


def pin_learner(cfg: Config, rank: int) -> None:
    """Pins this learner worker's process to its ``learner.cpu_affinity`` cores (CPU learners; None: no change)."""
    affinity = cfg.learner.cpu_affinity
    if affinity is None or cfg.resources.learner.gpus > 0:
        return
    cores = parse_core_list(affinity[rank] if isinstance(affinity, list) else affinity)
    log.info("learner rank %d pinned to cores %s", rank, pin_process(cores))


def learner_kwargs(cfg: Config, world: int, *, with_reference: bool = True) -> dict:
    """Returns ``PolicyLearner`` keyword arguments from the config (DDP or FSDP wrapping when world > 1; one
    GPU rank moves the model to its GPU)."""
    wrap = None
    if world > 1:
        import ray.train.torch

        strategy = cfg.resources.learner.strategy
        wrap = functools.partial(ray.train.torch.prepare_model, parallel_strategy=strategy)
    elif cfg.resources.learner.gpus > 0 and torch.cuda.is_available():
        wrap = to_local_gpu
    return dict(
        dtype=cfg.model.dtype,
        lr=cfg.learner.lr,
        betas=cfg.learner.betas,
        weight_decay=cfg.learner.weight_decay,
        warmup_steps=cfg.learner.warmup_steps,
        max_grad_norm=cfg.learner.max_grad_norm,
        temperature=cfg.rollout.temperature,
        use_reference=(cfg.algo.kl_coef > 0 or cfg.guard.kl_threshold is not None) and with_reference,  # the KL guard needs it
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        wrap_model=wrap,
        optimizer=cfg.learner.optimizer,
        lora=cfg.model.lora.model_dump() if cfg.model.lora.rank else None,
    )


def _progress(total: int, initial: int):
    try:
        from ray.experimental.tqdm_ray import tqdm

        return tqdm(total=total, desc="rlray train", position=0)
    except Exception:  # outside Ray
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc="rlray train")


@dataclass
class Outcome:
    """How a run ended on this rank: status (FINISHED or 'stopped: <reason>'), steps done, the last
    complete snapshot, and the last step's metrics (complete on rank 0)."""

    status: str
    step: int
    last_snapshot: str | None
    metrics: dict[str, float]


def train(cfg: Config, model_dir: str, actors: list[Any], run_id: str | None = None, coll: Collective | None = None,
          reference_actor: Any = None, ops: RunOps | None = None, hooks: Sequence[StepHook] = ()) -> Outcome:
    """Runs RL steps until ``cfg.run.max_steps``, a guard or a hook stops the run; returns how it ended.

    A hook (``rlray.hooks``: SIGTERM from ``ray job stop``, Tune's reporter) that asks to stop ends the
    run at that step boundary with a snapshot of the last finished step and status 'stopped: <reason>'.

    An out-of-memory error while loading or in the first step is retried once with half the
    micro-batch and gradient checkpointing on (``guard.oom_fallback_config``); the change is logged
    and recorded on the MLflow run. With several learner ranks the retry lines up only when every
    rank runs out of memory at the same point; otherwise the collectives fail and Ray Train's restart
    (``monitor.max_failures``) takes over.

    The run ends early, at a step boundary, when a hook asks to stop (``rlray.hooks``).

    Args:
        cfg: the validated config.
        model_dir: local Hugging Face folder of the initial policy (resolved by the driver).
        actors: rollout actor handles (used by rank 0).
        run_id: the MLflow run to log to (created by the driver; None creates one).
        coll: collectives; defaults to Ray Train's when inside a worker group, else world 1.
        reference_actor: the reference actor (resources.reference.placement == "actor"), else None.
        ops: the monitor handle, start time, commit and resume snapshot from the driver.
        hooks: per-step hooks, called on rank 0 at each step boundary (the same list on every rank):
            control hooks before the step's snapshot, observers after it (``rlray.hooks``).

    Raises:
        guard.EarlyOOM: out of memory again after the fallback.
    """
    coll = coll or current_collective()
    ops = ops or RunOps()
    in_ray_train = isinstance(coll, RayTrainCollective)
    source, restarted = ops_lib.restore_source(cfg, ops, run_id, in_ray_train) if run_id else (ops.resume_from, False)
    cfg = restart_delay(cfg, coll, ops, source, restarted)
    try:
        return _train(cfg, model_dir, actors, run_id, coll, reference_actor, ops, source, hooks)
    except guard.EarlyOOM as oom:
        cfg, note = guard.oom_fallback_config(cfg)
        log.warning("out of memory at %s; retrying once with %s", oom.where, note)
        guard.free_memory()
        return _train(cfg, model_dir, actors, run_id, coll, reference_actor, ops, source, hooks,
                      oom_note=f"{oom.where}: {note}")


def restart_delay(cfg: Config, coll: Collective, ops: RunOps, source: str | None, restarted: bool) -> Config:
    """Counts this learner start with the monitor (a second start is a restart, alerted), waits
    ``monitor.restart_delay_s`` after a restart, and returns the config to run: restoring this run's own
    snapshot (``restarted``, the same on every rank) adopts the config it was trained with; a snapshot
    the run was started from (``checkpoint.resume_from``, a PBT exploit) keeps ``cfg``, on every start."""
    restart = restarted
    if coll.rank == 0 and ops.monitor is not None:
        restart = ray.get(ops.monitor.learner_started.remote()) > 1 or restarted
    if restart:
        log.warning("learner restarted; waiting monitor.restart_delay_s=%g s before resuming", cfg.monitor.restart_delay_s)
        time.sleep(cfg.monitor.restart_delay_s)
    return ops_lib.config_for_restore(cfg, source, restarted)


def _train(cfg: Config, model_dir: str, actors: list[Any], run_id: str | None, coll: Collective, reference_actor: Any,
           ops: RunOps, source: str | None, hooks: Sequence[StepHook] = (), oom_note: str | None = None) -> Outcome:
    in_ray_train = isinstance(coll, RayTrainCollective)
    guard.apply_gpu_memory_cap(cfg.guard)
    ctx = _early_oom("load", lambda: setup(cfg, model_dir, actors, run_id, coll, reference_actor))
    if ctx.rank == 0 and oom_note:
        ctx.tracker.set_tags({"rlray.oom_fallback": oom_note})
        ctx.tracker.log_text(ctx.cfg.to_yaml(), "config/oom_fallback.yaml")
    run = ops_lib.begin(ctx, ops, source, in_ray_train=in_ray_train, reload_rollouts=lambda: reload_rollouts(ctx))
    bar = _progress(cfg.run.max_steps, run.step) if ctx.rank == 0 else None
    metrics: dict[str, float] = {}
    retrying = False
    try:
        if ctx.rank == 0 and run.step == 0 and cfg.eval.num_problems:
            ctx.tracker.log_metrics(evaluate(ctx), step=0)
        while run.step < ctx.cfg.run.max_steps and run.status == RUNNING:
            step = run.step
            metrics = _early_oom("first step", lambda: loop.run_step(ctx, step)) if step == run.first_step else loop.run_step(ctx, step)
            run.step = step + 1
            # 8. log, guard, snapshot
            trip = ops_lib.check_guards(ctx, run, metrics, ops)
            stop_reason = _finish_step_rank0(ctx, run, metrics, bar, ops, hooks) if ctx.rank == 0 else None
            if hooks:  # every rank leaves together at this step boundary when rank 0's hooks asked to stop
                stop_reason = ctx.coll.broadcast(stop_reason)
            # the snapshot of this step boundary, for observer hooks (Tune's reporter)
            written = ops_lib.end_step(ctx, run, ops, trip, stop_reason, metrics, lambda: reload_rollouts(ctx))
            if ctx.rank == 0:
                run_observers(hooks, StepEnd(step + 1, ctx.cfg.run.max_steps, dict(metrics), snapshot=written))
        if run.status == RUNNING:
            run.status = "FINISHED"
    except guard.EarlyOOM:
        retrying = True
        raise
    except FatalStepError as err:
        if ctx.rank == 0:
            log.error("the run stops at step %d: %s", run.step + 1, err)
            ctx.tracker.set_tags({"rlray.error": str(err)[:5000]})
        raise
    finally:
        if bar is not None:
            bar.close()
        ops_lib.finish(ctx, run, ops, record=not retrying)
        if ctx.reward is not None:
            ctx.reward.close()
    coll.barrier()
    return Outcome(run.status, run.step, run.last_snapshot, metrics)


def _early_oom(where: str, fn: Callable[[], Any]) -> Any:
    """Returns ``fn()``; an out-of-memory error becomes ``guard.EarlyOOM`` (retried once by ``train``)."""
    try:
        return fn()
    except Exception as err:
        if guard.is_oom(err):
            raise guard.EarlyOOM(where, err) from err
        raise


def _finish_step_rank0(
    ctx: Context, run: RunState, metrics: dict[str, float], bar: Any, ops: RunOps, hooks: Sequence[StepHook]
) -> str | None:
    """Rank 0: eval when due, log the step once, update the monitor and the progress bar, run the hooks;
    returns the hooks' stop reason or None."""
    cfg, step = ctx.cfg, run.step
    every = cfg.eval.every_steps
    if cfg.eval.num_problems and ((every and step % every == 0) or step == cfg.run.max_steps):
        metrics.update(evaluate(ctx))
    ops_lib.record(ctx, run, metrics, ops)
    progress = (
        f"rlray step {step}/{cfg.run.max_steps} reward={metrics['reward/mean']:.3f} kl={metrics['algo/kl']:.4f} "
        f"tokens/s={metrics['perf/tokens_per_s']:.0f}"
    )
    bar.set_description(progress)
    bar.update(1)
    print(progress, flush=True)  # one plain line per step: `ray job logs` and log files show progress
    return run_hooks(hooks, StepEnd(step, cfg.run.max_steps, dict(metrics)))


def reload_rollouts(ctx: Context) -> None:
    """Pushes the learner's current policy to every rollout actor, tagged with ``ctx.policy_version``.

    Used at start, after a restore and after a rollback, so the engines generate with exactly the
    learner's weights; it is stage 7's push with the version kept.
    """
    if ctx.rank == 0:
        ctx.pipeline.reset()  # drop rollouts in flight (async mode): they used the old weights and cursor
    ctx.policy_version -= 1
    ctx.policy_version = sync_weights(ctx)
    if ctx.rank == 0 and ctx.reward_kwargs != (kwargs := scorer_kwargs(ctx.cfg)):  # a rollback may change reward.*
        ctx.reward.close()
        ctx.reward, ctx.reward_kwargs = reward_client(ctx.cfg), kwargs


def train_worker(loop_config: dict) -> None:
    """The Ray Train training function: rebuilds the config and runs ``train`` on this rank."""
    from rlray.collective import name_learner_process

    cfg = Config.model_validate(loop_config["config"])
    coll = current_collective()
    name_learner_process(coll.rank)
    try:
        train(cfg, loop_config["model_dir"], loop_config["rollout_actors"], loop_config["run_id"], coll,
              loop_config.get("reference_actor"), loop_config.get("ops"), loop_config.get("step_hooks", ()))
    except FatalStepError:  # recorded (status FAILED, tag rlray.error): a restart would fail the same way
        return
