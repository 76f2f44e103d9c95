"""Stages 4-6 of the online step on one learner rank: reference/old logprobs and values, advantages, the update.

``rlray.run.online`` calls these with plain values (``UpdateSpec``, built from the config and the algorithm registry
by ``rlray.run.build.update_spec``): the algorithm arrives as its advantage estimator (an ``algos.Estimator``) and
its policy loss (``LossSpec.policy_loss``, a key of ``algos.POLICY_LOSSES``), never as a name. The step's tensors
travel in one ``schema.StepBatch`` that each stage fills. PPO's critic rides on the policy learner
(``learner.critic``) and takes one optimizer step per policy mini-batch.

Legend: B sequences in this rank's shard, T response tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlray import algos
from rlray.learner.batching import MicroBatching
from rlray.learner.critic import CRITIC_STAT_KEYS, critic_values, train_critic_minibatch
from rlray.learner.objective import MAX_STAT_KEYS, STAT_KEYS, LossSpec, Normaliser, reduce_stat
from rlray.learner.packing import TokenCounts
from rlray.learner.policy import PolicyLearner
from rlray.schema import StepBatch

AllReduceSum = Callable[[dict[str, float]], dict[str, float]]


@dataclass(frozen=True)
class UpdateSpec:
    """Plain values of stages 4-6.

    Attributes:
        estimator: the algorithm's advantage estimator (``Algorithm.advantage`` of ``rlray.algos.registry``).
        loss: the policy objective.
        advantage: the advantage stage.
        epochs: passes over the step's experience.
        rows_per_minibatch: this rank's rows per mini-batch (sequences_per_minibatch / world).
        batching: micro-batches (rows or a token budget per forward/backward) and their layout (padded or packed,
            prefixes shared), for every forward of stages 4 and 6.
        old_logprobs_before_update: take old logprobs in stage 4 (off-policy update, or KL in the reward);
            otherwise the update uses the detached current ones (on-policy).
        value_clip_eps: PPO critic value-loss clip (reward units), or None.
        loss_world_size: learner ranks (each rank's loss share carries this factor; see Normaliser).
        distill_weight: weight of the teacher's per-token reverse KL added to the advantages (teacher.weight with
            teacher.divergence=reverse_kl; 0: off). On, stage 4 takes teacher_logprobs and old_logprobs.
    """

    estimator: algos.Estimator
    loss: LossSpec
    advantage: algos.AdvantageSpec
    epochs: int
    rows_per_minibatch: int
    batching: MicroBatching
    old_logprobs_before_update: bool
    value_clip_eps: float | None = None
    loss_world_size: int = 1
    distill_weight: float = 0.0


def collective_sum(all_reduce_sum: AllReduceSum) -> algos.SumFn:
    """Returns an ``algos.SumFn`` over a collective's ``all_reduce_sum`` (float64 on the wire, the input's dtype back)."""

    def total(x: torch.Tensor) -> torch.Tensor:
        return torch.tensor(all_reduce_sum({"x": float(x)})["x"], dtype=x.dtype)

    return total


def reference_and_old(learner: PolicyLearner, batch: StepBatch, spec: UpdateSpec) -> StepBatch:
    """Stage 4: fills ref_logprobs [B, T] (when there is a reference), teacher_logprobs [B, T] (reverse-KL
    distillation, ``spec.distill_weight > 0``), old_logprobs [B, T] (when ``spec.old_logprobs_before_update``) and
    old_values [B, T] (PPO's critic) of ``batch``; returns it. A reference or teacher actor may have filled its
    logprobs already; the rest come from the models on this learner.

    While the policy is still the reference (``PolicyLearner.at_reference``: a run's first step) there is no
    reference pass: ref_logprobs are the old logprobs when they are taken here, else the update's own detached
    logprobs (``train_minibatch``; the step is then one optimizer step, the only one before the weights move). The
    values are the same up to float rounding between the two forwards; the KL term and its gradient are 0 at that
    point either way (k3: exp(0) - 0 - 1)."""
    mbs = spec.batching
    reuse = learner.at_reference and batch.ref_logprobs is None
    if learner.has_reference and batch.ref_logprobs is None and not reuse:
        batch.ref_logprobs = learner.logprobs(batch.inputs, reference=True, batching=mbs)
    if spec.distill_weight > 0 and batch.teacher_logprobs is None:
        batch.teacher_logprobs = learner.teacher_logprobs(batch.inputs, batching=mbs)
    if spec.old_logprobs_before_update:
        batch.old_logprobs = learner.logprobs(batch.inputs, reference=False, batching=mbs)
        if reuse:
            batch.ref_logprobs = batch.old_logprobs
    if learner.critic is not None:
        batch.old_values = critic_values(learner.critic, batch.inputs, batch.response_mask, mbs)
    return batch


def advantages(batch: StepBatch, spec: UpdateSpec, all_reduce_sum: AllReduceSum) -> StepBatch:
    """Stage 5: fills advantages [B, T] (and PPO's returns [B, T]) of ``batch`` from ``spec.estimator``; returns it.

    Shards hold whole groups, so group statistics are local; batch statistics are summed over ranks.
    """
    inputs = algos.AdvantageInputs(
        reward=batch.reward,
        group_id=batch.group_id,
        response_mask=batch.response_mask,
        old_logprobs=batch.old_logprobs,
        ref_logprobs=batch.ref_logprobs,
        old_values=batch.old_values,
        baseline_reward=batch.baseline_reward,
    )
    got = spec.estimator(inputs, spec.advantage, collective_sum(all_reduce_sum))
    batch.advantages, batch.returns = got.advantages, got.returns
    return batch


def add_reverse_kl(batch: StepBatch, weight: float, all_reduce_sum: AllReduceSum) -> dict[str, float]:
    """Stage 5b (reverse-KL distillation): adds the teacher's per-token reverse KL to ``batch.advantages``; returns
    {"algo/distill_reverse_kl": token mean over every rank, in nats}.

    advantages += ``algos.reverse_kl_advantages(old_logprobs, teacher_logprobs, response_mask, weight)``, i.e.
    -weight * (log pi_student - log pi_teacher) on loss tokens and nothing elsewhere: observation tokens of
    environment episodes and padding (response_mask False) keep their advantage untouched. Added after the
    algorithm's own normalisation, so the task advantage and the distillation signal sum as they are.

    Which student logprobs: ``old_logprobs``, the learner's own at the start of the step (stage 4 takes them
    whenever ``distill_weight > 0``), not the engine's ``rollout_logprobs``. They come from the same code,
    autocast and temperature as ``teacher_logprobs`` (``batched_logprobs``), so a teacher with the student's
    weights gives exactly 0, and the engine's numeric mismatch (or staleness, in async mode) does not enter
    the distillation signal; rollout correction weighs the samples as for any advantage.

    Args:
        batch: this rank's shard with advantages, old_logprobs and teacher_logprobs [B, T] float32 and
            response_mask [B, T] bool.
        weight: teacher.weight (advantage units per nat), > 0.
        all_reduce_sum: sums {name: float} over learner ranks (identity with one rank).
    """
    mask = batch.response_mask
    batch.advantages = batch.advantages + algos.reverse_kl_advantages(
        batch.old_logprobs, batch.teacher_logprobs, mask, weight=weight)
    diff = torch.where(mask, batch.old_logprobs.float() - batch.teacher_logprobs.float(), 0.0)
    summed = all_reduce_sum({"kl_sum": float(diff.sum()), "tokens": float(mask.sum())})
    return {"algo/distill_reverse_kl": summed["kl_sum"] / max(summed["tokens"], 1.0)}


def update(
    learner: PolicyLearner,
    batch: StepBatch,
    norms: list[Normaliser],
    spec: UpdateSpec,
    all_reduce_sum: AllReduceSum,
    all_reduce_max: AllReduceSum | None = None,
) -> dict[str, float]:
    """Stage 6: epochs x mini-batches of policy (and critic) optimizer steps; returns metrics summed over ranks.

    Mini-batch m is rows [m*k, (m+1)*k) of the shard with k = ``spec.rows_per_minibatch``; ``norms[m]`` holds
    its global token and sequence counts. Diagnostics are from the first epoch; loss, grad norms and lr are
    averaged over every optimizer step. ``all_reduce_max`` takes the max of ``MAX_STAT_KEYS`` over ranks
    (None: one rank, the local max is the max). perf/learner_tokens_{real,padding,shared} count every forward on
    the learner since the previous update (``PolicyLearner.take_tokens``: stage 4's and this one's, the critic's
    included), summed over ranks.
    """
    k, critic = spec.rows_per_minibatch, learner.critic
    totals: dict[str, float] = {}
    steps = 0
    for epoch in range(spec.epochs):
        for m, norm in enumerate(norms):
            mb = batch.rows(slice(m * k, (m + 1) * k))
            stats = learner.train_minibatch(mb, spec.loss, norm, spec.batching)
            if critic is not None:
                c = train_critic_minibatch(critic, mb, spec.value_clip_eps, norm, spec.batching)
                stats.update({"critic_grad_norm": c["grad_norm"], **{key: c[key] for key in CRITIC_STAT_KEYS}})
            steps += 1
            for key, v in stats.items():
                if epoch == 0 or key in ("grad_norm", "loss", "lr", "critic_grad_norm"):
                    totals[key] = reduce_stat(key, totals.get(key), v)
    tokens = learner.take_tokens()
    if critic is not None:
        tokens.add(critic.take_tokens())
    return _update_metrics(totals, steps, spec, critic is not None, all_reduce_sum, all_reduce_max or dict, tokens)


def _update_metrics(
    totals: dict[str, float],
    steps: int,
    spec: UpdateSpec,
    has_critic: bool,
    all_reduce_sum: AllReduceSum,
    all_reduce_max: AllReduceSum,
    tokens: TokenCounts,
) -> dict[str, float]:
    keys = tuple(k for k in STAT_KEYS if k not in MAX_STAT_KEYS) + ("loss",) + (CRITIC_STAT_KEYS if has_critic else ())
    computed = {"tokens_real": tokens.real, "tokens_padding": tokens.padding, "tokens_shared": tokens.shared}
    summed = all_reduce_sum({key: totals[key] for key in keys} | computed)
    summed.update(all_reduce_max({key: totals[key] for key in MAX_STAT_KEYS}))
    world = spec.loss_world_size
    tokens = max(summed["tokens"], 1.0)
    loss = spec.loss
    out = {
        "learner/pg_loss": summed["pg_loss_sum"] / tokens,
        "algo/kl": summed["kl_sum"] / tokens,
        "algo/clip_fraction": summed["clipped_sum"] / tokens,
        "rollout/logprob_abs_diff": summed["rollout_diff_sum"] / tokens,
        # rollout/learner mismatch, every step (0 without rollout logprobs): k3 KL(pi_rollout || pi_old), max ratio
        "algo/rollout_kl": summed["rollout_kl_sum"] / tokens,
        "algo/rollout_ratio_max": summed["rollout_ratio_max"],
        # each rank's loss is its share of the mini-batch loss times world (Normaliser.world_size)
        "learner/loss": summed["loss"] / (steps * world),
        "learner/grad_norm": totals["grad_norm"] / steps,
        "learner/lr": totals["lr"] / steps,
        **{f"perf/learner_{key}": summed[key] for key in computed},
    }
    optional = {
        "algo/entropy": (loss.entropy_coef > 0, "entropy_sum"),
        "algo/dual_clip_fraction": (loss.dual_clip is not None, "dual_clipped_sum"),
        "algo/rollout_is_weight_mean": (loss.correction != "none", "is_weight_sum"),
        "algo/rollout_corrected_token_fraction": (loss.correction != "none", "corrected_tokens"),
        "algo/distill_jsd": (loss.jsd_weight > 0, "jsd_sum"),
    }
    out.update({name: summed[key] / tokens for name, (on, key) in optional.items() if on})
    if loss.correction != "none":
        out["algo/rollout_corrected_sequence_fraction"] = summed["corrected_sequences"] / max(summed["sequences"], 1.0)
    if has_critic:
        value_tokens = max(summed["value_tokens"], 1.0)
        out["learner/value_loss"] = summed["value_loss_sum"] / value_tokens
        out["algo/value_clip_fraction"] = summed["value_clipped_sum"] / value_tokens
        out["learner/critic_grad_norm"] = totals["critic_grad_norm"] / steps
    return out
