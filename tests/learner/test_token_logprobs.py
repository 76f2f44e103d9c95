"""``token_logprobs``: chunked logprobs with a hand-written backward, against autograd's log_softmax + gather,
TRL's ``selective_log_softmax`` and torch's gradcheck."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlray.learner import logprobs as lp_mod
from rlray.learner.logprobs import logprobs_from_logits, response_logits, token_logprobs
from rlray.models import load_causal_lm
from rlray.schema import pack_sequences
from tests.learner.packed_rows import assert_grads_close, float64_reference


def _reference(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def _case(b: int, t: int, v: int, seed: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(b, t + 1, v, generator=gen, dtype=torch.float64) * scale
    ids = torch.randint(0, v, (b, t), generator=gen)
    weights = torch.randn(b, t, generator=gen, dtype=torch.float64)  # a loss that weighs each token differently
    return base, ids, weights


@settings(derandomize=True, max_examples=60, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 9), v=st.integers(2, 40), chunk=st.integers(1, 200),
       seed=st.integers(0, 10_000), scale=st.sampled_from([0.1, 3.0, 30.0]), inplace=st.booleans())
def test_values_and_gradients_equal_log_softmax_gather(b, t, v, chunk, seed, scale, inplace):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lp_mod, "_CHUNK_ELEMENTS", chunk)  # chunks that cut rows mid-way, or whole rows
        _check_against_autograd(b, t, v, seed, scale, inplace)


def _check_against_autograd(b: int, t: int, v: int, seed: int, scale: float, inplace: bool) -> None:
    base, ids, weights = _case(b, t, v, seed, scale)
    ref_in = base.clone().requires_grad_()
    ref = _reference(ref_in[:, :-1, :], ids)  # a strided view, as the model's sliced output is
    (ref * weights).sum().backward()
    got_in = base.clone().requires_grad_()
    logits = got_in[:, :-1, :] * 1.0  # a non-leaf: in-place backward writes its storage, not the leaf's
    got = token_logprobs(logits, ids, inplace_backward=inplace)
    (got * weights).sum().backward()
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_in.grad, ref_in.grad, rtol=1e-12, atol=1e-12)


def test_hand_computed_two_token_vocabulary():
    # logits (0, ln 3): p = (1/4, 3/4); logprob of token 1 = ln(3/4); d/dlogits of logprob = onehot - p = (-1/4, 1/4)
    logits = torch.tensor([[[0.0, float(torch.log(torch.tensor(3.0)))]]], dtype=torch.float64, requires_grad=True)
    out = token_logprobs(logits, torch.tensor([[1]]))
    torch.testing.assert_close(out, torch.tensor([[float(torch.log(torch.tensor(0.75)))]], dtype=torch.float64))
    out.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[[-0.25, 0.25]]], dtype=torch.float64))


def test_gradcheck():
    base, ids, _ = _case(2, 3, 5, seed=3, scale=1.0)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, ids), (base[:, :-1, :].clone().requires_grad_(),))


def test_matches_trl_selective_log_softmax():
    from trl.trainer.utils import selective_log_softmax

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 7, 300, generator=gen) * 5
    ids = torch.randint(0, 300, (4, 7), generator=gen)
    # float32 on both sides, logits of magnitude ~15 over 300 tokens: logsumexp rounds at ~2^-24 * 15 = 9e-7 (TRL's
    # row-by-row and our chunked reductions sum in another order)
    torch.testing.assert_close(token_logprobs(logits, ids), selective_log_softmax(logits, ids), rtol=1e-6, atol=2e-6)


def test_inplace_backward_with_another_reader_of_the_logits_raises_instead_of_mixing():
    base, ids, _ = _case(1, 4, 6, seed=5, scale=1.0)
    x = base[:, :-1, :].clone().requires_grad_()
    logits = x * 1.0
    other = (logits**2).sum()  # pow saves the logits; made first, its backward runs after token_logprobs'
    out = token_logprobs(logits, ids, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.sum() + other).backward()


def test_entropy_turns_the_inplace_backward_off():
    base, ids, weights = _case(2, 3, 7, seed=9, scale=2.0)
    x = base[:, :-1, :].clone().requires_grad_()
    lp, ent = logprobs_from_logits(x * 1.0, ids, with_entropy=True, inplace_backward=True)
    ((lp * weights).sum() + ent.sum()).backward()
    y = base[:, :-1, :].clone().requires_grad_()
    logp = y.log_softmax(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    ((_reference(y, ids) * weights).sum() + ref_ent.sum()).backward()
    torch.testing.assert_close(ent, ref_ent, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-10)


def test_response_logits_divide_by_the_temperature_in_place_with_the_same_gradients(tiny_model_path):
    torch.manual_seed(0)
    # float64 (tests/learner/packed_rows.py ``float64_reference``): the same function computed in another order
    # agrees to float64 rounding on any backend
    model = float64_reference(load_causal_lm(tiny_model_path, dtype="float32"))
    batch = pack_sequences([[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14]], pad_token_id=0)
    t = batch.response_ids.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, use_cache=False)
    expected = out.logits[:, -t - 1 : -1, :] / 0.5
    (expected.sum() * 0.0 + _reference(expected, batch.response_ids)[:, 0].sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    got = response_logits(model, batch, temperature=0.5, share_prompts=False)
    torch.testing.assert_close(got, expected.detach(), rtol=0, atol=1e-10)
    lp, _ = logprobs_from_logits(got, batch.response_ids, inplace_backward=True)
    lp[:, 0].sum().backward()
    assert_grads_close({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, ref_grads, rel=1e-9,
                       floor=1e-12)
