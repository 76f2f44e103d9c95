"""Test helpers: step batches of GRPO-like groups (shared prompts, ragged responses, observation tokens masked), and
gradient snapshots, for the packed-vs-padded exactness tests."""

from __future__ import annotations

import torch

from rlray.schema import StepBatch, pack_sequences


def group_batch(prompt_lengths: list[int], response_lengths: list[list[int]], *, seed: int = 0,
                shared_start: int = 0, observations: bool = True) -> StepBatch:
    """Returns a ``StepBatch``: group g has one prompt of ``prompt_lengths[g]`` tokens and a row per entry of
    ``response_lengths[g]``; rows of a group agree on their first ``shared_start`` response tokens (as samples that
    began alike). With ``observations``, every third response token from the fourth on is an observation
    (response_mask False, as an environment's output). Rewards, old/rollout logprobs and advantages are seeded."""
    gen = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(3, 1000, (n,), generator=gen).tolist()

    prompts, responses, group = [], [], []
    for g, (p, lengths) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        prompt, start = toks(p), toks(shared_start)
        for n in lengths:
            prompts.append(prompt)
            responses.append((start + toks(n))[:n])
            group.append(g)
    inputs = pack_sequences(prompts, responses, pad_token_id=0)
    b, t = inputs.response_ids.shape
    real = torch.arange(t)[None, :] < torch.tensor([len(r) for r in responses])[:, None]
    mask = real.clone()
    if observations:
        mask &= ~((torch.arange(t) >= 3) & (torch.arange(t) % 3 == 0))[None, :]
    noise = torch.randn(b, t, generator=gen)
    return StepBatch(inputs=inputs, response_mask=mask, reward=torch.randn(b, generator=gen),
                     group_id=torch.tensor(group), policy_version=torch.zeros(b, dtype=torch.long),
                     rollout_logprobs=torch.where(real, -2.0 + 0.1 * noise, 0.0),
                     old_logprobs=torch.where(real, -2.0 + 0.05 * noise, 0.0),
                     advantages=torch.where(real, torch.randn(b, 1, generator=gen).expand(b, t), 0.0))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Returns a copy of every parameter's gradient by name (parameters without one are left out)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rel: float = 1e-6) -> None:
    """Asserts the same parameters have gradients and each differs by at most ``rel`` of its L2 norm (float32 sums
    in another order: the error scales with the gradient, so it is measured against it)."""
    assert set(got) == set(want)
    for name, g in want.items():
        err = float((got[name] - g).norm() / g.norm().clamp(min=1e-30))
        assert err <= rel, (name, err)


def real_tokens(batch: StepBatch) -> torch.Tensor:
    """Returns [B, T] bool, True over each row's response tokens (observations included), False past it."""
    t = batch.inputs.response_ids.shape[1]
    return torch.arange(t)[None, :] < batch.inputs.response_lengths[:, None]
