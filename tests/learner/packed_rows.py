"""Test helpers: step batches of GRPO-like groups (shared prompts, ragged responses, observation tokens masked), and
gradient snapshots, for the packed-vs-padded exactness tests."""

from __future__ import annotations

import math
import types

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


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, rel: float,
                       floor: float) -> None:
    """Asserts the same parameters have gradients, and each parameter's gradient differs from ``want``'s by at most
    ``rel`` of its own L2 norm plus ``floor`` of the L2 norm of all of ``want``'s gradients together.

    Rounding error scales with the gradient, so it is measured against it; the ``floor`` term (relative to the
    whole gradient, never to a clamped norm) judges a parameter whose true gradient is zero or tiny, where both
    paths return rounding noise (a one-token prompt and one-token responses: every query attends to one key, and
    the query projection's gradient is zero in exact arithmetic).
    """
    assert set(got) == set(want)
    total = math.sqrt(sum(float(g.double().square().sum()) for g in want.values()))
    for name, g in want.items():
        err = float((got[name].double() - g.double()).norm())
        bound = rel * float(g.double().norm()) + floor * total
        assert err <= bound, (name, err, bound)


def _rms_norm_float64(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm computed in the input's dtype (transformers' own upcasts to float32 and back)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def float64_reference(model: torch.nn.Module) -> torch.nn.Module:
    """Returns ``model`` cast to float64 in place, its RMSNorms computing in float64.

    transformers' ``LlamaRMSNorm`` computes in float32 whatever its input (and casts back), so a ``.double()``
    model still rounds every normalised hidden state, and every gradient through it, to float32: two layouts of
    the same rows then differ by ~3e-8 of their gradients (float32 rounding of sums taken in another order). With
    the norms in float64 the whole forward and backward are float64, and two layouts agree to ~1e-15.
    """
    model.double()
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_float64, module)
    return model


def real_tokens(batch: StepBatch) -> torch.Tensor:
    """Returns [B, T] bool, True over each row's response tokens (observations included), False past it."""
    t = batch.inputs.response_ids.shape[1]
    return torch.arange(t)[None, :] < batch.inputs.response_lengths[:, None]
