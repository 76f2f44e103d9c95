"""The online run: ``OnlineRun`` and ``run_step``, the one place that sequences an RL step.

It runs inside the Ray Train training function on every learner rank. Rank 0 (the only rank with an
``OnlineLead``) drives the rollout actors and the reward, builds the step's experience table and hands
each rank its shard through Ray's object store; every rank takes part in the update. A step, top to
bottom (``run_step``):

  1. take prompts (the data cursor lives in the snapshot)
  2. rollout on the rollout actors (rlray.rollout.fleet; in async mode, steps t+1..t+k are already in flight)
  3. rewards (in process, or the Serve application rlray-reward), and the algorithm's extra samples
     (stages 1-3: ``rlray.run.experience.collect_experience``)
  4. reference, teacher and old logprobs (skipped when they cannot change the update)
  5. advantages (plus the teacher's per-token reverse KL, with a reverse-KL teacher), and those of the kept samples
  6. learner update (mini-batches, epochs)
  7. weight sync to the rollouts (version-tagged)
  8. log, guard, snapshot, hooks: the session's step boundary (``rlray.run.session.step_boundary``, shared with
     offline runs), given the ``StepResult`` this step returns: its metrics, its kept samples
     (``tracking.samples_per_step``: rows rank 0 picks from the whole step) and its prompt ledger
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import ray
import torch

from rlray import schema
from rlray.cores import CorePlan, parse_core_list, pin_process
from rlray.data import DataError, PromptRow
from rlray.hangs import HangError
from rlray.learner import Normaliser, PolicyLearner
from rlray.learner import online as learner_online
from rlray.learner.collective import Collective
from rlray.models import load_tokenizer
from rlray.observe import samples as kept
from rlray.observe.tracking import Tracker
from rlray.plan import RunPlan
from rlray.reward import RewardFunctionError
from rlray.rollout import SamplingSpec
from rlray.rollout.weight_sync import make_weight_sync
from rlray.run import build, segments
from rlray.run.context import RunContext, StepResult
from rlray.run.evaluation import evaluate_prompts
from rlray.run.experience import Experience, StageTimer, collect_experience, minibatch_normalisers, step_samples
from rlray.run.failures import CannotLearnError
from rlray.run.frozen_calls import FrozenCalls
from rlray.run.lead import OnlineLead, build_lead, hang_watch
from rlray.run.session import FatalStepError

log = logging.getLogger(__name__)

# Errors found during a step that a retry cannot fix (a reward function returning the wrong number of values,
# bad data, every sample failing guard.max_failed_steps steps in a row): every rank stops at once with the message
# (the run ends FAILED), and Ray Train does not restart the learner.
# A hang under watchdog.on_hang=stop (rlray.hangs.HangError) is one too; the run keeps a snapshot of its last finished step.
FATAL_STEP_ERRORS: tuple[type[BaseException], ...] = (RewardFunctionError, DataError, CannotLearnError, HangError)


@dataclass
class StepHandout:
    """What rank 0 hands to every rank for one step: shard references and global denominators (or the
    fatal error that ends the run).

    Attributes:
        shard_refs: one object-store reference per rank to its contiguous shard of the experience table.
        minibatch_norms: the global token and sequence counts of each mini-batch (``minibatch_normalisers``).
        rollout_metrics: rank 0's stage 1-3 metrics (rank 0 reads them; the other ranks ignore them).
        fatal: the message of an error that ends the run on every rank, or None.
        stop_snapshot: the fatal error ends the run after a snapshot of the last finished step (a hang under
            ``watchdog.on_hang=stop``).
        sample_rows: rows of the step's table kept as samples (``observe.samples.pick_rows``).
    """

    shard_refs: list[Any]
    minibatch_norms: list[Normaliser]
    rollout_metrics: dict[str, float]
    fatal: str | None = None
    sample_rows: list[int] = field(default_factory=list)
    stop_snapshot: bool = False


@dataclass
class OnlineRun(RunContext):
    """Everything an online step needs on one rank; built once per worker by ``setup``.

    Attributes:
        pad_token_id: the tokenizer's padding id (collation of the step's shard).
        weight_sync: pushes the learner's weights to the rollout engines (every rank; ``rlray.rollout.weight_sync``).
        reference_actor: the reference model's actor (``resources.reference.placement == "actor"``), else None.
        teacher_actor: the teacher's actor (``teacher.path`` set, ``resources.teacher.placement == "actor"``), else None.
        frozen: this rank's calls to those actors under ``watchdog.reference_call_s`` (``FrozenCalls``); None without
            either actor.
        lead: rank 0's part (data, reward, fleet, pipeline; ``OnlineLead``); None on every other rank.
    """

    pad_token_id: int = 0
    weight_sync: Any = None
    reference_actor: Any = None
    teacher_actor: Any = None
    frozen: FrozenCalls | None = None
    lead: OnlineLead | None = None

    def take_prompts(self) -> tuple[list[PromptRow], list[list[int]]]:
        """Stage 1 (rank 0): returns the next step's prompt rows and their token ids (advances the cursor)."""
        return self.lead.take_prompts(self.settings.learner.prompts_per_step)

    def sampling_for(self, step: int) -> SamplingSpec:
        """Returns the training SamplingSpec of 0-based ``step`` (``build.sampling_for_step``)."""
        return build.sampling_for_step(self.settings, step)

    def run_step(self, step: int) -> StepResult:
        """Runs stages 1-7 of 0-based ``step`` (``run_step``)."""
        return run_step(self, step)

    def start_metrics(self) -> dict[str, float]:
        """Returns the eval metrics of the initial policy (rank 0, when ``eval.num_problems``), else {}."""
        return evaluate(self) if self.settings.eval.num_problems else {}

    def evaluate_when_due(self, steps_done: int) -> dict[str, float]:
        """Returns eval metrics every ``eval.every_steps`` steps and after the last one (rank 0), else {}."""
        every = self.settings.eval.every_steps
        due = (every and steps_done % every == 0) or steps_done == self.plan.max_steps
        return evaluate(self) if self.settings.eval.num_problems and due else {}

    def progress_text(self, steps_done: int, metrics: dict[str, float]) -> str:
        """Returns 'rlray step k/N reward=... kl=... tokens/s=...'."""
        return (f"rlray step {steps_done}/{self.plan.max_steps} reward={metrics['reward/mean']:.3f} "
                f"kl={metrics['algo/kl']:.4f} tokens/s={metrics['perf/tokens_per_s']:.0f}")

    def data_epoch(self) -> int:
        """Returns the training cursor's epoch (rank 0)."""
        return self.lead.stream.epoch

    def adopt_plan(self, plan: RunPlan) -> None:
        """Makes ``plan`` the plan in force; rank 0 rebuilds the reward client when its ``reward.*`` changed."""
        self.plan = plan
        if self.lead is not None:
            self.lead.renew_reward(plan)

    def reload_rollouts(self) -> None:
        """Pushes the learner's current policy to every rollout actor, tagged with ``policy_version``.

        Used at start, after a restore and after a rollback, so the engines generate with exactly the
        learner's weights; it is stage 7's push with the version kept.
        """
        if self.lead is not None:
            self.lead.pipeline.reset()  # drop rollouts in flight (async mode): they used the old weights
        self.policy_version -= 1
        self.policy_version = sync_weights(self)

    def cursor_state(self) -> dict[str, Any]:
        """Returns the data cursor a snapshot keeps (``RolloutPipeline.cursor_state``, rank 0): it counts every
        prompt taken, refills and the steps in flight included, and names where each step in flight took its prompts."""
        return self.lead.pipeline.cursor_state()

    def load_cursor_state(self, state: dict[str, Any]) -> None:
        """Sets rank 0's data cursor to a snapshot's ``state``; the steps then in flight take the same prompts again."""
        if self.lead is not None:
            self.lead.pipeline.load_cursor_state(state)

    def load_in_flight_rollouts(self, rollouts: list[dict | None]) -> None:
        """Rank 0: the steps in flight of the loaded cursor train on the samples the snapshot kept of them
        (``RolloutPipeline.keep_rollouts``)."""
        if self.lead is not None:
            self.lead.pipeline.keep_rollouts(rollouts)

    def in_flight_rollouts(self) -> list[dict | None] | None:
        """Returns the rollouts of the steps in flight a snapshot keeps (``RolloutPipeline.in_flight_rollouts``, rank 0;
        collected first)."""
        return self.lead.pipeline.in_flight_rollouts()

    def watch_hangs(self, alert: Callable[[str], None]) -> None:
        """Sends this rank's hang reports (``rlray.hangs.HangWatch``) through ``alert`` (``session.hang_alert``): on
        rank 0 the fleet's, the episodes', the reward's and the judges', and on every rank those of its own reference
        and teacher calls (``FrozenCalls``), so a stuck call of rank r alerts when it is found, not only in the stop."""
        if self.lead is not None and self.lead.fleet.watch is not None:
            self.lead.fleet.watch.alert = alert
        if self.frozen is not None:
            self.frozen.watch.alert = alert

    def close(self) -> None:
        """Closes rank 0's reward client and judge clients."""
        if self.lead is not None:
            self.lead.reward.close()
            if self.lead.judges is not None:
                self.lead.judges.close()


# --------------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------------
def setup(plan: RunPlan, coll: Collective, *, model_dir: str, actors: list[Any], run_id: str | None,
          reference_actor: Any = None, env_hosts: list[Any] | None = None, teacher_dir: str | None = None,
          teacher_actor: Any = None) -> OnlineRun:
    """Builds the learner on every rank; on rank 0 also the tracker and the ``OnlineLead`` (data stream, eval prompts,
    reward client, fleet, pipeline).

    ``teacher_dir`` (``teacher.path`` resolved by the driver) is loaded on every rank's learner when
    ``resources.teacher.placement == "learner"``; with placement actor, ``teacher_actor`` serves its logprobs.

    Raises:
        rlray.data.DataError: the prompt files cannot be read (names the file and line).
    """
    cfg = plan.settings
    cores = pin_learner(plan, coll.rank)
    build.seed_everything(cfg.run.seed + coll.rank)
    tokenizer = load_tokenizer(model_dir, cfg.model.chat_template)
    kwargs = build.learner_kwargs(cfg, coll.world, with_reference=reference_actor is None, teacher_dir=teacher_dir)
    critic = build.ppo_critic(cfg, model_dir, kwargs["parallel"]) if cfg.algo.algorithm.needs_critic else None
    learner = PolicyLearner(model_dir, critic=critic, reference_elsewhere=reference_actor is not None, **kwargs)
    tracker = None
    if coll.rank == 0:
        tracker = Tracker(cfg.tracking.mlflow_uri, cfg.tracking.experiment, run_id=run_id,
                          tensorboard_dir=cfg.tracking.tensorboard_dir)
    frozen = None if reference_actor is None and teacher_actor is None else FrozenCalls(hang_watch(plan), coll.rank)
    ctx = OnlineRun(plan, coll, learner, tokenizer, tracker, pad_token_id=tokenizer.pad_token_id,
                    reference_actor=reference_actor, teacher_actor=teacher_actor, frozen=frozen)
    if coll.rank == 0:  # the lead's pipeline takes each step's prompts through ctx (learner.prompts_per_step in force)
        ctx.lead = build_lead(plan, tokenizer, actors, env_hosts or [], cores, take_prompts=ctx.take_prompts,
                              sampling_for=ctx.sampling_for)
    # the exact sampler keeps float32 master weights, as the learner (bf16 only under its autocast)
    dtype = torch.bfloat16 if build.compute_dtype(cfg) == "bfloat16" and cfg.rollout.backend != "exact" else torch.float32
    ctx.weight_sync = make_weight_sync(
        cfg.weight_sync_backend, ctx.lead.fleet if ctx.lead else None, dtype,
        wait=cfg.rollout.max_staleness == 0, tensor_parallel_size=cfg.resources.rollout.tensor_parallel_size,
        adapter=cfg.adapter_sync, delta=cfg.rollout.weight_payload == "delta",
    )
    return ctx


def pin_learner(plan: RunPlan, rank: int) -> CorePlan:
    """Sets this learner worker's torch threads and, on CPU, pins its process to its cores, both as
    ``rlray.run.build.core_plan`` says (``learner.torch_threads`` / ``learner.cpu_affinity`` when set,
    else the default for a synchronous or an async run on this machine); returns that plan."""
    cores = build.core_plan(plan.settings)
    torch.set_num_threads(cores.learner_threads)
    if cores.learner_cores is None or plan.parallelism.gpu:
        log.info("learner rank %d: %d torch threads, not pinned (%s)", rank, cores.learner_threads, cores.why)
        return cores
    mine = parse_core_list(cores.learner_cores[rank % len(cores.learner_cores)])
    log.info("learner rank %d: %d torch threads, pinned to cores %s (%s)", rank, cores.learner_threads,
             pin_process(mine), cores.why)
    return cores


# --------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------
def run_step(ctx: OnlineRun, step: int) -> StepResult:
    """Runs stages 1-7 of one RL step on this rank; returns its result (metrics complete on rank 0) for stage 8.

    Raises:
        FatalStepError: on every rank, when rank 0's stages 1-3 hit one of ``FATAL_STEP_ERRORS``.
    """
    timer, spec = StageTimer(), build.update_spec(ctx.settings, ctx.world)
    experience, fatal, stop_snapshot = None, None, False
    if ctx.lead is not None:
        try:  # 1-3. prompts, rollout, rewards (rank 0)
            experience = collect_experience(ctx.lead, ctx.plan, ctx.tokenizer, step, timer,
                                            policy_version=ctx.policy_version, world=ctx.world)
        except FATAL_STEP_ERRORS as err:
            fatal, stop_snapshot = f"{type(err).__name__}: {err}", isinstance(err, HangError)
    shard, handout = distribute(ctx, experience, fatal, step=step, stop_snapshot=stop_snapshot)
    # agent segments make a step's mini-batches larger, never more of them (rlray.run.segments)
    spec = dataclasses.replace(spec, rows_per_minibatch=shard.num_rows // len(handout.minibatch_norms))
    batch = schema.collate(shard, ctx.pad_token_id)
    with timer("logprobs"):  # 4. reference, teacher and old logprobs
        batch = reference_and_old_logprobs(ctx, batch, spec, step)
    with timer("advantages"), ctx.coll.timed(f"stage 5 (advantages) of step {step + 1}"):  # 5. advantages, the
        # teacher's reverse KL, and those of the kept samples (every rank)
        batch = learner_online.advantages(batch, spec, ctx.coll.all_reduce_sum)
        distill_metrics = distill_advantages(ctx, batch, spec)
        kept_advantages = sample_advantages(ctx, batch, handout.sample_rows)
    with timer("update"), ctx.coll.timed(f"stage 6 (update) of step {step + 1}"):  # 6. learner update
        if ctx.lead is not None:  # no actor that restarts meanwhile is sent the weights being changed (NCCL, IPC)
            ctx.lead.fleet.pause_export()
        metrics = update_policy(ctx, batch, handout.minibatch_norms, spec) | distill_metrics
    with timer("weight_sync"):  # 7. weight sync
        ctx.policy_version = sync_weights(ctx)
    if ctx.lead is None:
        return StepResult(metrics)
    metrics.update(step_metrics(ctx.lead, handout.rollout_metrics, batch, timer) | ctx.weight_sync.last_metrics)
    for key, count in (ctx.frozen.run_counts.items() if ctx.frozen is not None else ()):  # every rank's, summed
        metrics[key] += count
    samples = step_samples(ctx.tokenizer, experience.table, handout.sample_rows, kept_advantages, step + 1)
    return StepResult(metrics, samples, experience.prompt_ids, experience.alerts)


def distribute(ctx: OnlineRun, experience: Experience | None, fatal: str | None = None, *,
               step: int = 0, stop_snapshot: bool = False) -> tuple[pa.Table, StepHandout]:
    """Hands every rank its contiguous shard of whole groups through the object store.

    Rank 0 puts one Arrow table per rank (``ray.put``) and broadcasts only the references; each rank
    then fetches its own shard, so experience never passes through the other ranks. The broadcast also
    carries the rows of 0-based ``step`` kept as samples (``observe.samples.pick_rows``).

    Args:
        ctx: this rank's run.
        experience: rank 0's stage 1-3 result (None on the other ranks, and on rank 0 with ``fatal``).
        fatal: rank 0's fatal error message, or None.
        step: the 0-based step (seeds the pick of kept samples).
        stop_snapshot: with ``fatal``, the run ends after a snapshot of the last finished step (``FatalStepError``).

    Raises:
        FatalStepError: on every rank, when rank 0 passes ``fatal`` (its stages 1-3 hit a fatal error).
    """
    handout = None
    if ctx.rank == 0 and fatal is not None:
        handout = StepHandout([], [], {}, fatal, stop_snapshot=stop_snapshot)
    elif ctx.rank == 0:
        table = experience.table
        refs = [ray.put(table.slice(s.start, s.stop - s.start)) for s in
                (schema.shard_rows(table.num_rows, r, ctx.world) for r in range(ctx.world))]
        real = segments.sample_rows(table)  # every row but padding (rlray.run.segments)
        groups = table.column("group_id").to_pylist()
        rows = [real[i] for i in kept.pick_rows([groups[i] for i in real], ctx.settings.tracking.samples_per_step,
                                                ctx.settings.run.seed, step + 1)]
        handout = StepHandout(refs, minibatch_normalisers(table, ctx.plan, ctx.world), experience.metrics, sample_rows=rows)
    handout = ctx.coll.broadcast(handout)
    if handout.fatal is not None:
        raise FatalStepError(handout.fatal, stop_snapshot=handout.stop_snapshot)
    return ray.get(handout.shard_refs[ctx.rank]), handout


def reference_and_old_logprobs(ctx: OnlineRun, batch: schema.StepBatch, spec: learner_online.UpdateSpec,
                               step: int = 0) -> schema.StepBatch:
    """Stage 4: fills ref_logprobs (KL on), teacher_logprobs (reverse-KL distillation), old_logprobs (off-policy
    update, KL in the reward, or reverse-KL distillation) and old_values (PPO).

    With one epoch and one mini-batch the update is on-policy: old logprobs equal the current ones
    and are taken inside the update (no extra forward), as TRL does for a single iteration, unless the
    KL sits in the reward, whose penalty needs them before the advantages, or a reverse-KL teacher needs
    them. A reference or teacher actor (placement actor) receives the model inputs only (``schema.ModelInputs``)
    and sends [B, T] logprobs of the sampled tokens, each call under ``watchdog.reference_call_s``
    (``rlray.run.frozen_calls``; 0-based ``step`` is the step put back in flight when one stops the run); a JSD
    teacher sits on the learner and is run inside the update's micro-batches instead.

    Raises:
        FatalStepError: on every rank, after a snapshot of the last finished step, when a rank's actor call stops the
            run (``frozen_logprobs``).
    """
    if ctx.frozen is not None:  # resources.reference/teacher.placement == "actor"
        frozen_logprobs(ctx, batch, spec, step)
    return learner_online.reference_and_old(ctx.learner, batch, spec)


def frozen_logprobs(ctx: OnlineRun, batch: schema.StepBatch, spec: learner_online.UpdateSpec, step: int) -> None:
    """Stage 4 on every rank: fills ``batch``'s ref_logprobs from the reference actor (except while the policy is still
    the reference, ``PolicyLearner.at_reference``: a run's first step) and teacher_logprobs from the teacher actor
    (reverse-KL distillation), each call under ``watchdog.reference_call_s``, then agrees with the other ranks
    (``FrozenCalls.agree``: one all-reduce) on the run's hang counts and on a stop.

    Raises:
        FatalStepError: on every rank (``stop_snapshot``: the run keeps a snapshot of its last finished step, and rank 0
            puts step ``step`` back in flight first, so a resume takes its prompts again) when a rank's call hung
            under ``watchdog.on_hang=stop`` or failed twice.
    """
    mbs = build.frozen_micro_batching(ctx.settings)  # an actor's model is not sharded: the configured budget (rlray.plan)
    if ctx.reference_actor is not None and not ctx.learner.at_reference:  # a run's first step: the policy's own
        # logprobs are the reference's (rlray.learner.online.reference_and_old), so the actor is not called
        batch.ref_logprobs = ctx.frozen.logprobs(ctx.reference_actor, "reference actor", batch.inputs, mbs)
    if ctx.teacher_actor is not None and spec.distill_weight > 0:
        batch.teacher_logprobs = ctx.frozen.logprobs(ctx.teacher_actor, "teacher actor", batch.inputs, mbs)
    stopping = ctx.frozen.agree(ctx.coll.all_reduce_sum, ctx.world)
    if stopping:
        if ctx.lead is not None:
            ctx.lead.pipeline.keep_in_flight(step)
        raise FatalStepError(ctx.frozen.stop_message(stopping), stop_snapshot=True)


def distill_advantages(ctx: OnlineRun, batch: schema.StepBatch, spec: learner_online.UpdateSpec) -> dict[str, float]:
    """Stage 5, reverse-KL distillation: adds the teacher's per-token reverse KL to the advantages
    (``learner_online.add_reverse_kl``; a collective every rank calls); returns {"algo/distill_reverse_kl": token
    mean}, or {} without a reverse-KL teacher."""
    if spec.distill_weight <= 0:
        return {}
    return learner_online.add_reverse_kl(batch, spec.distill_weight, ctx.coll.all_reduce_sum)


def sample_advantages(ctx: OnlineRun, batch: schema.StepBatch, rows: list[int]) -> list[float]:
    """Stage 5, kept samples: returns the sequence advantage of each kept row (``rows``: indices into the step's
    whole table).

    A row's sequence advantage is its first loss token's advantage (for group estimators, the one value
    broadcast over the row), NaN when no token counts (a failed reward). Each rank computes those of its shard's
    rows; one all-gather over ranks (a collective every rank calls when samples are kept) gives every row's.

    Args:
        batch: this rank's shard, with advantages [B/world, T] float32 and response_mask [B/world, T] bool.
    """
    if not rows:
        return []
    mask, adv = batch.response_mask, batch.advantages
    first = mask.float().argmax(dim=1, keepdim=True)  # the first True of each row (0 for a row without one)
    local = torch.where(mask.any(dim=1), adv.gather(1, first).squeeze(1).to(torch.float64), torch.nan)
    every = ctx.coll.all_gather(local)  # [B] float64, ranks' shards in order
    return [float(every[row]) for row in rows]


def update_policy(ctx: OnlineRun, batch: schema.StepBatch, norms: list[Normaliser],
                  spec: learner_online.UpdateSpec) -> dict[str, float]:
    """Stage 6: epochs x mini-batches of optimizer steps (and PPO's critic); returns statistics summed over ranks."""
    return learner_online.update(ctx.learner, batch, norms, spec, ctx.coll.all_reduce_sum, ctx.coll.all_reduce_max)


def sync_weights(ctx: OnlineRun) -> int:
    """Stage 7: pushes the policy from the learner to every rollout actor; returns the new policy version.

    Object store on CPU, NCCL broadcast or CUDA IPC on GPU (``rlray.rollout.weight_sync``); in async mode
    the push queues behind the single-turn rollouts already in flight instead of waiting for them, and waits for
    multi-turn ones (episodes, agents: ``RolloutPipeline.before_push``), whose turns would otherwise straddle it.
    """
    version = ctx.policy_version + 1
    if ctx.lead is not None:  # multi-turn rollouts in flight finish their turns with the weights they started with
        ctx.lead.pipeline.before_push()
    ctx.weight_sync.push(ctx.learner, ctx.rank, version)
    return version


def step_metrics(lead: OnlineLead, rollout_metrics: dict[str, float], batch: schema.StepBatch,
                 timer: StageTimer) -> dict[str, float]:
    """Returns rank 0's step-level metrics: rollout and reward statistics, stage times, throughput, data position, and
    the fleet's health: rollout/actor_failures and rollout/rerun_prompts (actor failures the fleet saw, and prompts it
    or the pipeline sent again because of a failure, since the previous step; advances ``lead.logged``),
    rollout/stale_rerun_prompts (of those, prompts the pipeline sampled again with newer weights than submitted at),
    rollout/actors_alive (actors in use after the step), and rollout/engine_calls (generate calls the fleet sent since
    the previous step's metrics, evaluation's included)."""
    step_s = timer.elapsed_s()
    fleet, pipe, logged = lead.fleet, lead.pipeline, lead.logged
    new_failures, logged.actor_failures = fleet.failures - logged.actor_failures, fleet.failures
    rerun = fleet.rerun_prompts + pipe.rerun_prompts
    new_rerun, logged.rerun_prompts = rerun - logged.rerun_prompts, rerun
    new_stale, logged.stale_rerun_prompts = pipe.stale_rerun_prompts - logged.stale_rerun_prompts, pipe.stale_rerun_prompts
    new_calls, logged.engine_calls = fleet.calls - logged.engine_calls, fleet.calls
    gen = rollout_metrics["rollout/generated_tokens"]
    return {
        **rollout_metrics,
        "algo/advantage_abs_mean": float(batch.advantages.abs().sum() / batch.response_mask.sum().clamp(min=1)),
        **timer.metrics,
        "timing/step_s": step_s,
        "perf/tokens_per_s": gen / step_s,
        "perf/generated_tokens_per_s": gen / max(rollout_metrics["timing/rollout_s"], 1e-9),
        "data/epoch": float(lead.stream.epoch),
        "data/skipped_long_prompts": float(lead.skipped_long_prompts),
        "rollout/actor_failures": float(new_failures),
        "rollout/rerun_prompts": float(new_rerun),
        "rollout/stale_rerun_prompts": float(new_stale),
        "rollout/actors_alive": float(fleet.alive),
        "rollout/engine_calls": float(new_calls),
        **(fleet.watch.metrics() if fleet.watch is not None else {}),
    }


def evaluate(ctx: OnlineRun) -> dict[str, float]:
    """Returns greedy eval metrics of the current policy on ``eval.num_problems`` held-out prompts (rank 0; {} elsewhere)."""
    if ctx.lead is None or not ctx.lead.eval_prompts:
        return {}
    lead = ctx.lead
    return evaluate_prompts(lead.rollouts, lead.reward, lead.eval_prompts, ctx.tokenizer, build.eval_sampling(ctx.settings),
                            ctx.settings.env.reward_weight, judges=lead.judges, judge_seed=ctx.settings.run.seed)

