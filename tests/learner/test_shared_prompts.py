"""Rows that share a prompt compute it once (``response_logits``'s shared-prompt path): the same logits, logprobs
and gradients as one pass per row, on a real (tiny random Llama) model."""

from __future__ import annotations

import pytest
import torch

from rlray.learner.logprobs import logprobs_from_logits, prompt_groups, response_logits
from rlray.models import load_causal_lm
from rlray.schema import ModelInputs, pack_sequences
from tests.learner.packed_rows import assert_grads_close, float64_reference


def _batch(prompts: list[list[int]], responses: list[list[int]]) -> ModelInputs:
    return pack_sequences(prompts, responses, pad_token_id=0)


def test_prompt_groups_are_the_runs_of_equal_prompts():
    a, b = [5, 6, 7], [8, 9]
    batch = _batch([a, a, a, b, b, a], [[1], [2, 3], [4], [5], [6], [7]])
    assert prompt_groups(batch).tolist() == [3, 2, 1]
    assert prompt_groups(_batch([a, b], [[1], [2]])) is None  # nothing to share
    assert prompt_groups(_batch([a], [[1]])) is None


@pytest.fixture(scope="module")
def model(tiny_model_path):
    # float64 throughout (tests/learner/packed_rows.py ``float64_reference``): the two paths then agree to float64
    # rounding on any backend (float32 paths differ by their kernels' summation orders)
    torch.manual_seed(0)
    return float64_reference(load_causal_lm(tiny_model_path, dtype="float32"))


def _masked_logprob_sum(model, batch, share: bool, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = response_logits(model, batch, temperature=0.7, share_prompts=share)
    lp, _ = logprobs_from_logits(logits, batch.response_ids)
    return lp, (lp * mask).sum()


def test_shared_prompts_give_the_logits_and_gradients_of_one_pass_per_row(model):
    gen = torch.Generator().manual_seed(1)

    def toks(n: int) -> list[int]:
        return torch.randint(3, 1000, (n,), generator=gen).tolist()

    p1, p2 = toks(11), toks(6)  # different lengths: the second group's prompt is left-padded
    prompts = [p1] * 3 + [p2] * 3
    responses = [toks(n) for n in (5, 9, 1, 7, 2, 9)]  # right-padded, one of a single token
    batch = _batch(prompts, responses)
    assert prompt_groups(batch).tolist() == [3, 3]
    mask = torch.zeros(batch.response_ids.shape, dtype=torch.float64)
    for i, r in enumerate(responses):
        mask[i, : len(r)] = 1.0
    model.zero_grad(set_to_none=True)
    lp_plain, loss_plain = _masked_logprob_sum(model, batch, False, mask)
    loss_plain.backward()
    grads_plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    lp_shared, loss_shared = _masked_logprob_sum(model, batch, True, mask)
    loss_shared.backward()
    grads_shared = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    valid = mask.bool()
    # float64 sums in another order (tests/learner/test_packing.py's bounds: seen <= 4e-15 nats, 1.1e-15 of a norm)
    torch.testing.assert_close(lp_shared[valid], lp_plain[valid], rtol=0, atol=1e-10)
    assert_grads_close(grads_shared, grads_plain, rel=1e-9, floor=1e-12)
    assert float(loss_plain) < 0  # a real loss: logprobs of random tokens


def test_rows_without_a_shared_prompt_take_the_plain_path(model):
    batch = _batch([[5, 6, 7], [8, 9]], [[1, 2], [3, 4]])
    torch.testing.assert_close(response_logits(model, batch), response_logits(model, batch, share_prompts=False))
