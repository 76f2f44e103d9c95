"""Policy losses (PPO clip, GSPO, CISPO), rollout correction and entropy: hand-computed values, gradients, invariances."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rlray.algos import (
    LOG_RATIO_BOUND,
    POLICY_LOSSES,
    aggregate_loss,
    cispo_loss,
    entropy_bonus_loss,
    entropy_from_logits,
    gspo_loss,
    kl_penalty,
    ppo_clip_loss,
    rollout_correction_weights,
)
from rlray.algos import kl as kl_module
from rlray.algos import policy_losses as policy_losses_module

ATOL = 1e-6


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=ATOL, rtol=0.0)


def _inputs(ratios: list[float], logprobs: list[float] | None = None):
    """Returns (logprobs leaf, old_logprobs) with exp(logprobs - old) == ratios, as [1, T] float32."""
    lp = torch.tensor([logprobs or [-1.0] * len(ratios)])
    old = lp - torch.log(torch.tensor([ratios]))
    return lp.clone().requires_grad_(True), old


# ratios and advantages for the PPO case; the last position is padding with garbage everywhere
PPO_RATIOS = [1.5, 0.5, 1.1, 0.7, 4.0, 1.0, 1.0]
PPO_ADV = torch.tensor([[1.0, -1.0, 2.0, -2.0, -1.0, 1.0, float("nan")]])
PPO_MASK = torch.tensor([[True] * 6 + [False]])


def test_ppo_clip_hand_computed():
    # eps_low 0.2, eps_high 0.28; loss = max(-A r, -A clip(r, 0.8, 1.28)):
    # r=1.5 A=1: max(-1.5, -1.28) = -1.28 (high clip)   r=0.5 A=-1: max(0.5, 0.8) = 0.8 (low clip)
    # r=1.1 A=2: -2.2                                    r=0.7 A=-2: max(1.4, 1.6) = 1.6 (low clip)
    # r=4 A=-1: max(4, 1.28) = 4                          r=1 A=1: -1;  padding: 0
    lp, old = _inputs(PPO_RATIOS)
    loss, diag = ppo_clip_loss(lp, old, PPO_ADV, PPO_MASK, clip_eps_low=0.2, clip_eps_high=0.28)
    close(loss.detach(), [[-1.28, 0.8, -2.2, 1.6, 4.0, -1.0, 0.0]])
    close(diag["clipped_high"], [[1, 0, 0, 0, 0, 0, 0]])
    close(diag["clipped_low"], [[0, 1, 0, 1, 0, 0, 0]])
    close(diag["ratio"], [PPO_RATIOS[:6] + [0.0]])
    loss.sum().backward()
    # d/dlogprob of -A r is -A r where unclipped: [0, 0, -2.2, 0, 4, -1, 0]
    close(lp.grad, [[0.0, 0.0, -2.2, 0.0, 4.0, -1.0, 0.0]])


def test_ppo_dual_clip_hand_computed():
    # dual_clip c = 3 bounds A<0 tokens by -c A: r=4 A=-1: min(4, 3) = 3, gradient 0; the rest as above
    lp, old = _inputs(PPO_RATIOS)
    loss, diag = ppo_clip_loss(lp, old, PPO_ADV, PPO_MASK, clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0)
    close(loss.detach(), [[-1.28, 0.8, -2.2, 1.6, 3.0, -1.0, 0.0]])
    close(diag["dual_clipped"], [[0, 0, 0, 0, 1, 0, 0]])
    loss.sum().backward()
    close(lp.grad, [[0.0, 0.0, -2.2, 0.0, 0.0, -1.0, 0.0]])


def test_gspo_hand_computed():
    # seq 0: log ratios [0.2, 0.0] -> s = exp(0.1) = 1.1051709; A = 1, eps 0.05: max(-1.105, -1.05) = -1.05 (clipped)
    # seq 1: log ratios [0.02, -0.04] -> s = exp(-0.01) = 0.9900498; A = -2: 2 * 0.9900498 = 1.9800997 (inside)
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    old = lp.detach() - torch.tensor([[0.2, 0.0], [0.02, -0.04]])
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, diag = gspo_loss(lp, old, adv, mask, clip_eps_low=0.05, clip_eps_high=0.05)
    s1 = math.exp(-0.01)
    close(loss.detach(), [[-1.05, -1.05], [2 * s1, 2 * s1]])
    close(diag["clipped_high"], [[1, 1], [0, 0]])
    close(diag["ratio"], [[math.exp(0.1)] * 2, [s1, s1]])
    aggregate_loss(loss, mask, "seq-mean-token-mean").backward()
    # mean over 2 sequences of each sequence loss; seq 1: d/dlogprob_t = (1/2) * (1/2) * (-A) * s = 0.5 * s1
    close(lp.grad, [[0.0, 0.0], [0.5 * s1, 0.5 * s1]])


def test_gspo_equals_sequence_ratio_formula(gen):
    # GSPO (sequence-level s_i with gradient through all tokens) == GSPO-token with seq-mean-token-mean
    mask = torch.rand(5, 6, generator=gen) > 0.3
    mask[:, 0] = True
    lp = (-torch.rand(5, 6, generator=gen)).requires_grad_(True)
    old = lp.detach() + 0.1 * torch.randn(5, 6, generator=gen)
    adv = torch.randn(5, 1, generator=gen).expand(5, 6)
    loss, _ = gspo_loss(lp, old, adv, mask, clip_eps_low=0.03, clip_eps_high=0.04)
    ours = aggregate_loss(loss, mask, "seq-mean-token-mean")
    (g_ours,) = torch.autograd.grad(ours, lp)
    s = torch.exp(((lp - old) * mask).sum(-1) / mask.sum(-1))
    a = adv[:, 0]
    ref = torch.maximum(-a * s, -a * s.clamp(0.97, 1.04)).mean()
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(g_ours, g_ref, atol=ATOL, rtol=0)


def test_cispo_hand_computed():
    # weights sg(clip(r, 1 - 1.0, 1 + 0.2)) = [1.2, 0.5, 1.0]; loss = -w A logprob:
    # -1.2*1*(-1) = 1.2; -0.5*(-1)*(-2) = -1.0; -1*2*(-0.5) = 1.0; gradient -w A = [-1.2, 0.5, -2]
    lp, old = _inputs([1.5, 0.5, 1.0], logprobs=[-1.0, -2.0, -0.5])
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, diag = cispo_loss(lp, old, adv, mask, clip_eps_low=1.0, clip_eps_high=0.2)
    close(loss.detach(), [[1.2, -1.0, 1.0]])
    close(diag["clipped_high"], [[1, 0, 0]])
    loss.sum().backward()
    close(lp.grad, [[-1.2, 0.5, -2.0]])


def test_cispo_lower_clip_bounds_weight():
    # clip_eps_low 0.2: r = 0.5 -> weight 0.8; loss = -0.8 * (-1) * (-2) = -1.6
    lp, old = _inputs([0.5], logprobs=[-2.0])
    loss, diag = cispo_loss(
        lp, old, torch.tensor([[-1.0]]), torch.ones(1, 1, dtype=torch.bool), clip_eps_low=0.2, clip_eps_high=0.2
    )
    close(loss.detach(), [[-1.6]])
    close(diag["clipped_low"], [[1.0]])


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_masked_values_do_not_matter(name, gen):
    mask = torch.rand(4, 5, generator=gen) > 0.4
    lp = -torch.rand(4, 5, generator=gen)
    old = lp + 0.2 * torch.randn(4, 5, generator=gen)
    adv = torch.randn(4, 5, generator=gen)
    bad = torch.full_like(lp, float("nan"))
    results = []
    for garbage in (False, True):
        x = torch.where(mask | (not garbage), lp, -torch.full_like(lp, float("inf"))).requires_grad_(True)
        o = torch.where(mask | (not garbage), old, bad)
        a = torch.where(mask | (not garbage), adv, bad)
        loss, diag = POLICY_LOSSES[name](x, o, a, mask, clip_eps_low=0.2, clip_eps_high=0.28)
        aggregate_loss(loss, mask, "token-mean").backward()
        results.append((loss.detach(), x.grad, diag))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    for key in results[0][2]:
        torch.testing.assert_close(results[0][2][key], results[1][2][key])
    assert (results[1][0][~mask] == 0).all()


def test_on_policy_ppo_gradient_is_policy_gradient(gen):
    # at ratio 1 (first PPO epoch) every PPO-family loss has gradient -A on each token
    lp = (-torch.rand(3, 4, generator=gen)).requires_grad_(True)
    adv = torch.randn(3, 4, generator=gen)
    mask = torch.ones(3, 4, dtype=torch.bool)
    for name in ("ppo_clip", "cispo"):
        (g,) = torch.autograd.grad(
            POLICY_LOSSES[name](lp, lp.detach(), adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)[0].sum(), lp
        )
        torch.testing.assert_close(g, -adv, atol=ATOL, rtol=0)


LN = math.log


def _mismatch_rows():
    # row 0: old - rollout = [ln 3, ln 0.5, ln 0.25] (+ a masked garbage 5.0); sequence ratio 3 * 0.5 * 0.25 = 0.375
    # row 1: [ln 2, ln 2, 0]; sequence ratio 4
    old = torch.tensor([[LN(3.0), LN(0.5), LN(0.25), 5.0], [LN(2.0), LN(2.0), 0.0, -7.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, False]])
    return old, torch.zeros(2, 4), mask


@pytest.mark.parametrize(
    "mode, ratio_min, ratio_max, weights, corrected",
    [
        # token ratios [3, .5, .25] and [2, 2, 1] against [0.4, 2]: 3 -> 2, .25 -> 0.4; 2 sits on the bound (kept)
        ("token_truncate", 0.4, 2.0, [[2.0, 0.5, 0.4, 0], [2.0, 2.0, 1.0, 0]], [[1, 0, 1, 0], [0, 0, 0, 0]]),
        ("token_mask", 0.4, 2.0, [[0.0, 0.5, 0.0, 0], [2.0, 2.0, 1.0, 0]], [[1, 0, 1, 0], [0, 0, 0, 0]]),
        # sequence ratios 0.375 (< 0.4: raised to 0.4, or the row masked) and 4 (> 2: cut to 2, or masked)
        ("sequence_truncate", 0.4, 2.0, [[0.4] * 3 + [0], [2.0] * 3 + [0]], [[1, 1, 1, 0], [1, 1, 1, 0]]),
        ("sequence_mask", 0.4, 2.0, [[0.0] * 4, [0.0] * 4], [[1, 1, 1, 0], [1, 1, 1, 0]]),
        # one-sided bounds (None = unbounded): 0.375 stays, 4 is cut or masked; TRL's mask-only-below-C_min case
        ("sequence_truncate", None, 2.0, [[0.375] * 3 + [0], [2.0] * 3 + [0]], [[0, 0, 0, 0], [1, 1, 1, 0]]),
        ("sequence_mask", 0.4, None, [[0.0] * 4, [4.0] * 3 + [0]], [[1, 1, 1, 0], [0, 0, 0, 0]]),
        ("token_mask", None, 2.5, [[0.0, 0.5, 0.25, 0], [2.0, 2.0, 1.0, 0]], [[1, 0, 0, 0], [0, 0, 0, 0]]),
    ],
)
def test_rollout_correction_hand_computed(mode, ratio_min, ratio_max, weights, corrected):
    old, rollout, mask = _mismatch_rows()
    w, c = rollout_correction_weights(old, rollout, mask, mode=mode, ratio_min=ratio_min, ratio_max=ratio_max)
    close(w, weights)
    assert c.tolist() == torch.tensor(corrected, dtype=torch.bool).tolist()


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_rollout_correction_is_one_without_mismatch_and_ignores_masked_values(mode, gen):
    # rollout == old (synchronous, identical numerics): every weight is 1 and nothing is corrected, whatever the bounds
    old = -torch.rand(3, 5, generator=gen)
    mask = torch.rand(3, 5, generator=gen) > 0.3
    w, c = rollout_correction_weights(old, old.clone(), mask, mode=mode, ratio_min=0.9, ratio_max=1.1)
    close(w, mask.float())
    assert not c.any()
    # garbage (nan, inf) at masked positions never reaches the weights
    garbage = torch.where(mask, old, torch.full_like(old, float("nan")))
    w2, _ = rollout_correction_weights(garbage, torch.where(mask, old, float("inf")), mask, mode=mode, ratio_max=1.1)
    close(w2, mask.float())


def test_rollout_correction_corrects_against_the_stale_sampler():
    # async staleness: the engine sampled with a policy 2 versions older whose logprobs are 0.5 nats lower on
    # token 0 and 0.1 nats higher on token 1; pi_old is the learner's policy now. The weight is pi_old / pi_rollout
    # of the sampler that really drew the tokens: [e^0.5, e^-0.1] = [1.648721, 0.904837], below C_max = 2.
    old = torch.tensor([[-1.0, -2.0]])
    stale_rollout = torch.tensor([[-1.5, -1.9]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    w, _ = rollout_correction_weights(old, stale_rollout, mask, mode="token_truncate", ratio_max=2.0)
    close(w, [[math.exp(0.5), math.exp(-0.1)]])
    w, c = rollout_correction_weights(old, stale_rollout, mask, mode="sequence_mask", ratio_min=0.5, ratio_max=1.2)
    close(w, [[0.0, 0.0]])  # sequence ratio e^0.4 = 1.4918 > 1.2: the stale response is dropped
    assert c.all()


def test_rollout_correction_composes_with_ppo_clip_by_product():
    # tokens: ratio pi_theta/pi_old = [1.5, 1.0] (A = 1, eps 0.2: token 0 clipped at 1.2, no gradient), IS weight
    # pi_old/pi_rollout = [0.5, 2.0]. Loss = mean(w * -A min(r, clip(r))) = (-0.5 * 1.2 - 2.0 * 1.0) / 2 = -1.3;
    # d/dlogprobs = [0 (clipped, whatever w), -w_1 * r_1 / 2 = -1.0]
    lp = torch.tensor([[LN(1.5), 0.0]], requires_grad=True)
    old, rollout = torch.zeros(1, 2), torch.tensor([[LN(2.0), -LN(2.0)]])
    mask, adv = torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 2)
    loss, _ = ppo_clip_loss(lp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    w, _ = rollout_correction_weights(old, rollout, mask, mode="token_truncate", ratio_max=3.0)
    total = aggregate_loss(loss * w, mask, "token-mean")
    total.backward()
    close(total.detach(), -1.3)
    close(lp.grad, [[0.0, -1.0]])


def test_rollout_correction_with_gspo_multiplies_the_sequence_ratio():
    # GSPO's own ratio is length-normalised: s = exp(mean(lp - old)) = exp((0.2 + 0.0) / 2) = e^0.1, inside
    # [1 - 0.3, 1 + 0.3]; the sequence-mode weight is the unnormalised product pi_old / pi_rollout = e^(0.3 + 0.3)
    # = e^0.6 (TRL's), applied to every token. Loss (A = 1, seq-mean-token-mean) = -e^0.6 * e^0.1 = -2.013753;
    # each token's gradient = -e^0.6 * e^0.1 / 2 = -1.006876
    lp = torch.tensor([[0.2, 0.0]], requires_grad=True)
    old, rollout = torch.zeros(1, 2), torch.full((1, 2), -0.3)
    mask, adv = torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 2)
    loss, _ = gspo_loss(lp, old, adv, mask, clip_eps_low=0.3, clip_eps_high=0.3)
    w, _ = rollout_correction_weights(old, rollout, mask, mode="sequence_truncate", ratio_max=3.0)
    total = aggregate_loss(loss * w, mask, "seq-mean-token-mean")
    total.backward()
    close(total.detach(), -math.exp(0.7))
    close(lp.grad, [[-math.exp(0.7) / 2] * 2])


def test_entropy_hand_computed():
    # uniform over 2 -> ln 2; p = [0.25, 0.75] -> -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    h = entropy_from_logits(logits)
    close(h, [[math.log(2.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])
    close(entropy_bonus_loss(h, torch.tensor([[True, False]]), coef=0.01), [[-0.01 * math.log(2.0), 0.0]])


def test_entropy_matches_torch_distributions(gen):
    logits = torch.randn(2, 3, 11, generator=gen) * 3
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), expected, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------
# Properties (hypothesis): huge log-ratios give a finite loss and gradient; inside the bound nothing changes
# --------------------------------------------------------------------------------------------
# every policy loss with each of its options: PPO's clip, clip-higher and dual clip, GSPO's tiny ranges, CISPO
# with and without a lower clip and with a cap so large that only the log-ratio bound keeps the weight finite
LOSS_OPTIONS = {
    "ppo_clip": (ppo_clip_loss, {"clip_eps_low": 0.2, "clip_eps_high": 0.2}),
    "ppo_clip_higher": (ppo_clip_loss, {"clip_eps_low": 0.2, "clip_eps_high": 0.28}),
    "ppo_dual_clip": (ppo_clip_loss, {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip": 3.0}),
    "gspo": (gspo_loss, {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4}),
    "cispo": (cispo_loss, {"clip_eps_low": 1.0, "clip_eps_high": 4.0}),
    "cispo_lower_clip": (cispo_loss, {"clip_eps_low": 0.2, "clip_eps_high": 0.28}),
    "cispo_no_cap": (cispo_loss, {"clip_eps_low": 1.0, "clip_eps_high": 1e30}),
}
FP32_MAX = float(torch.finfo(torch.float32).max)
# log-ratios (nats) near the bound, past exp's fp32 overflow (88.7), and anywhere up to the fp32 limits
HUGE_LOG_RATIOS = st.one_of(
    st.sampled_from([0.0, 19.9, 20.0, 20.5, -20.5, 88.0, 88.8, 89.0, -104.0, 1e4, -1e4, 1e30, FP32_MAX, -FP32_MAX]),
    st.floats(-FP32_MAX, FP32_MAX, width=32),
)


# rollout corrections (mode, C_min, C_max): both bounds, and one-sided ones that leave huge ratios unbounded
CORRECTIONS = [
    None, ("token_truncate", None, 3.0), ("token_mask", 0.5, 3.0), ("sequence_truncate", 0.5, 3.0),
    ("sequence_mask", 0.5, None), ("sequence_truncate", 0.5, None),
]  # fmt: skip


def _objective(name, lp, log_ratios, rollout_log_ratios, ref_log_ratios, advantage, correction, kl, dtype):
    """Returns (token-mean objective, logprobs leaf): a policy loss with optional rollout correction and KL in the loss.

    Each list has one entry per valid token, plus a masked token of garbage; old = lp - log_ratio, rollout =
    old - rollout_log_ratio, ref = lp - ref_log_ratio, all built in float64 and cast to dtype.
    """
    fn, kwargs = LOSS_OPTIONS[name]

    def row(values, pad):
        return torch.tensor([[*values, pad]], dtype=torch.float64)

    lp64 = row(lp, -1.0)
    old = (lp64 - row(log_ratios, float("nan"))).to(dtype)
    rollout = (old.double() - row(rollout_log_ratios, float("nan"))).to(dtype)
    ref = (lp64 - row(ref_log_ratios, float("nan"))).to(dtype)
    assume(torch.isfinite(old[:, :-1]).all() and torch.isfinite(rollout[:, :-1]).all() and torch.isfinite(ref[:, :-1]).all())
    x = lp64.to(dtype).requires_grad_(True)
    mask = torch.tensor([[True] * len(lp) + [False]])
    adv = torch.full_like(x, advantage).detach()
    loss, _ = fn(x, old, adv, mask, **kwargs)
    if correction is not None:
        mode, lo, hi = correction
        loss = loss * rollout_correction_weights(old, rollout, mask, mode=mode, ratio_min=lo, ratio_max=hi)[0]
    if kl is not None:
        loss = loss + 0.04 * kl_penalty(x, ref, kl)
    return aggregate_loss(loss, mask, "token-mean"), x


@pytest.mark.parametrize("name", sorted(LOSS_OPTIONS))
@settings(derandomize=True, max_examples=120, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    advantage=st.floats(-10.0, 10.0),
    correction=st.sampled_from(CORRECTIONS),
    kl=st.sampled_from([None, "k1", "k2", "k3"]),
)
def test_huge_log_ratios_give_finite_loss_and_gradient(name, data, dtype, advantage, correction, kl):
    n = data.draw(st.integers(1, 5), label="tokens")  # short responses: GSPO's mean barely dilutes a huge token
    tokens = st.lists(HUGE_LOG_RATIOS, min_size=n, max_size=n)
    lp = data.draw(st.lists(st.floats(-30.0, 0.0, width=32), min_size=n, max_size=n), label="logprobs")
    log_ratios, rollout, ref = data.draw(tokens), data.draw(tokens), data.draw(tokens)
    total, x = _objective(name, lp, log_ratios, rollout, ref, advantage, correction, kl, dtype)
    total.backward()
    assert torch.isfinite(total), (name, total)
    assert torch.isfinite(x.grad).all(), (name, x.grad)


@pytest.mark.parametrize("name", sorted(LOSS_OPTIONS))
@settings(derandomize=True, max_examples=60, deadline=None)
@given(
    data=st.data(),
    advantage=st.floats(-10.0, 10.0),
    correction=st.sampled_from(CORRECTIONS),
    kl=st.sampled_from([None, "k1", "k2", "k3"]),
)
def test_inside_the_bound_the_loss_and_gradient_are_unchanged(name, data, advantage, correction, kl):
    # the same objective with the bound lifted (patched to inf) is equal bit for bit when every log-ratio is inside
    # (in the sequence modes the row's summed rollout log-ratio is one too, so its tokens share the bound)
    n = data.draw(st.integers(1, 5), label="tokens")
    tokens = st.lists(st.floats(-LOG_RATIO_BOUND, LOG_RATIO_BOUND), min_size=n, max_size=n)
    rollout_bound = LOG_RATIO_BOUND / n if correction and correction[0].startswith("sequence") else LOG_RATIO_BOUND
    lp = data.draw(st.lists(st.floats(-30.0, 0.0), min_size=n, max_size=n), label="logprobs")
    log_ratios, ref = data.draw(tokens), data.draw(tokens)
    rollout = data.draw(st.lists(st.floats(-rollout_bound, rollout_bound), min_size=n, max_size=n))
    results = []
    for bound in (LOG_RATIO_BOUND, float("inf")):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(policy_losses_module, "LOG_RATIO_BOUND", bound)
            patch.setattr(kl_module, "LOG_RATIO_BOUND", bound)
            total, x = _objective(name, lp, log_ratios, rollout, ref, advantage, correction, kl, torch.float64)
            total.backward()
            results.append((total.detach(), x.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_the_bound_is_verls_20_nats():
    # verl core_algos.py compute_policy_loss: negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    assert LOG_RATIO_BOUND == 20.0
    lp = torch.zeros(1, 1, requires_grad=True)
    loss, diag = ppo_clip_loss(lp, torch.full((1, 1), -1000.0), -torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool),
                               clip_eps_low=0.2, clip_eps_high=0.2)  # fmt: skip
    close(diag["ratio"], [[math.exp(20.0)]])
    loss.sum().backward()
    assert lp.grad.item() == 0.0  # past the bound the clamped log-ratio passes no gradient


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"clip_eps_low": 1.5, "clip_eps_high": 0.2}, "clip_eps_low"),
        ({"clip_eps_low": 0.2, "clip_eps_high": -0.1}, "clip_eps_high"),
        ({"clip_eps_low": 0.2, "clip_eps_high": 0.2, "dual_clip": 0.5}, "dual_clip"),
    ],
)
def test_ppo_errors(kwargs, match):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=match):
        ppo_clip_loss(x, x, x, torch.ones(1, 2, dtype=torch.bool), **kwargs)


def test_shape_and_mask_errors():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="one shape"):
        gspo_loss(x, torch.zeros(1, 3), x, torch.ones(1, 2, dtype=torch.bool), clip_eps_low=0.1, clip_eps_high=0.1)
    with pytest.raises(ValueError, match="bool"):
        cispo_loss(x, x, x, torch.ones(1, 2), clip_eps_low=0.1, clip_eps_high=0.1)
    m = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="unknown mode 'sequence'"):
        rollout_correction_weights(x, x, m, mode="sequence", ratio_max=2.0)
    with pytest.raises(ValueError, match="ratio_max=0.0 must be > 0"):
        rollout_correction_weights(x, x, m, mode="token_truncate", ratio_max=0.0)
    with pytest.raises(ValueError, match="ratio_min=2.0 must be below ratio_max=2.0"):
        rollout_correction_weights(x, x, m, mode="token_mask", ratio_min=2.0, ratio_max=2.0)
    with pytest.raises(ValueError, match="'sequence_truncate' needs ratio_min or ratio_max"):
        rollout_correction_weights(x, x, m, mode="sequence_truncate")
    with pytest.raises(ValueError, match="must match"):
        rollout_correction_weights(x, torch.zeros(1, 3), m, mode="token_mask", ratio_max=2.0)
