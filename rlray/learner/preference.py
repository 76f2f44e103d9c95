"""Objectives of the offline methods on preference pairs, composed from ``rlray.algos.preference``.

``PAIR_OBJECTIVES[name](outputs, mb, spec, norm) -> (loss share, stats)`` for one micro-batch of P pairs
laid out as 2P rows, the chosen responses first (``schema.PairBatch`` from ``rlray.data.pairs.collate_pairs``);
an offline algorithm's registry entry names its objective (``Algorithm.pair_objective``). ``outputs`` is what
``pair_outputs`` returns: token logprobs [2P, T] float32 for the language-model methods, scores [2P] float32
for a reward head (``reward_model``). Losses are per-pair (per-example for KTO) means over the whole step, so each
micro-batch returns sum / global count * world_size (the aggregation contract of ``algos.aggregate_loss``).

Every objective also reports implicit rewards, for the pairwise accuracy (chosen reward > rejected reward):
beta * (log pi - log ref) summed over the response for dpo/ipo/kto (TRL's rewards/chosen), beta * mean token
logprob for orpo and simpo, the mean token logprob for sft, and the reward head's score for reward_model.

Legend: P pairs in the micro-batch, T response tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlray import algos
from rlray.learner.logprobs import response_logprobs
from rlray.models.heads import sequence_scores
from rlray.schema import PairBatch

PAIR_STAT_KEYS = ("pairs", "correct", "chosen_count", "chosen_reward_sum", "rejected_count", "rejected_reward_sum")


@dataclass(frozen=True)
class PreferenceSpec:
    """Plain values of an offline objective (built from ``cfg.algo`` by ``rlray.run.offline``).

    Attributes:
        beta: dpo/ipo/kto KL strength, orpo's lambda, simpo's reward scale.
        dpo_loss: "sigmoid" | "robust" | "hinge" (a key of ``algos.PAIRWISE_LOSSES``), for dpo.
        label_smoothing: rDPO label-flip rate (dpo_loss "robust").
        kto_desirable_weight / kto_undesirable_weight: KTO's lambda_D and lambda_U.
        simpo_gamma: SimPO target margin.
        rm_center_coef: reward-model centering weight.
    """

    beta: float = 0.1
    dpo_loss: str = "sigmoid"
    label_smoothing: float = 0.0
    kto_desirable_weight: float = 1.0
    kto_undesirable_weight: float = 1.0
    simpo_gamma: float = 0.5
    rm_center_coef: float = 0.0


@dataclass(frozen=True)
class PairNormaliser:
    """Global counts of one step's pairs (all micro-batches, all ranks) and KTO's reference point.

    Attributes:
        num_pairs: pairs in the step (table rows).
        num_chosen_tokens: chosen-response tokens in the step (the NLL denominator of sft and orpo).
        num_examples: KTO's examples in the step (the loss denominator): two per pair, one per unpaired row;
            0 means 2 * num_pairs.
        world_size: data-parallel ranks (DDP averages gradients; shares are scaled by it).
        kl_estimate: KTO's z_ref in nats (``algos.kto_kl_estimate`` over the step), 0 otherwise.
    """

    num_pairs: float
    num_chosen_tokens: float
    world_size: int = 1
    kl_estimate: float = 0.0
    num_examples: float = 0.0


Objective = Callable[[Tensor, PairBatch, PreferenceSpec, PairNormaliser], tuple[Tensor, dict[str, Tensor]]]


def pair_outputs(model: torch.nn.Module, mb: PairBatch, *, scores: bool) -> Tensor:
    """Returns the model outputs an objective needs: scores [2P] (``scores``: a reward head, ``Algorithm.reward_head``)
    or token logprobs [2P, T].

    Logprobs are taken at temperature 1 (no sampling is involved offline).
    """
    if scores:
        return sequence_scores(model, mb.inputs)
    return response_logprobs(model, mb.inputs, temperature=1.0)[0]


def _halves(x: Tensor) -> tuple[Tensor, Tensor]:
    p = x.shape[0] // 2
    return x[:p], x[p:]


def _mean_over_step(losses: Tensor, count: float, norm: PairNormaliser) -> Tensor:
    return losses.sum() / max(count, 1.0) * norm.world_size


def _stats(chosen_rewards: Tensor, rejected_rewards: Tensor) -> dict[str, Tensor]:
    c, r = chosen_rewards.detach().float(), rejected_rewards.detach().float()
    return {
        "pairs": torch.tensor(float(c.numel())),
        "correct": (c > r).float().sum(),
        "chosen_count": torch.tensor(float(c.numel())),
        "chosen_reward_sum": c.sum(),
        "rejected_count": torch.tensor(float(r.numel())),
        "rejected_reward_sum": r.sum(),
    }


def _logps(logprobs: Tensor, mb: PairBatch, *, average: bool = False) -> tuple[Tensor, Tensor]:
    return _halves(algos.sequence_logps(logprobs, mb.response_mask, average=average))


def _chosen_nll_sum(logprobs: Tensor, mb: PairBatch) -> Tensor:
    chosen_lp, _ = _halves(logprobs)
    chosen_mask, _ = _halves(mb.response_mask)
    return -torch.where(chosen_mask, chosen_lp, torch.zeros_like(chosen_lp)).sum()


def dpo(logprobs: Tensor, mb: PairBatch, spec: PreferenceSpec, norm: PairNormaliser):
    """Returns (loss share, stats) of the DPO family, ``algos.PAIRWISE_LOSSES[spec.dpo_loss]`` (TRL DPOTrainer)."""
    c, r = _logps(logprobs, mb)
    ref_c, ref_r = mb.ref_chosen_logps, mb.ref_rejected_logps
    extra = {"label_smoothing": spec.label_smoothing} if spec.dpo_loss == "robust" else {}
    losses = algos.PAIRWISE_LOSSES[spec.dpo_loss](c, r, ref_c, ref_r, beta=spec.beta, **extra)
    return _mean_over_step(losses, norm.num_pairs, norm), _stats(spec.beta * (c - ref_c), spec.beta * (r - ref_r))


def ipo(logprobs: Tensor, mb: PairBatch, spec: PreferenceSpec, norm: PairNormaliser):
    """Returns (loss share, stats) of IPO with length-normalised log ratios (TRL 1.16's form, ``algos.ipo_loss``)."""
    c, r = _logps(logprobs, mb)
    ref_c, ref_r = mb.ref_chosen_logps, mb.ref_rejected_logps
    len_c, len_r = _halves(mb.response_mask.sum(-1))
    losses = algos.PAIRWISE_LOSSES["ipo"](
        c, r, ref_c, ref_r, beta=spec.beta, chosen_num_tokens=len_c, rejected_num_tokens=len_r
    )
    return _mean_over_step(losses, norm.num_pairs, norm), _stats(spec.beta * (c - ref_c), spec.beta * (r - ref_r))


def kto(logprobs: Tensor, mb: PairBatch, spec: PreferenceSpec, norm: PairNormaliser):
    """Returns (loss share, stats) of KTO over the micro-batch's examples, mean over the step's examples.

    A pair gives two examples (its chosen row desirable, its rejected row undesirable); an unpaired row one,
    its chosen row labelled by ``mb.labels`` (its empty rejected row counts nowhere). The stats' pairwise
    accuracy covers the pairs only; the chosen and rejected rewards are means over the desirable and the
    undesirable examples (TRL KTOTrainer's rewards/chosen and rewards/rejected).
    """
    logps = algos.sequence_logps(logprobs, mb.response_mask)
    ref = torch.cat([mb.ref_chosen_logps, mb.ref_rejected_logps])
    desirable = torch.cat([mb.labels, torch.zeros_like(mb.labels)])
    example = torch.cat([torch.ones_like(mb.paired_mask), mb.paired_mask])
    losses = algos.kto_loss(
        logps,
        ref,
        desirable,
        norm.kl_estimate,
        beta=spec.beta,
        desirable_weight=spec.kto_desirable_weight,
        undesirable_weight=spec.kto_undesirable_weight,
    )
    count = norm.num_examples or 2 * norm.num_pairs
    loss = _mean_over_step(torch.where(example, losses, torch.zeros_like(losses)), count, norm)
    rewards = (spec.beta * (logps - ref)).detach().float()
    c, r = _halves(rewards)
    stats = _stats(c[mb.paired_mask], r[mb.paired_mask])
    good, bad = desirable & example, ~desirable & example
    stats.update(chosen_count=good.float().sum(), chosen_reward_sum=rewards[good].sum(),
                 rejected_count=bad.float().sum(), rejected_reward_sum=rewards[bad].sum())  # fmt: skip
    return loss, stats


def orpo(logprobs: Tensor, mb: PairBatch, spec: PreferenceSpec, norm: PairNormaliser):
    """Returns (loss share, stats) of ORPO: chosen token-mean NLL + mean odds-ratio loss (Hong et al. 2024 eq. 6)."""
    avg_c, avg_r = _logps(logprobs, mb, average=True)
    nll = _chosen_nll_sum(logprobs, mb) / max(norm.num_chosen_tokens, 1.0) * norm.world_size
    odds = _mean_over_step(algos.orpo_odds_ratio_loss(avg_c, avg_r, beta=spec.beta), norm.num_pairs, norm)
    return nll + odds, _stats(spec.beta * avg_c, spec.beta * avg_r)


def simpo(logprobs: Tensor, mb: PairBatch, spec: PreferenceSpec, norm: PairNormaliser):
    """Returns (loss share, stats) of SimPO, reference-free on length-averaged logprobs (``algos.simpo_loss``)."""
    avg_c, avg_r = _logps(logprobs, mb, average=True)
    losses = algos.simpo_loss(avg_c, avg_r, beta=spec.beta, gamma=spec.simpo_gamma)
    return _mean_over_step(losses, norm.num_pairs, norm), _stats(spec.beta * avg_c, spec.beta * avg_r)


def sft(logprobs: Tensor, mb: PairBatch, spec: PreferenceSpec, norm: PairNormaliser):
    """Returns (loss share, stats) of SFT: token-mean NLL of the chosen responses (the rejected ones only feed the accuracy)."""
    nll = _chosen_nll_sum(logprobs, mb) / max(norm.num_chosen_tokens, 1.0) * norm.world_size
    return nll, _stats(*_logps(logprobs.detach(), mb, average=True))


def reward_model(scores: Tensor, mb: PairBatch, spec: PreferenceSpec, norm: PairNormaliser):
    """Returns (loss share, stats) of the Bradley-Terry loss with centering (``algos.bradley_terry_loss``, TRL)."""
    c, r = _halves(scores)
    losses = algos.bradley_terry_loss(c, r, center_coef=spec.rm_center_coef)
    return _mean_over_step(losses, norm.num_pairs, norm), _stats(c, r)


PAIR_OBJECTIVES: dict[str, Objective] = {
    "dpo": dpo,
    "ipo": ipo,
    "kto": kto,
    "orpo": orpo,
    "simpo": simpo,
    "sft": sft,
    "reward_model": reward_model,
}
