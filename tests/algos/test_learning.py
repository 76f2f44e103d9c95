"""Learning tests: every online algorithm raises reward on a toy task; DPO learns its training pairs; distillation.

The task: a prompt p (one of 8) asks for its target token 1 + p % 7. A response is up to T_MAX = 6 tokens over a
vocabulary of V = 8 with EOS = 0 (the EOS token counts as generated; later positions are padding, also token 0,
so masks come from positions, never from token values). Reward = (target tokens in the response) / T_MAX, so
a random policy scores about 0.1 and the best policy 1.0.

The policy is a tiny in-process "LM": embeddings of (prompt, previous token, position) summed, then an MLP to V
logits. No Ray, no vLLM. Each step samples 8 prompts x 4 responses, computes rewards, old/ref logprobs and the
algorithm's advantages, then runs 2 epochs x 2 mini-batches x 2 micro-batches with gradient accumulation and
global normalisers, as the learner does. Reward is measured before and after on 512 fresh samples.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rlray.algos import (
    aggregate_loss,
    cispo_loss,
    dpo_sigmoid_loss,
    dr_grpo_advantages,
    dynamic_sampling_shortfall,
    gae_advantages,
    generalized_jsd,
    groups_with_spread,
    grpo_advantages,
    gspo_loss,
    kl_penalty,
    overlong_penalty,
    ppo_clip_loss,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    reverse_kl_advantages,
    rloo_advantages,
    sequence_logps,
    token_level_rewards,
    value_loss,
    whiten,
)

V, T_MAX, NUM_PROMPTS, EOS, BOS = 8, 6, 8, 0, 8
TARGETS = 1 + torch.arange(NUM_PROMPTS) % (V - 1)
PROMPTS_PER_STEP, SAMPLES_PER_PROMPT = 8, 4


class TinyLM(nn.Module):
    """Embedding "LM": logits[b, t] = MLP(E_prompt[p_b] + E_prev[token_{t-1}] + E_pos[t]); or values with out=1."""

    def __init__(self, out: int = V, hidden: int = 32):
        super().__init__()
        self.prompt = nn.Embedding(NUM_PROMPTS, hidden)
        self.prev = nn.Embedding(V + 1, hidden)
        self.pos = nn.Embedding(T_MAX, hidden)
        self.mlp = nn.Sequential(nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, out))

    def forward(self, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        prev = torch.cat([torch.full_like(tokens[:, :1], BOS), tokens[:, :-1]], dim=1)
        h = self.prompt(prompts)[:, None] + self.prev(prev) + self.pos.weight[: tokens.shape[1]]
        return self.mlp(h).squeeze(-1)


def token_logprobs(policy: TinyLM, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T] log-probabilities of ``tokens`` under ``policy`` (teacher forcing)."""
    return torch.log_softmax(policy(prompts, tokens), -1).gather(-1, tokens[..., None]).squeeze(-1)


@torch.no_grad()
def generate(policy: TinyLM, prompts: torch.Tensor, gen: torch.Generator, greedy: bool = False):
    """Returns (tokens [B, T_MAX] int64, response_mask [B, T_MAX] bool): True up to and including EOS."""
    tokens = torch.full((prompts.numel(), T_MAX), EOS)
    mask = torch.zeros(prompts.numel(), T_MAX, dtype=torch.bool)
    alive = torch.ones(prompts.numel(), dtype=torch.bool)
    for t in range(T_MAX):
        logits = policy(prompts, tokens[:, : t + 1])[:, t]
        nxt = logits.argmax(-1) if greedy else torch.multinomial(logits.softmax(-1), 1, generator=gen).squeeze(1)
        tokens[:, t] = torch.where(alive, nxt, EOS)
        mask[:, t] = alive
        alive = alive & (nxt != EOS)
    return tokens, mask


def task_reward(prompts: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((tokens == TARGETS[prompts][:, None]) & mask).sum(-1).float() / T_MAX


def mean_reward(policy: TinyLM, seed: int = 99) -> float:
    prompts = torch.arange(NUM_PROMPTS).repeat(64)
    tokens, mask = generate(policy, prompts, torch.Generator().manual_seed(seed))
    return float(task_reward(prompts, tokens, mask).mean())


# --------------------------------------------------------------------------------------------
# Experience: rollout, reward, old/ref logprobs, advantages
# --------------------------------------------------------------------------------------------
def rollout(policy, gen, prompts=None, group_offset=0):
    prompts = torch.randperm(NUM_PROMPTS, generator=gen)[:PROMPTS_PER_STEP] if prompts is None else prompts
    prompts = prompts.repeat_interleave(SAMPLES_PER_PROMPT)
    group_ids = group_offset + torch.arange(prompts.numel() // SAMPLES_PER_PROMPT).repeat_interleave(SAMPLES_PER_PROMPT)
    tokens, mask = generate(policy, prompts, gen)
    return {
        "prompts": prompts,
        "group_ids": group_ids,
        "tokens": tokens,
        "mask": mask,
        "rewards": task_reward(prompts, tokens, mask),
    }


def dapo_rollout(policy, gen):
    """Dynamic sampling: refill until PROMPTS_PER_STEP groups have reward spread (max 6 rounds)."""
    parts, kept, rounds = [], 0, 0
    while dynamic_sampling_shortfall(kept, PROMPTS_PER_STEP, rounds_done=rounds, max_rounds=6):
        batch = rollout(policy, gen, group_offset=100 * rounds)
        rounds += 1
        keep = groups_with_spread(batch["rewards"], batch["group_ids"])
        parts.append({k: v[keep] for k, v in batch.items()})
        kept += int(torch.unique(batch["group_ids"][keep]).numel())
    batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    first = torch.unique(batch["group_ids"], sorted=False)[:PROMPTS_PER_STEP]
    keep = torch.isin(batch["group_ids"], first)
    batch = {k: v[keep] for k, v in batch.items()}
    lengths = batch["mask"].sum(-1)  # overlong shaping on the raw reward: L_max 6, cache 2, factor 0.1
    batch["rewards"] = batch["rewards"] + overlong_penalty(
        lengths, max_response_tokens=T_MAX, cache_tokens=2, penalty_factor=0.1
    )
    return batch


@torch.no_grad()
def experience(name: str, policy, ref, critic, gen, sign: float = 1.0):
    batch = dapo_rollout(policy, gen) if name == "dapo" else rollout(policy, gen)
    prompts, tokens, mask, rewards = batch["prompts"], batch["tokens"], batch["mask"], batch["rewards"]
    batch["old_logprobs"] = token_logprobs(policy, prompts, tokens)
    batch["ref_logprobs"] = token_logprobs(ref, prompts, tokens)
    if name in ("grpo", "dapo", "gspo", "cispo"):
        adv = grpo_advantages(rewards, batch["group_ids"])[:, None].expand_as(mask)
    elif name == "dr_grpo":
        adv = dr_grpo_advantages(rewards, batch["group_ids"])[:, None].expand_as(mask)
    elif name == "rloo":
        adv = rloo_advantages(rewards, batch["group_ids"])[:, None].expand_as(mask)
    elif name == "remax":
        unique_prompts = prompts[::SAMPLES_PER_PROMPT]
        greedy_tokens, greedy_mask = generate(policy, unique_prompts, gen, greedy=True)
        baseline = task_reward(unique_prompts, greedy_tokens, greedy_mask).repeat_interleave(SAMPLES_PER_PROMPT)
        adv = remax_advantages(rewards, baseline)[:, None].expand_as(mask)
    elif name == "reinforce_pp_baseline":
        adv = reinforce_pp_baseline_advantages(rewards, batch["group_ids"], mask)
    else:  # reinforce_pp and ppo: k1 KL in the reward
        kl = kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], "k1")
        token_rewards = token_level_rewards(rewards, mask, kl=kl, kl_coef=0.01)
        if name == "reinforce_pp":
            adv = reinforce_pp_advantages(token_rewards, mask)
        else:
            batch["old_values"] = critic(prompts, tokens)
            adv, batch["returns"] = gae_advantages(token_rewards, batch["old_values"], mask, gamma=1.0, lam=0.95)
            adv = whiten(adv, mask)
    batch["advantages"] = (sign * adv).contiguous()
    return batch


# --------------------------------------------------------------------------------------------
# The update
# --------------------------------------------------------------------------------------------
LOSS = {  # policy loss, clip (low, high), aggregation, KL-in-loss (estimator, coef)
    "grpo": (ppo_clip_loss, (0.2, 0.2), "seq-mean-token-mean", ("k3", 0.04)),
    "dr_grpo": (ppo_clip_loss, (0.2, 0.2), "seq-mean-token-sum-norm", None),
    "dapo": (ppo_clip_loss, (0.2, 0.28), "token-mean", None),
    "gspo": (gspo_loss, (0.03, 0.04), "seq-mean-token-mean", None),
    "cispo": (cispo_loss, (1.0, 4.0), "token-mean", None),
    "rloo": (ppo_clip_loss, (0.2, 0.2), "seq-mean-token-mean", None),
    "reinforce_pp": (ppo_clip_loss, (0.2, 0.2), "token-mean", None),
    "reinforce_pp_baseline": (ppo_clip_loss, (0.2, 0.2), "token-mean", ("k2", 0.01)),
    "remax": (ppo_clip_loss, (0.2, 0.2), "seq-mean-token-mean", None),
    "ppo": (ppo_clip_loss, (0.2, 0.2), "token-mean", None),
}


def micro_loss(name, policy, critic, mb, num_tokens, num_sequences):
    loss_fn, (low, high), mode, kl = LOSS[name]
    logprobs = token_logprobs(policy, mb["prompts"], mb["tokens"])
    per_token, _ = loss_fn(
        logprobs, mb["old_logprobs"], mb["advantages"], mb["mask"], clip_eps_low=low, clip_eps_high=high
    )
    if kl is not None:
        per_token = per_token + kl[1] * kl_penalty(logprobs, mb["ref_logprobs"], kl[0])
    loss = aggregate_loss(
        per_token, mb["mask"], mode, num_tokens=num_tokens, num_sequences=num_sequences, max_response_tokens=T_MAX
    )
    if critic is not None:
        v_loss, _ = value_loss(
            critic(mb["prompts"], mb["tokens"]), mb["old_values"], mb["returns"], mb["mask"], clip_eps=0.2
        )
        loss = loss + 0.5 * aggregate_loss(v_loss, mb["mask"], "token-mean", num_tokens=num_tokens)
    return loss


def train_online(name: str, steps: int, lr: float = 0.02, seed: int = 0, sign: float = 1.0) -> tuple[float, float]:
    """Returns (mean reward before, mean reward after) ``steps`` RL steps of algorithm ``name``.

    ``sign=-1`` negates the advantages: the negative control that shows the test can fail.
    """
    torch.manual_seed(seed)
    policy = TinyLM()
    ref = copy.deepcopy(policy).requires_grad_(False)
    critic = TinyLM(out=1) if name == "ppo" else None
    params = list(policy.parameters()) + (list(critic.parameters()) if critic is not None else [])
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    before = mean_reward(policy)
    for _ in range(steps):
        batch = experience(name, policy, ref, critic, gen, sign)
        size = batch["prompts"].numel()
        for _epoch in range(2):
            order = torch.randperm(size, generator=gen)
            for minibatch in order.chunk(2):
                # the driver counts global normalisers over the whole mini-batch, after masking
                num_tokens = float(batch["mask"][minibatch].sum())
                num_sequences = float((batch["mask"][minibatch].sum(-1) > 0).sum())
                opt.zero_grad()
                for micro in minibatch.chunk(2):
                    mb = {k: v[micro] for k, v in batch.items()}
                    micro_loss(name, policy, critic, mb, num_tokens, num_sequences).backward()
                nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
    return before, mean_reward(policy)


# Stated margin: each algorithm must raise mean reward (random policy 0.101, best 1.0) by at least MIN_GAIN
# within STEPS steps, seed 0. Seen with seed 0: gains +0.45 (remax) to +0.71 (cispo); seeds 1-3 give
# +0.21 to +0.74.
STEPS, MIN_GAIN = 10, 0.3


@pytest.mark.parametrize("name", sorted(LOSS))
def test_online_algorithm_raises_reward(name):
    before, after = train_online(name, STEPS)
    assert after - before >= MIN_GAIN, f"{name}: mean reward {before:.3f} -> {after:.3f} in {STEPS} steps"


def test_negated_advantages_lower_reward():
    # the negative control: the same loop with -A must not learn the task
    before, after = train_online("grpo", STEPS, sign=-1.0)
    assert after < before, f"grpo with negated advantages: {before:.3f} -> {after:.3f}"


# --------------------------------------------------------------------------------------------
# DPO: preference accuracy on the training pairs
# --------------------------------------------------------------------------------------------
def preference_pairs(gen: torch.Generator, pairs_per_prompt: int = 4):
    """Chosen responses use the prompt's target token at ~70% of positions, rejected ones never; ragged lengths."""
    prompts = torch.arange(NUM_PROMPTS).repeat_interleave(pairs_per_prompt)
    n = prompts.numel()

    def responses(p_target: float):
        other = 1 + (TARGETS[prompts][:, None] + torch.randint(0, V - 2, (n, T_MAX), generator=gen)) % (V - 1)
        use_target = torch.rand(n, T_MAX, generator=gen) < p_target
        tokens = torch.where(use_target, TARGETS[prompts][:, None], other)
        lengths = torch.randint(2, T_MAX + 1, (n,), generator=gen)
        mask = torch.arange(T_MAX)[None, :] < lengths[:, None]
        return torch.where(mask, tokens, EOS), mask

    return prompts, responses(0.7), responses(0.0)


def dpo_accuracy(policy, ref, prompts, chosen, rejected) -> tuple[float, torch.Tensor]:
    logps = [
        sequence_logps(token_logprobs(m, prompts, tok), mask) for m in (policy, ref) for tok, mask in (chosen, rejected)
    ]
    c, r, ref_c, ref_r = logps
    margin = (c - ref_c) - (r - ref_r)
    return float((margin > 0).float().mean()), dpo_sigmoid_loss(c, r, ref_c.detach(), ref_r.detach(), beta=0.1)


def train_dpo(steps: int, seed: int = 0) -> tuple[float, float]:
    """Returns (training-pair preference accuracy before, after) ``steps`` full-batch DPO steps."""
    torch.manual_seed(seed)
    policy = TinyLM()
    ref = copy.deepcopy(policy).requires_grad_(False)
    prompts, chosen, rejected = preference_pairs(torch.Generator().manual_seed(seed))
    opt = torch.optim.Adam(policy.parameters(), lr=0.01)
    before, _ = dpo_accuracy(policy, ref, prompts, chosen, rejected)
    for _ in range(steps):
        _, losses = dpo_accuracy(policy, ref, prompts, chosen, rejected)
        opt.zero_grad()
        losses.mean().backward()
        opt.step()
    with torch.no_grad():
        after, _ = dpo_accuracy(policy, ref, prompts, chosen, rejected)
    return before, after


DPO_STEPS = 15  # seen: accuracy 0.0 (margins start at exactly 0) -> 1.0 for seeds 0-2


def test_dpo_preference_accuracy_rises_above_0_9():
    before, after = train_dpo(DPO_STEPS)
    assert after > 0.9, f"DPO training-pair accuracy {before:.2f} -> {after:.2f} in {DPO_STEPS} steps"


if __name__ == "__main__":  # the numbers behind the asserts: python tests/algos/test_learning.py [SEED ...]
    import sys

    torch.set_num_threads(1)  # as tests/algos/conftest.py
    print(f"| algorithm | seed | mean reward before | after | gain | steps | asserted |\n|{'---|' * 7}")
    for seed in [int(s) for s in sys.argv[1:]] or [0]:
        for name in sorted(LOSS):
            before, after = train_online(name, STEPS, seed=seed)
            print(f"| {name} | {seed} | {before:.3f} | {after:.3f} | {after - before:+.3f} | {STEPS} | gain >= {MIN_GAIN} |")
        before, after = train_dpo(DPO_STEPS, seed=seed)
        print(f"| dpo (pair accuracy) | {seed} | {before:.3f} | {after:.3f} | {after - before:+.3f} | {DPO_STEPS} | after > 0.9 |")


# --------------------------------------------------------------------------------------------
# On-policy distillation: the task reward is off; the student learns from a teacher's scores of its own samples
# --------------------------------------------------------------------------------------------
class FixedTeacher(nn.Module):
    """A teacher policy: logits `margin` on each prompt's target token, 0 elsewhere (margin 0: uniform)."""

    def __init__(self, margin: float):
        super().__init__()
        self.margin = margin

    def forward(self, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, V)
        logits[torch.arange(prompts.numel()), :, TARGETS[prompts]] = self.margin
        return logits


def train_distill(divergence: str, teacher_margin: float, steps: int, lr: float = 0.02, seed: int = 0):
    """Returns (mean task reward before, after) ``steps`` steps of pure on-policy distillation (no task reward).

    "reverse_kl": advantages = reverse_kl_advantages(old, teacher, mask, weight=1) into PPO-clip, token-mean;
    "jsd": loss = token-mean generalized_jsd(student logits, teacher logits, beta=0.5) on the student's samples.
    """
    torch.manual_seed(seed)
    policy, teacher = TinyLM(), FixedTeacher(teacher_margin)
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    before = mean_reward(policy)
    for _ in range(steps):
        batch = rollout(policy, gen)  # the task reward it computes is never used
        prompts, tokens, mask = batch["prompts"], batch["tokens"], batch["mask"]
        with torch.no_grad():
            old = token_logprobs(policy, prompts, tokens)
            teacher_lp = token_logprobs(teacher, prompts, tokens)
        adv = reverse_kl_advantages(old, teacher_lp, mask, weight=1.0)
        for _epoch in range(2):
            opt.zero_grad()
            if divergence == "reverse_kl":
                per_token, _ = ppo_clip_loss(token_logprobs(policy, prompts, tokens), old, adv, mask,
                                             clip_eps_low=0.2, clip_eps_high=0.2)  # fmt: skip
            else:
                per_token = generalized_jsd(policy(prompts, tokens), teacher(prompts, tokens), beta=0.5)
            aggregate_loss(per_token, mask, "token-mean").backward()
            nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
    return before, mean_reward(policy)


# Stated margin: distilled from a good teacher (target logit +5: p(target) = e^5 / (e^5 + 7) = 0.955), the student
# raises the task reward (random 0.101) by at least DISTILL_GAIN in DISTILL_STEPS steps, seed 0; distilled from a
# uniform teacher (negative control) it gains less than 0.05. Seen with seeds 0-2: good teacher 0.09-0.11 -> 0.95-0.99
# (both divergences), uniform teacher -> 0.091-0.093.
DISTILL_STEPS, DISTILL_GAIN = 15, 0.6


@pytest.mark.parametrize("divergence", ["reverse_kl", "jsd"])
def test_distillation_from_a_good_teacher_raises_reward(divergence):
    before, after = train_distill(divergence, 5.0, DISTILL_STEPS)
    assert after - before >= DISTILL_GAIN, f"{divergence}: {before:.3f} -> {after:.3f} in {DISTILL_STEPS} steps"


@pytest.mark.parametrize("divergence", ["reverse_kl", "jsd"])
def test_distillation_from_a_uniform_teacher_does_not(divergence):
    before, after = train_distill(divergence, 0.0, DISTILL_STEPS)
    assert after - before < 0.05, f"{divergence} with a uniform teacher: {before:.3f} -> {after:.3f}"
