"""The online run: ``OnlineRun`` and ``run_step``, the one place that sequences an RL step.

It runs inside the Ray Train training function on every learner rank. Rank 0 drives the rollout
actors and the reward, builds the step's experience table and hands each rank its shard through
Ray's object store; every rank takes part in the update. A step, top to bottom (``run_step``):

  1. take prompts (the data cursor lives in the snapshot)
  2. rollout on the rollout actors (rlray.rollout.fleet; in async mode, steps t+1..t+k are already in flight)
  3. rewards (in process, or the Serve application rlray-reward), and the algorithm's extra samples
  4. reference, teacher and old logprobs (skipped when they cannot change the update)
  5. advantages (plus the teacher's per-token reverse KL, with a reverse-KL teacher)
  6. learner update (mini-batches, epochs)
  7. weight sync to the rollouts (version-tagged)
  8. log, guard, snapshot, hooks (``rlray.run.session.step_boundary``, shared with offline runs), with the
     step's kept samples (``tracking.samples_per_step``: rows rank 0 picks from the whole step, their
     advantages gathered from the ranks that hold them)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import ray
import torch

from rlray import schema
from rlray.config import Config
from rlray.cores import CorePlan, parse_core_list, pin_process
from rlray.data import DataError, PromptRow, PromptStream, columns_json, load_prompt_rows, prepare_prompts
from rlray.learner import Normaliser, PolicyLearner
from rlray.learner import online as learner_online
from rlray.learner.collective import Collective
from rlray.models import load_tokenizer
from rlray.observe import samples as kept
from rlray.observe.samples import StepSample, mask_runs
from rlray.observe.tracking import Tracker
from rlray.reward import RewardFunctionError
from rlray.reward.server import LocalRewardClient, ScoreResult, ServeRewardClient
from rlray.rollout import Completion, SamplingSpec
from rlray.rollout.fleet import RolloutFleet, RolloutPipeline, gcs_actor_node
from rlray.rollout.weight_sync import make_weight_sync
from rlray.run import build, online_sampling
from rlray.run.context import RunContext, StepBoundary
from rlray.run.episodes import EpisodeLimits, EpisodeRollout, add_env_reward, episode_metrics
from rlray.run.online_sampling import Rollouts
from rlray.run.session import FatalStepError

log = logging.getLogger(__name__)

# Errors found during a step that a retry cannot fix (a reward function returning the wrong number of values,
# bad data): every rank stops at once with the message, and Ray Train does not restart the learner.
FATAL_STEP_ERRORS: tuple[type[BaseException], ...] = (RewardFunctionError, DataError)

RewardClient = LocalRewardClient | ServeRewardClient


@dataclass
class StepBatch:
    """What rank 0 hands to every rank for one step: shard references and global denominators (or the
    fatal error that ends the run)."""

    shard_refs: list[Any]
    minibatch_norms: list[Normaliser]
    rollout_metrics: dict[str, float]
    fatal: str | None = None
    sample_rows: list[int] = field(default_factory=list)  # rows of the step's table kept as samples


class StageTimer:
    """Wall time of a step's stages, kept as ``timing/<stage>_s`` metrics.

    ``with timer("rollout"): ...`` adds the block's seconds to ``timer.metrics["timing/rollout_s"]``.
    """

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing/{stage}_s"
            self.metrics[key] = self.metrics.get(key, 0.0) + time.perf_counter() - t

    def elapsed_s(self) -> float:
        """Returns the seconds since the timer was made (the step's wall time so far)."""
        return time.perf_counter() - self._start


@dataclass
class OnlineRun(RunContext):
    """Everything an online step needs on one rank; built once per worker by ``setup``.

    Rank 0 only: prompt_ids, eval_prompts, reward, fleet, pipeline (the rest of the ranks hold None/empty).
    """

    pad_token_id: int = 0
    actors: list[Any] = field(default_factory=list)
    prompt_ids: dict[str, list[int]] = field(default_factory=dict)  # prompt_id -> token ids
    eval_prompts: list[tuple[PromptRow, list[int]]] = field(default_factory=list)
    reward: RewardClient | None = None
    reward_kwargs: dict[str, Any] | None = None  # the reward config ``reward`` was built from (build.scorer_kwargs)
    reward_columns: list[str] | None = None  # the datasets' extra column names (reward functions' keyword arguments)
    fleet: RolloutFleet | None = None
    rollouts: RolloutFleet | EpisodeRollout | None = None  # the fleet, or episodes over it when env.environments is set
    pipeline: RolloutPipeline | None = None
    weight_sync: Any = None  # every rank (rlray.rollout.weight_sync)
    reference_actor: Any = None  # when resources.reference.placement == "actor"
    teacher_actor: Any = None  # when teacher.path is set and resources.teacher.placement == "actor"
    skipped_long_prompts: int = 0
    step_prompt_ids: list[str] = field(default_factory=list)  # the prompt ledger of the step in progress (rank 0)
    actor_failures_logged: int = 0  # the fleet's actor failures already counted in rollout/actor_failures (rank 0)
    rerun_prompts_logged: int = 0  # the fleet's re-sent prompts already counted in rollout/rerun_prompts (rank 0)

    def take_prompts(self) -> tuple[list[PromptRow], list[list[int]]]:
        """Stage 1 (rank 0): returns the next step's prompt rows and their token ids (advances the cursor)."""
        rows = self.stream.next_batch(self.cfg.learner.prompts_per_step)
        return rows, [self.prompt_ids[r.prompt_id] for r in rows]

    def sampling_for(self, step: int) -> SamplingSpec:
        """Returns the training SamplingSpec of 0-based ``step`` (``build.sampling_for_step``)."""
        return build.sampling_for_step(self.cfg, step)

    def run_step(self, step: int, end_step: StepBoundary) -> dict[str, float]:
        """Runs 0-based ``step`` (``run_step``)."""
        return run_step(self, step, end_step)

    def start_metrics(self) -> dict[str, float]:
        """Returns the eval metrics of the initial policy (rank 0, when ``eval.num_problems``), else {}."""
        return evaluate(self) if self.cfg.eval.num_problems else {}

    def evaluate_when_due(self, steps_done: int) -> dict[str, float]:
        """Returns eval metrics every ``eval.every_steps`` steps and after the last one (rank 0), else {}."""
        cfg, every = self.cfg, self.cfg.eval.every_steps
        due = (every and steps_done % every == 0) or steps_done == cfg.run.max_steps
        return evaluate(self) if cfg.eval.num_problems and due else {}

    def progress_text(self, steps_done: int, metrics: dict[str, float]) -> str:
        """Returns 'rlray step k/N reward=... kl=... tokens/s=...'."""
        return (f"rlray step {steps_done}/{self.cfg.run.max_steps} reward={metrics['reward/mean']:.3f} "
                f"kl={metrics['algo/kl']:.4f} tokens/s={metrics['perf/tokens_per_s']:.0f}")

    def reload_rollouts(self) -> None:
        """Pushes the learner's current policy to every rollout actor, tagged with ``policy_version``.

        Used at start, after a restore and after a rollback, so the engines generate with exactly the
        learner's weights; it is stage 7's push with the version kept.
        """
        if self.rank == 0:
            self.pipeline.reset()  # drop rollouts in flight (async mode): they used the old weights
        self.policy_version -= 1
        self.policy_version = sync_weights(self)
        kwargs = build.scorer_kwargs(self.cfg, self.reward_columns) if self.rank == 0 else None
        if self.rank == 0 and self.reward_kwargs != kwargs:  # a rollback may change reward.*
            self.reward.close()
            self.reward, self.reward_kwargs = build.reward_client(self.cfg, self.reward_columns), kwargs

    def cursor_state(self) -> dict[str, Any]:
        """Returns the data cursor a snapshot keeps (``RolloutPipeline.cursor_state``): it counts every prompt taken,
        refills and the steps in flight included, and names where each step in flight took its prompts."""
        return self.pipeline.cursor_state()

    def load_cursor_state(self, state: dict[str, Any]) -> None:
        """Sets the data cursor to a snapshot's ``state``; the steps then in flight take the same prompts again."""
        self.pipeline.load_cursor_state(state)

    def close(self) -> None:
        """Closes rank 0's reward client."""
        if self.reward is not None:
            self.reward.close()


# --------------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------------
def setup(cfg: Config, coll: Collective, *, model_dir: str, actors: list[Any], run_id: str | None,
          reference_actor: Any = None, env_hosts: list[Any] | None = None, teacher_dir: str | None = None,
          teacher_actor: Any = None) -> OnlineRun:
    """Builds the learner on every rank; on rank 0 also the data stream, eval prompts, tracker, fleet and reward client.

    ``teacher_dir`` (``teacher.path`` resolved by the driver) is loaded on every rank's learner when
    ``resources.teacher.placement == "learner"``; with placement actor, ``teacher_actor`` serves its logprobs.

    Raises:
        rlray.data.DataError: the prompt files cannot be read (names the file and line).
    """
    plan = pin_learner(cfg, coll.rank)
    build.seed_everything(cfg.run.seed + coll.rank)
    tokenizer = load_tokenizer(model_dir, cfg.model.chat_template)
    kwargs = build.learner_kwargs(cfg, coll.world, with_reference=reference_actor is None, teacher_dir=teacher_dir)
    critic = build.ppo_critic(cfg, model_dir, kwargs["wrap_model"]) if cfg.algo.name == "ppo" else None
    learner = PolicyLearner(model_dir, critic=critic, **kwargs)
    ctx = OnlineRun(cfg, coll, learner, tokenizer, pad_token_id=tokenizer.pad_token_id, actors=actors,
                    reference_actor=reference_actor, teacher_actor=teacher_actor)
    if coll.rank == 0:
        render = dict(instruction=cfg.data.instruction, system_prompt=cfg.data.system_prompt)
        all_train_rows = load_prompt_rows(cfg.data.train_files, prompt_column=cfg.data.prompt_column)
        train_rows, train_ids, ctx.skipped_long_prompts = prepare_prompts(
            all_train_rows, tokenizer, max_prompt_tokens=cfg.data.max_prompt_tokens, long_prompts=cfg.data.long_prompts,
            **render,
        )
        ctx.stream = PromptStream(train_rows, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        ctx.prompt_ids = {r.prompt_id: ids for r, ids in zip(train_rows, train_ids, strict=True)}
        if cfg.eval.num_problems:
            eval_rows = load_prompt_rows(cfg.data.eval_files, prompt_column=cfg.data.prompt_column)[: cfg.eval.num_problems]
            rows, ids, _ = prepare_prompts(eval_rows, tokenizer, max_prompt_tokens=10**9, **render)
            ctx.eval_prompts = list(zip(rows, ids, strict=True))
        ctx.tracker = Tracker(cfg.tracking.mlflow_uri, cfg.tracking.experiment, run_id=run_id,
                              tensorboard_dir=cfg.tracking.tensorboard_dir)
        ctx.reward_columns = build.dataset_columns(all_train_rows + [r for r, _ in ctx.eval_prompts])
        ctx.reward = build.reward_client(cfg, ctx.reward_columns)
        ctx.reward_kwargs = build.scorer_kwargs(cfg, ctx.reward_columns)
        ctx.fleet = RolloutFleet(actors, node_wait_s=cfg.resources.node_wait_s)
        ctx.rollouts = episode_rollout(cfg, ctx.fleet, env_hosts or [], tokenizer) if cfg.env.enabled else ctx.fleet
        here = ray.get_runtime_context().get_node_id()
        nodes = [gcs_actor_node(a) for a in actors]
        overlap, why = build.rollout_overlap(cfg, plan, shares_node=any(n in (None, here) for n in nodes))
        if cfg.rollout.max_staleness:
            log.info("async rollouts (max_staleness %d): overlap %s (%s)", cfg.rollout.max_staleness,
                     "on" if overlap else "off", why)
        ctx.pipeline = RolloutPipeline(ctx.rollouts, ctx.take_prompts, ctx.sampling_for, cfg.rollout.max_staleness,
                                       cursor=ctx.stream.state_dict, restore_cursor=ctx.stream.load_state_dict,
                                       overlap=overlap)
    dtype = torch.bfloat16 if build.compute_dtype(cfg) == "bfloat16" else torch.float32
    ctx.weight_sync = make_weight_sync(
        cfg.weight_sync_backend, ctx.fleet, dtype,
        wait=cfg.rollout.max_staleness == 0, tensor_parallel_size=cfg.resources.rollout.tensor_parallel_size,
    )
    return ctx


def episode_rollout(cfg: Config, fleet: RolloutFleet, hosts: list[Any], tokenizer: Any) -> EpisodeRollout:
    """Returns the episode rollout of ``cfg.env`` over ``fleet`` and the environment hosts (rank 0)."""
    from rlray.data.prompts import prompt_messages

    env = cfg.env
    limits = EpisodeLimits(env.max_turns, cfg.episode_tokens, env.max_observation_tokens, env.episode_timeout_s)

    def prepare(messages: list[dict]) -> list[dict]:
        return prompt_messages(messages, instruction=cfg.data.instruction, system_prompt=cfg.data.system_prompt)

    return EpisodeRollout(fleet, hosts, tokenizer, limits, env_column=env.column, default_env=env.default,
                          known_envs=list(env.environments), prepare=prepare,
                          chat_template_kwargs=cfg.rollout.chat_template_kwargs, prompt_column=cfg.data.prompt_column)


def pin_learner(cfg: Config, rank: int) -> CorePlan:
    """Sets this learner worker's torch threads and, on CPU, pins its process to its cores, both as
    ``rlray.run.build.core_plan`` says (``learner.torch_threads`` / ``learner.cpu_affinity`` when set,
    else the default for a synchronous or an async run on this machine); returns that plan."""
    plan = build.core_plan(cfg)
    torch.set_num_threads(plan.learner_threads)
    if plan.learner_cores is None or cfg.resources.learner.gpus > 0:
        log.info("learner rank %d: %d torch threads, not pinned (%s)", rank, plan.learner_threads, plan.why)
        return plan
    cores = parse_core_list(plan.learner_cores[rank % len(plan.learner_cores)])
    log.info("learner rank %d: %d torch threads, pinned to cores %s (%s)", rank, plan.learner_threads,
             pin_process(cores), plan.why)
    return plan


# --------------------------------------------------------------------------------------------
# The step
# --------------------------------------------------------------------------------------------
def run_step(ctx: OnlineRun, step: int, end_step: StepBoundary) -> dict[str, float]:
    """Runs one RL step (stages 1-8) on this rank; returns its metrics (complete on rank 0).

    Raises:
        FatalStepError: on every rank, when rank 0's stages 1-3 hit one of ``FATAL_STEP_ERRORS``.
    """
    timer, spec = StageTimer(), build.update_spec(ctx.cfg, ctx.world)
    table, rollout_metrics, fatal = None, None, None
    if ctx.rank == 0:
        try:  # 1-3. prompts, rollout, rewards (rank 0)
            table, rollout_metrics = collect_experience(ctx, step, timer)
        except FATAL_STEP_ERRORS as err:
            fatal = f"{type(err).__name__}: {err}"
    shard, batch = distribute(ctx, table, rollout_metrics, fatal, step=step)
    data = schema.collate(shard, ctx.pad_token_id)
    with timer("logprobs"):  # 4. reference, teacher and old logprobs
        data = reference_and_old_logprobs(ctx, data, spec)
    with timer("advantages"):  # 5. advantages, the teacher's reverse KL, and those of the kept samples (every rank)
        data = compute_advantages(ctx, data, spec)
        distill_metrics = distill_advantages(ctx, data, spec)
        advantages = sample_advantages(ctx, data, batch.sample_rows)
    with timer("update"):  # 6. learner update
        metrics = update_policy(ctx, data, batch.minibatch_norms, spec) | distill_metrics
    with timer("weight_sync"):  # 7. weight sync
        ctx.policy_version = sync_weights(ctx)
    samples: list[StepSample] = []
    if ctx.rank == 0:
        metrics.update(step_metrics(ctx, batch.rollout_metrics, data, timer))
        samples = step_samples(ctx.tokenizer, table, batch.sample_rows, advantages, step + 1)
    end_step(metrics, samples, list(ctx.step_prompt_ids) if ctx.rank == 0 else None)  # 8. log, guard, snapshot, hooks
    return metrics


def collect_experience(ctx: OnlineRun, step: int, timer: StageTimer) -> tuple[pa.Table, dict[str, float]]:
    """Stages 1-3 (rank 0): returns the step's experience table and its reward/rollout metrics.

    Samples whose reward failed are counted in reward/failed and logged; a step whose groups all lack
    reward variance (zero advantages for the group estimators) is logged as having no signal. The ids of
    the prompts the step consumes (its own, then any DAPO refills; ``rlray.run.ledger``) are left in
    ``ctx.step_prompt_ids``.
    """
    with timer("rollout"):  # 1-2. prompts and rollout; the pipeline keeps steps step+1..step+max_staleness in flight
        got = ctx.pipeline.next(step)
    ctx.step_prompt_ids = [r.prompt_id for r in got.rows]
    with timer("reward"):  # 3. rewards
        scored = score(ctx.reward, got.rows, got.completions, ctx.tokenizer, ctx.cfg.env.reward_weight)
    with timer("algo_sampling"):  # 3b. DAPO refill, overlong shaping, ReMax's greedy baseline
        drawn = Rollouts(got.rows, got.prompt_ids, got.completions, scored.values)
        drawn, baseline, algo_metrics = algorithm_sampling(ctx, ctx.sampling_for(step), drawn)
    mask_truncated = ctx.cfg.algo.mask_truncated
    table = build_experience(drawn.rows, drawn.prompt_ids, drawn.completions, drawn.rewards, baseline,
                             mask_truncated=mask_truncated)
    stats = rollout_stats(table, drawn.rewards, ctx.cfg.learner.prompts_per_step, ctx.policy_version,
                          mask_truncated=mask_truncated)
    stats.update(episode_metrics(drawn.completions))
    if stats["reward/failed"]:
        log.warning("step %d: %d of %d samples have no reward (a reward function failed); they are left out of "
                    "the update (reward/failed)", step + 1, stats["reward/failed"], table.num_rows)
    if stats["algo/groups_without_signal"] == 1.0:
        log.warning("step %d: no prompt group has rewards that differ: the advantages are zero and the update "
                    "carries no reward signal (algo/groups_without_signal=1)", step + 1)
    return table, {**stats, **algo_metrics, **timer.metrics, "reward/version": float(scored.version)}


def step_metrics(ctx: OnlineRun, rollout_metrics: dict[str, float], data: dict[str, torch.Tensor],
                 timer: StageTimer) -> dict[str, float]:
    """Returns rank 0's step-level metrics: rollout and reward statistics, stage times, throughput, data position, and
    the fleet's health: rollout/actor_failures and rollout/rerun_prompts (actor failures the fleet saw, and prompts it
    sent again because of them, since the previous step; advances ``ctx.actor_failures_logged`` and
    ``ctx.rerun_prompts_logged``) and rollout/actors_alive (actors in use after the step)."""
    step_s = timer.elapsed_s()
    failures = ctx.fleet.failures if ctx.fleet is not None else 0
    new_failures, ctx.actor_failures_logged = failures - ctx.actor_failures_logged, failures
    rerun = ctx.fleet.rerun_prompts if ctx.fleet is not None else 0
    new_rerun, ctx.rerun_prompts_logged = rerun - ctx.rerun_prompts_logged, rerun
    gen = rollout_metrics["rollout/generated_tokens"]
    return {
        **{k: v for k, v in rollout_metrics.items() if not k.startswith("_")},
        "algo/advantage_abs_mean": float(data["advantages"].abs().sum() / data["response_mask"].sum().clamp(min=1)),
        **timer.metrics,
        "timing/step_s": step_s,
        "perf/tokens_per_s": gen / step_s,
        "perf/generated_tokens_per_s": gen / max(rollout_metrics["timing/rollout_s"], 1e-9),
        "data/epoch": float(ctx.stream.epoch),
        "data/skipped_long_prompts": float(ctx.skipped_long_prompts),
        "rollout/actor_failures": float(new_failures),
        "rollout/rerun_prompts": float(new_rerun),
        "rollout/actors_alive": float(ctx.fleet.alive if ctx.fleet is not None else 0),
    }


# --------------------------------------------------------------------------------------------
# Stages
# --------------------------------------------------------------------------------------------
def score(reward: RewardClient, rows: list[PromptRow], completions: list[Completion], tokenizer: Any,
          env_reward_weight: float = 1.0) -> ScoreResult:
    """Stage 3: returns the reward version and {"reward", <term name>, ...}, one value per completion.

    Each completion is scored with its prompt as the dataset had it (a string or TRL messages), its
    decoded text (special tokens skipped; an episode's text holds every turn and observation), its token
    ids and its row's other columns (TRL's keyword arguments). Term values: a float, NaN (failed) or
    None (the term skipped the sample). Episodes add the environment's reward as the term "env"
    (``rlray.run.episodes.add_env_reward``, weighted by env.reward_weight).
    """
    texts = tokenizer.batch_decode([c.response_token_ids for c in completions], skip_special_tokens=True)
    prompts = [rows[c.prompt_index].prompt for c in completions]
    columns = [rows[c.prompt_index].columns for c in completions]
    got = reward.score(prompts, texts, columns, [list(c.response_token_ids) for c in completions])
    if any(c.episode is not None for c in completions):
        got = dataclasses.replace(got, values=add_env_reward(got.values, completions, env_reward_weight))
    return got


def algorithm_sampling(
    ctx: OnlineRun, sampling: SamplingSpec, batch: Rollouts
) -> tuple[Rollouts, list[float] | None, dict[str, float]]:
    """Stage 3b (rank 0): DAPO refill, overlong shaping and ReMax's greedy baseline (``online_sampling.apply``).

    The ids of refill prompts are appended to ``ctx.step_prompt_ids`` (the step's prompt ledger) as they are
    taken from the stream, whether or not their groups are kept.
    """
    weight = ctx.cfg.env.reward_weight

    def draw(num_prompts: int, round_index: int) -> Rollouts:  # stages 1-3 for further prompts, reseeded per round
        rows = ctx.stream.next_batch(num_prompts)
        ctx.step_prompt_ids.extend(r.prompt_id for r in rows)
        ids = [ctx.prompt_ids[r.prompt_id] for r in rows]
        seed = None if sampling.seed is None else sampling.seed + 100_003 * round_index
        completions = ctx.rollouts.generate(ids, dataclasses.replace(sampling, seed=seed), rows)
        return Rollouts(rows, ids, completions, score(ctx.reward, rows, completions, ctx.tokenizer, weight).values)

    def greedy(b: Rollouts) -> Rollouts:  # one temperature-0 completion per prompt, scored
        greedy_spec = SamplingSpec(n=1, max_new_tokens=sampling.max_new_tokens, temperature=0.0, stop=sampling.stop)
        done = ctx.rollouts.generate(b.prompt_ids, greedy_spec, b.rows)  # episodes: one greedy episode per prompt
        return Rollouts(b.rows, b.prompt_ids, done, score(ctx.reward, b.rows, done, ctx.tokenizer, weight).values)

    return online_sampling.apply(batch, draw, greedy, online_sampling.spec_from(ctx.cfg))


def build_experience(
    rows: list[PromptRow],
    prompt_ids: list[list[int]],
    completions: list[Completion],
    rewards: dict[str, list[float]],
    baseline_rewards: list[float] | None = None,
    *,
    mask_truncated: bool = False,
) -> pa.Table:
    """Returns the step's experience table (``schema.EXPERIENCE_SCHEMA``), one row per completion.

    ``baseline_rewards`` (ReMax: the greedy response's reward, one per completion) fills baseline_reward.
    response_mask is the completion's loss mask (all True for single-turn rollouts). A completion whose
    reward (or baseline) is NaN failed in the reward stage: its response_mask is all False, so no
    advantage statistic and no loss term sees it (``learner.advantages`` takes a row as valid when its
    mask has a True), and its reward stays NaN in the table. With ``mask_truncated`` (``algo.mask_truncated``)
    a completion that hit max_new_tokens (finish_reason "length") is masked the same way, its reward kept.
    """
    comps = {k: v for k, v in rewards.items() if k != "reward"}
    extra = {} if baseline_rewards is None else {"baseline_reward": baseline_rewards}
    scored = [math.isfinite(r) for r in rewards["reward"]]
    if baseline_rewards is not None:
        scored = [ok and math.isfinite(b) for ok, b in zip(scored, baseline_rewards, strict=True)]
    if mask_truncated:
        scored = [ok and c.finish_reason != "length" for ok, c in zip(scored, completions, strict=True)]
    return schema.make_table(
        {
            **extra,
            "prompt_id": [rows[c.prompt_index].prompt_id for c in completions],
            "group_id": [c.prompt_index for c in completions],
            "sample_index": [c.sample_index for c in completions],
            "prompt_token_ids": [c.prompt_token_ids or prompt_ids[c.prompt_index] for c in completions],
            "response_token_ids": [c.response_token_ids for c in completions],
            "response_mask": [[ok and m for m in c.loss_mask] for c, ok in zip(completions, scored, strict=True)],
            "rollout_logprobs": [c.rollout_logprobs for c in completions],
            "reward": rewards["reward"],
            "reward_components": [{k: v[i] for k, v in comps.items()} for i in range(len(completions))],
            "prompt_columns": [columns_json(rows[c.prompt_index]) for c in completions],
            "policy_version": [c.policy_version for c in completions],
            "finish_reason": [c.finish_reason for c in completions],
            **episode_columns(completions),
        }
    )


def episode_columns(completions: list[Completion]) -> dict[str, list]:
    """Returns the experience columns of episodes (stop_reason, num_turns, turn_rewards), {} when none is an episode."""
    if all(c.episode is None for c in completions):
        return {}
    return {
        "stop_reason": [c.episode.stop_reason if c.episode else None for c in completions],
        "num_turns": [c.episode.num_turns if c.episode else None for c in completions],
        "turn_rewards": [[math.nan if r is None else r for r in c.episode.turn_rewards] if c.episode else None
                         for c in completions],
    }


def minibatch_normalisers(table: pa.Table, cfg: Config, world: int) -> list[Normaliser]:
    """Returns the global token and sequence counts of each mini-batch (rank 0, after all masking).

    Mini-batch m takes rows [m*k, (m+1)*k) of every rank's shard, k = sequences_per_minibatch / world.
    """
    valid = np.array([sum(m) for m in table.column("response_mask").to_pylist()], dtype=np.float64)
    per_rank = table.num_rows // world
    k = cfg.learner.sequences_per_minibatch // world
    norms = []
    for m in range(per_rank // k):
        idx = np.concatenate([np.arange(r * per_rank + m * k, r * per_rank + (m + 1) * k) for r in range(world)])
        norms.append(Normaliser(float(max(valid[idx].sum(), 1.0)), float(len(idx)), world))
    return norms


def distribute(
    ctx: OnlineRun, table: pa.Table | None, rollout_metrics: dict[str, float] | None, fatal: str | None = None, *,
    step: int = 0,
) -> tuple[pa.Table, StepBatch]:
    """Hands every rank its contiguous shard of whole groups through the object store.

    Rank 0 puts one Arrow table per rank (``ray.put``) and broadcasts only the references; each rank
    then fetches its own shard, so experience never passes through the other ranks. The broadcast also
    carries the rows of 0-based ``step`` kept as samples (``observe.samples.pick_rows``).

    Raises:
        FatalStepError: on every rank, when rank 0 passes ``fatal`` (its stages 1-3 hit a fatal error).
    """
    batch = None
    if ctx.rank == 0 and fatal is not None:
        batch = StepBatch([], [], {}, fatal)
    elif ctx.rank == 0:
        refs = [ray.put(table.slice(s.start, s.stop - s.start)) for s in
                (schema.shard_rows(table.num_rows, r, ctx.world) for r in range(ctx.world))]
        rows = kept.pick_rows(table.column("group_id").to_pylist(), ctx.cfg.tracking.samples_per_step, ctx.cfg.run.seed,
                              step + 1)
        batch = StepBatch(refs, minibatch_normalisers(table, ctx.cfg, ctx.world), rollout_metrics or {}, sample_rows=rows)
    batch = ctx.coll.broadcast(batch)
    if batch.fatal is not None:
        raise FatalStepError(batch.fatal)
    return ray.get(batch.shard_refs[ctx.rank]), batch


def reference_and_old_logprobs(ctx: OnlineRun, data: dict[str, torch.Tensor],
                               spec: learner_online.UpdateSpec) -> dict[str, torch.Tensor]:
    """Stage 4: adds ref_logprobs (KL on), teacher_logprobs (reverse-KL distillation), old_logprobs (off-policy
    update, KL in the reward, or reverse-KL distillation) and old_values (PPO).

    With one epoch and one mini-batch the update is on-policy: old logprobs equal the current ones
    and are taken inside the update (no extra forward), as TRL does for a single iteration, unless the
    KL sits in the reward, whose penalty needs them before the advantages, or a reverse-KL teacher needs
    them. A reference or teacher actor (placement actor) sends [B, T] logprobs of the sampled tokens only;
    a JSD teacher sits on the learner and is run inside the update's micro-batches instead.
    """
    mbs = ctx.cfg.learner.sequences_per_microbatch
    if ctx.reference_actor is not None:  # resources.reference.placement == "actor"
        data["ref_logprobs"] = ray.get(ctx.reference_actor.logprobs.remote(data, mbs))
    if ctx.teacher_actor is not None and spec.distill_weight > 0:  # resources.teacher.placement == "actor"
        data["teacher_logprobs"] = ray.get(ctx.teacher_actor.logprobs.remote(data, mbs))
    return learner_online.reference_and_old(ctx.learner, data, spec)


def compute_advantages(ctx: OnlineRun, data: dict[str, torch.Tensor], spec: learner_online.UpdateSpec) -> dict[str, torch.Tensor]:
    """Stage 5: adds the algorithm's advantages (``learner.ADVANTAGE_ESTIMATORS[algo.name]``); batch statistics over all ranks."""
    return learner_online.advantages(data, spec, ctx.coll.all_reduce_sum)


def distill_advantages(ctx: OnlineRun, data: dict[str, torch.Tensor], spec: learner_online.UpdateSpec) -> dict[str, float]:
    """Stage 5b: adds the teacher's per-token reverse KL to the advantages (``learner_online.add_reverse_kl``; a
    collective every rank calls); returns {"algo/distill_reverse_kl": token mean}, or {} without a reverse-KL teacher."""
    if spec.distill_weight <= 0:
        return {}
    return learner_online.add_reverse_kl(data, spec.distill_weight, ctx.coll.all_reduce_sum)


def sample_advantages(ctx: OnlineRun, data: dict[str, torch.Tensor], rows: list[int]) -> list[float]:
    """Stage 5b: returns the sequence advantage of each kept row (``rows``: indices into the step's whole table).

    A row's sequence advantage is its first loss token's advantage (for group estimators, the one value
    broadcast over the row), NaN when no token counts (a failed reward). Each rank fills in the rows of
    its shard; one sum over ranks gathers them (a collective every rank calls when samples are kept).

    Args:
        data: this rank's shard, with advantages [B/world, T] float32 and response_mask [B/world, T] bool.
    """
    if not rows:
        return []
    per_rank = data["advantages"].shape[0]
    local = {}
    for i, row in enumerate(rows):
        j, value = row - ctx.rank * per_rank, 0.0
        if 0 <= j < per_rank:
            mask = data["response_mask"][j]
            value = float(data["advantages"][j][mask][0]) if mask.any() else math.nan
        local[f"{i:06d}"] = value
    summed = ctx.coll.all_reduce_sum(local)
    return [summed[f"{i:06d}"] for i in range(len(rows))]


def step_samples(tokenizer: Any, table: pa.Table, rows: list[int], advantages: list[float], step: int) -> list[StepSample]:
    """Returns the kept samples of 1-based ``step`` (rank 0): rows ``rows`` of the step's experience table with
    prompt and completion decoded (special tokens kept, so the chat template and EOS show) and ``advantages``
    (``sample_advantages``)."""
    picked = table.take(rows).to_pylist() if rows else []
    prompts = tokenizer.batch_decode([r["prompt_token_ids"] for r in picked], skip_special_tokens=False)
    completions = tokenizer.batch_decode([r["response_token_ids"] for r in picked], skip_special_tokens=False)
    return [
        StepSample(step, r["prompt_id"], prompt, completion, math.nan if r["reward"] is None else float(r["reward"]),
                   dict(r["reward_components"] or []), adv, r["finish_reason"], int(r["policy_version"]),
                   len(r["response_token_ids"]), r["stop_reason"], r["num_turns"],
                   None if r["turn_rewards"] is None else tuple(r["turn_rewards"]), episode_segments(tokenizer, r))
        for r, prompt, completion, adv in zip(picked, prompts, completions, advantages, strict=True)
    ]


def episode_segments(tokenizer: Any, row: dict[str, Any]) -> tuple[tuple[bool, str], ...]:
    """Returns an episode row's response cut where its response_mask flips, each run decoded (special tokens kept):
    (True, sampled text) or (False, observation text); () for a single-turn row (no num_turns) and for a row whose
    mask is all off (``StepSample.segments``)."""
    mask = row["response_mask"]
    if row["num_turns"] is None or not any(mask):
        return ()
    ids = row["response_token_ids"]
    return tuple((sampled, tokenizer.decode(ids[a:b], skip_special_tokens=False)) for a, b, sampled in mask_runs(mask))


def update_policy(ctx: OnlineRun, data: dict[str, torch.Tensor], norms: list[Normaliser],
                  spec: learner_online.UpdateSpec) -> dict[str, float]:
    """Stage 6: epochs x mini-batches of optimizer steps (and PPO's critic); returns statistics summed over ranks."""
    return learner_online.update(ctx.learner, data, norms, spec, ctx.coll.all_reduce_sum, ctx.coll.all_reduce_max)


def sync_weights(ctx: OnlineRun) -> int:
    """Stage 7: pushes the policy from the learner to every rollout actor; returns the new policy version.

    Object store on CPU, NCCL broadcast or CUDA IPC on GPU (``rlray.rollout.weight_sync``); in async mode
    the push queues behind the rollouts already in flight instead of waiting for them.
    """
    version = ctx.policy_version + 1
    ctx.weight_sync.push(ctx.learner, ctx.rank, version)
    return version


def rollout_stats(
    table: pa.Table, rewards: dict[str, list[float]], prompts_per_step: int, learner_version: int, *,
    mask_truncated: bool = False,
) -> dict[str, float]:
    """Returns reward/* and rollout/* metrics of a step's experience (rank 0).

    Reward statistics are over the samples that have a reward; ``reward/failed`` counts the others (a
    reward function raised, timed out or returned NaN: ``build_experience`` masked them out). A group
    has no signal when fewer than 2 of its samples enter the update (a reward and a True in their
    response_mask) or their rewards are all equal. With ``mask_truncated``, ``rollout/truncated_masked``
    counts the samples left out of the loss for hitting max_new_tokens (finish_reason "length").
    Staleness of a sample = the learner's policy version that the update starts from, minus the
    version that generated the sample (0 in synchronous mode, at most rollout.max_staleness).
    """
    lengths = np.asarray(table.column("response_token_ids").combine_chunks().value_lengths(), dtype=np.float64)
    r = np.asarray(rewards["reward"], dtype=np.float64)
    ok = np.isfinite(r)
    in_update = ok & np.asarray([any(m) for m in table.column("response_mask").to_pylist()], dtype=bool)
    groups = np.where(in_update, r, np.nan).reshape(prompts_per_step, -1)
    finish = table.column("finish_reason").to_pylist()
    truncated = np.asarray([f == "length" for f in finish], dtype=bool)
    extra = {"rollout/truncated_masked": float(truncated.sum())} if mask_truncated else {}
    spread = [np.ptp(g[np.isfinite(g)]) > 0 if np.isfinite(g).sum() >= 2 else False for g in groups]
    staleness = learner_version - np.asarray(table.column("policy_version").to_pylist(), dtype=np.float64)
    return {
        "reward/mean": float(r[ok].mean()) if ok.any() else math.nan,
        "reward/std": float(r[ok].std()) if ok.any() else math.nan,
        "reward/failed": float((~ok).sum()),
        **term_metrics(rewards, "reward"),
        "algo/groups_without_signal": float(1.0 - np.mean(spread)),
        "rollout/response_tokens_mean": float(lengths.mean()),
        "rollout/truncated_rate": float(truncated.mean()),
        **extra,
        "rollout/generated_tokens": float(lengths.sum()),
        "rollout/policy_version": float(min(table.column("policy_version").to_pylist())),
        "rollout/staleness_mean": float(staleness.mean()),
        "rollout/staleness_max": float(staleness.max()),
    }




# --------------------------------------------------------------------------------------------
# Evaluation (training's and ``rlray eval``'s)
# --------------------------------------------------------------------------------------------
def term_metrics(rewards: dict[str, list[float | None]], prefix: str) -> dict[str, float]:
    """Returns ``<prefix>/<term>`` and ``<prefix>/<term>_skipped`` for every reward term but the summed "reward".

    ``<term>`` is the mean over the samples the term scored (None: skipped; NaN: failed, both left out;
    NaN when none was scored); ``<term>_skipped`` counts the samples it returned None for (TRL's rule:
    the term does not apply). The reward model's raw score is ``reward/model_score`` (``online_sampling``).

    Args:
        rewards: {"reward": [B], <term>: [B] floats, NaN or None} (``RewardScorer.score``).
        prefix: "reward" for a step, "eval" for evaluation.
    """
    out: dict[str, float] = {}
    for name, values in rewards.items():
        if name in ("reward", "reward_model"):
            continue
        scored = [v for v in values if v is not None and math.isfinite(v)]
        out[f"{prefix}/{name}"] = float(np.mean(scored)) if scored else math.nan
        out[f"{prefix}/{name}_skipped"] = float(sum(v is None for v in values))
    return out


def evaluate(ctx: OnlineRun) -> dict[str, float]:
    """Returns greedy eval metrics of the current policy on ``eval.num_problems`` held-out prompts (rank 0; {} elsewhere)."""
    if not ctx.eval_prompts:
        return {}
    return evaluate_prompts(ctx.rollouts, ctx.reward, ctx.eval_prompts, ctx.tokenizer, build.eval_sampling(ctx.cfg),
                            ctx.cfg.env.reward_weight)


def evaluate_prompts(fleet: RolloutFleet | EpisodeRollout, reward: RewardClient, prompts: list[tuple[PromptRow, list[int]]],
                     tokenizer: Any, sampling: SamplingSpec, env_reward_weight: float = 1.0,
                     pass_k: SamplingSpec | None = None) -> dict[str, float]:
    """Returns eval/reward_mean, eval/<term> and eval/<term>_skipped per reward term, eval/response_tokens_mean and
    eval/num_problems; with environments also eval/env_success (share of episodes whose environment reward is
    above 0), eval/env_turns_mean, eval/env_failed and eval/env_metric/<name> (means of the environments' numbers);
    with ``pass_k`` also eval/pass@<k>.

    One completion (or episode) per prompt (``sampling``: greedy for training's eval and ``rlray eval``), spread
    over the rollout actors, scored by ``reward``. Term means are over the prompts the term applied to
    (``term_metrics``); response length is in tokens, EOS included. ``pass_k`` (k = its n samples per prompt)
    adds the share of prompts with a sample whose reward is above 0.
    """
    rows = [r for r, _ in prompts]
    completions = fleet.generate([ids for _, ids in prompts], sampling, rows)
    got = score(reward, rows, completions, tokenizer, env_reward_weight).values
    rewards = np.asarray(got["reward"], dtype=np.float64)
    episodes = [c.episode for c in completions if c.episode is not None and c.episode.environment]
    env_metrics = {} if not episodes else {
        "eval/env_success": float(np.mean([(e.env_reward or 0.0) > 0 and not e.failed for e in episodes])),
        "eval/env_turns_mean": float(np.mean([e.num_turns for e in episodes])),
        "eval/env_failed": float(sum(e.failed for e in episodes)),
        **{f"eval/env_metric/{k}": float(np.mean([e.metrics[k] for e in episodes if k in e.metrics]))
           for k in sorted({k for e in episodes for k in e.metrics})},
    }
    if pass_k is not None:
        sampled = fleet.generate([ids for _, ids in prompts], pass_k, rows)
        values = np.asarray(score(reward, rows, sampled, tokenizer, env_reward_weight).values["reward"], dtype=np.float64)
        solved = np.nan_to_num(values, nan=0.0).reshape(len(rows), pass_k.n) > 0
        env_metrics[f"eval/pass@{pass_k.n}"] = float(solved.any(axis=1).mean())
    return {
        "eval/reward_mean": float(np.nanmean(rewards)) if np.isfinite(rewards).any() else math.nan,
        **term_metrics(got, "eval"),
        **env_metrics,
        "eval/response_tokens_mean": float(np.mean([len(c.response_token_ids) for c in completions])),
        "eval/num_problems": float(len(completions)),
    }
