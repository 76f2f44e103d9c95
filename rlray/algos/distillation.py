"""On-policy distillation: a student samples, a teacher scores the student's own tokens.

Legend: B sequences, P prompts, G samples per prompt (B = P*G), T response tokens,
L prompt+response tokens, V vocabulary.

Two divergences, both per token so that ``aggregate_loss`` reduces them and ``response_mask`` keeps
observation tokens (environment output, response_mask False) and padding out:
    reverse KL on the sampled tokens   needs only the teacher's logprob of each sampled token, so the teacher can
                                       run anywhere (its own actor); a dense per-token advantage
    generalized JSD with beta          needs both full [.., V] distributions, so the teacher runs on the learner
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def reverse_kl_advantages(
    student_logprobs: Tensor, teacher_logprobs: Tensor, response_mask: Tensor, *, weight: float
) -> Tensor:
    """Returns [B, T] float32 detached per-token advantages -weight * (log pi_student - log pi_teacher); 0 if masked.

    For a token y_t sampled from the student, log pi_student(y_t) - log pi_teacher(y_t) is the one-sample
    (k1, Schulman 2020) estimate of the per-token reverse KL(pi_student || pi_teacher), in nats. Used as a
    reward on that token alone (no sum over later tokens, discount 0) and fed to a policy-gradient loss, its
    expected gradient is that of -weight * reverse KL: the student lowers the probability of tokens the teacher
    finds unlikely and raises the others. Added to any online algorithm's advantages after its own
    normalisation, so a task reward and distillation combine; with a constant task reward (GRPO advantages 0)
    this is pure on-policy distillation.

    Args:
        student_logprobs: [B, T] float32 log-probabilities of the sampled tokens under the student that sampled them.
        teacher_logprobs: [B, T] float32 log-probabilities of the same tokens under the teacher.
        response_mask: [B, T] bool, True on sampled tokens; observation tokens and padding get 0.
        weight: teacher.weight, >= 0 (advantage units per nat).

    Raises:
        ValueError: shapes differ, the mask is not bool, or weight < 0.

    Source: Thinking Machines Lab, "On-Policy Distillation" (Lu et al. 2025; tinker-cookbook: per-token reverse KL
    as the advantage, discount 0); Agarwal et al. 2024, "On-Policy Distillation of Language Models" (GKD) with
    beta = 1 estimated on the sampled token only. verl and NeMo-RL ship the same per-token signal.
    """
    if not (student_logprobs.shape == teacher_logprobs.shape == response_mask.shape) or response_mask.dtype != torch.bool:
        raise ValueError(
            f"reverse_kl_advantages: student_logprobs {tuple(student_logprobs.shape)}, teacher_logprobs "
            f"{tuple(teacher_logprobs.shape)} and bool response_mask {tuple(response_mask.shape)} must match"
        )
    if weight < 0:
        raise ValueError(f"reverse_kl_advantages: weight={weight} must be >= 0")
    diff = torch.where(response_mask, student_logprobs.float() - teacher_logprobs.float(), 0.0)
    return (-weight * diff).detach()


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, *, beta: float, temperature: float = 1.0) -> Tensor:
    """Returns the [B, T] float32 per-token generalized Jensen-Shannon divergence (nats) over the full vocabulary.

    With p_s = softmax(student_logits / tau), p_t = softmax(teacher_logits / tau) and the mixture
    m = (1 - beta) p_s + beta p_t:
        JSD_beta = beta KL(p_t || m) + (1 - beta) KL(p_s || m)          for 0 < beta < 1
        beta = 0: KL(p_t || p_s) (forward KL);   beta = 1: KL(p_s || p_t) (reverse KL)
    The gradient flows to the student logits only (the teacher is detached). Mask and reduce with
    ``aggregate_loss`` (TRL's DistillationTrainer divides the sum over completion tokens by their count, i.e.
    "token-mean").

    Args:
        student_logits: [B, T, V] float logits of the student at the response positions (with grad; upcast to fp32).
        teacher_logits: [B, T, V] float logits of the teacher at the same positions.
        beta: interpolation in [0, 1] (TRL DistillationConfig.beta).
        temperature: softmax temperature tau > 0 applied to both.

    Raises:
        ValueError: shapes differ (a teacher with another vocabulary), beta outside [0, 1], or temperature <= 0.

    Source: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
    Mistakes" (GKD) eq. 1; TRL 1.16 ``DistillationTrainer`` (trainer/distillation_trainer.py
    ``_chunked_divergence_loss`` over kernels/chunked_divergence.py) and ``GKDTrainer.generalized_jsd_loss``.
    """
    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 3:
        raise ValueError(
            f"generalized_jsd: student_logits {tuple(student_logits.shape)} and teacher_logits "
            f"{tuple(teacher_logits.shape)} must both be [B, T, V] with one vocabulary"
        )
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta={beta} must be in [0, 1] (0 forward KL, 1 reverse KL)")
    if temperature <= 0:
        raise ValueError(f"generalized_jsd: temperature={temperature} must be > 0")
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    if beta == 0.0:
        return _kl(log_t, log_s)
    if beta == 1.0:
        return _kl(log_s, log_t)
    log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
    return beta * _kl(log_t, log_m) + (1.0 - beta) * _kl(log_s, log_m)


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """Returns [B, T] KL(p || q) = sum_v p_v (log p_v - log q_v) from log-probabilities [B, T, V] (0 log 0 = 0)."""
    return torch.where(log_p > -math.inf, log_p.exp() * (log_p - log_q), 0.0).sum(-1)
