"""Packed rows (``rlray.learner.packing``, ``rlray.learner.attention``): the layout by hand, and the packed forward's
logprobs, entropy, values and gradients against the padded, unshared path on real models (float32).

Tolerances (float32; other matmul shapes round differently, so no layout is bit-identical to another): on tiny-random,
logprobs, entropies and values within atol 1e-6 + rtol 1e-6 (one float32 ulp of a logprob near -10 is 9.5e-7), losses
the same, gradients within 1e-5 of their L2 norm, parameter by parameter (the embedding's scatter-add sums in another
order; the padded path's own shared-prompt variant differs from its unshared one by 5e-7 to 1e-5 the same way). On
SmolLM2 (30 layers) the padded path itself moves by 2e-5 to 3e-5 on logprobs up to 35 nats (gradients 1e-5 of their
norm) when a row is computed alone rather than in its batch, or with its prompt's KV cache shared: there the packed paths
must stay within twice the padded path's own spread (or 1e-6).
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlray.learner.attention import ATTENTION_NAME, enable_packed_attention, packing_blocker
from rlray.learner.packing import TokenCounts, pack_rows
from rlray.learner.scoring import packs, padded_tokens, response_scores, response_value_scores
from rlray.models import load_causal_lm, resolve_model_path
from rlray.models.heads import load_value_model
from rlray.schema import pack_sequences
from tests.learner.packed_rows import assert_grads_close, grads, group_batch, real_tokens

ATOL = RTOL = 1e-6
GRAD_REL = 1e-5


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load_causal_lm(tiny_model_path, dtype="float32")


def test_a_group_keeps_its_common_prefix_once_and_continuations_go_on_from_it():
    # group A: prompt [5, 6], responses [7, 8, 9] and [7, 4] (they share the sampled 7); row 2 alone: [1] + [2, 3]
    inputs = pack_sequences([[5, 6], [5, 6], [1]], [[7, 8, 9], [7, 4], [2, 3]], pad_token_id=0)
    packed = pack_rows(inputs, share_prefixes=True)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 1, 2, 3]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2]]
    seg = [(s.start, s.length, s.prefix_start, s.prefix_length) for s in packed.segments.segments]
    assert seg == [(0, 3, 0, 0), (3, 2, 0, 3), (5, 1, 0, 3), (6, 3, 0, 0)]
    # row 0's tokens 7, 8, 9 are predicted at packed 1, 2, 3; row 1's 7, 4 at 1, 2; row 2's 2, 3 at 6, 7
    assert packed.logit_positions.tolist() == [1, 2, 3, 6, 7]
    assert packed.logit_positions[packed.target_index].tolist() == [1, 2, 3, 1, 2, 6, 7]
    assert packed.target_ids.tolist() == [7, 8, 9, 7, 4, 2, 3]
    assert (packed.rows.tolist(), packed.cols.tolist()) == ([0, 0, 0, 1, 1, 2, 2], [0, 1, 2, 0, 1, 0, 1])
    assert packed.tokens == TokenCounts(real=9, padding=0, shared=3)  # rows hold 5 + 4 + 3 tokens
    plain = pack_rows(inputs, share_prefixes=False)
    assert plain.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]]
    assert plain.tokens == TokenCounts(real=12, padding=0, shared=0)


def test_padded_token_counts():
    inputs = pack_sequences([[5, 6], [5, 6], [1]], [[7, 8, 9], [7, 4], [2, 3]], pad_token_id=0)  # [3, 2 + 3]
    assert padded_tokens(inputs, None) == TokenCounts(real=12, padding=3, shared=0)
    # prompt runs [2, 1]: prompts [2, 2] positions (3 real), responses [3, 2] positions (all 6 real; each row's last
    # token is never an input)
    assert padded_tokens(inputs, torch.tensor([2, 1])) == TokenCounts(real=9, padding=1, shared=3)


def test_a_model_switches_to_packed_attention_for_good_and_saves_as_before(tiny_model_path, tmp_path):
    m = load_causal_lm(tiny_model_path, dtype="float32")
    assert packing_blocker(m) is None and packs(m, "auto")
    enable_packed_attention(m)
    enable_packed_attention(m)  # idempotent
    assert m.config._attn_implementation == ATTENTION_NAME
    m.save_pretrained(tmp_path)
    assert ATTENTION_NAME not in json.dumps(json.loads((tmp_path / "config.json").read_text()))
    eager = load_causal_lm(tiny_model_path, dtype="float32")
    eager.set_attn_implementation("eager")
    assert "eager" in packing_blocker(eager) and not packs(eager, "auto") and not packs(m, "off")
    with pytest.raises(ValueError, match="learner.sequence_packing=on"):
        packs(eager, "on")


def _scores(model, batch, *, packed, share, entropy=True):
    model.zero_grad(set_to_none=True)
    got = response_scores(model, batch.inputs, dtype="float32", temperature=0.7, packed=packed, share_prefixes=share,
                          with_entropy=entropy)
    mask = batch.response_mask
    loss = torch.where(mask, got.logprobs * batch.advantages, 0.0).sum()
    if entropy:
        loss = loss + 0.1 * torch.where(mask, got.entropy, 0.0).sum()
    loss.backward()
    return got, float(loss), grads(model)


def _assert_same(model, batch, *, atol=ATOL, rtol=RTOL, grad_rel=GRAD_REL):
    want, want_loss, want_grads = _scores(model, batch, packed=False, share=False)
    real = real_tokens(batch)
    for share in (False, True):
        got, loss, got_grads = _scores(model, batch, packed=True, share=share)
        torch.testing.assert_close(got.logprobs[real], want.logprobs[real], atol=atol, rtol=rtol)
        torch.testing.assert_close(got.entropy[real], want.entropy[real], atol=atol, rtol=rtol)
        assert loss == pytest.approx(want_loss, rel=rtol, abs=atol)
        assert_grads_close(got_grads, want_grads, rel=grad_rel)
        groups = bool((batch.group_id.bincount() > 1).any())
        assert got.tokens.padding == 0 and (got.tokens.shared > 0) == (share and groups)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(st.integers(1, 24), min_size=1, max_size=3),
       samples=st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=4), min_size=3, max_size=3),
       shared_start=st.integers(0, 3), seed=st.integers(0, 10**6))
def test_packed_rows_give_the_padded_rows_logprobs_entropy_and_gradients(model, prompts, samples, shared_start, seed):
    batch = group_batch(prompts, samples[: len(prompts)], seed=seed, shared_start=shared_start)
    _assert_same(model, batch)


def test_multi_turn_rows_of_very_different_lengths(model):
    # an episode group: one opening, samples of 1..3 turns (observation tokens masked), one row 40x another
    batch = group_batch([37, 5], [[2, 80, 41, 9], [120, 3]], seed=3, shared_start=2)
    assert not bool(batch.response_mask.all())  # observation tokens are off
    _assert_same(model, batch)


def test_identical_samples_are_computed_once(model):
    inputs = pack_sequences([[5, 6, 7]] * 3, [[8, 9, 10]] * 3, pad_token_id=0)
    packed = pack_rows(inputs, share_prefixes=True)
    assert packed.tokens == TokenCounts(real=6, padding=0, shared=12)
    lp = response_scores(model, inputs, dtype="float32", temperature=1.0, packed=True, share_prefixes=True).logprobs
    want = response_scores(model, inputs, dtype="float32", temperature=1.0, packed=False, share_prefixes=False).logprobs
    torch.testing.assert_close(lp, want, atol=ATOL, rtol=RTOL)


def test_gradient_checkpointing_recomputes_the_packed_attention(tiny_model_path):
    m = load_causal_lm(tiny_model_path, dtype="float32")
    batch = group_batch([9, 4], [[5, 12, 3], [7, 7]], seed=5, shared_start=1)
    _, _, want = _scores(m, batch, packed=False, share=False)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    _, _, got = _scores(m, batch, packed=True, share=True)
    assert_grads_close(got, want, rel=GRAD_REL)


def test_bf16_autocast_packed_logprobs_are_close_to_padded(model):
    batch = group_batch([9, 4], [[5, 12, 3], [7, 7]], seed=6)
    real = real_tokens(batch)
    with torch.no_grad():
        got = response_scores(model, batch.inputs, dtype="bfloat16", temperature=1.0, packed=True, share_prefixes=True)
        want = response_scores(model, batch.inputs, dtype="bfloat16", temperature=1.0, packed=False,
                               share_prefixes=False)
    # bf16 matmuls round at 2^-8: other shapes round differently (a tolerance, not exactness)
    torch.testing.assert_close(got.logprobs[real], want.logprobs[real], atol=0.05, rtol=0.01)


def test_critic_values_and_their_gradients_packed(tiny_model_path):
    critic = load_value_model(tiny_model_path)
    batch = group_batch([8, 3], [[4, 11, 2], [6]], seed=7, shared_start=1)
    real = real_tokens(batch)
    out = {}
    for packed, share in ((False, False), (True, False), (True, True)):
        critic.zero_grad(set_to_none=True)
        values, tokens = response_value_scores(critic, batch.inputs, dtype="float32", packed=packed,
                                               share_prefixes=share)
        torch.where(batch.response_mask, (values - 0.5) ** 2, 0.0).sum().backward()
        out[packed, share] = (values.detach(), grads(critic))
    want_values, want_grads = out[False, False]
    for key in ((True, False), (True, True)):
        torch.testing.assert_close(out[key][0][real], want_values[real], atol=ATOL, rtol=RTOL)
        assert_grads_close(out[key][1], want_grads, rel=GRAD_REL)


@pytest.mark.timeout(120)
def test_smollm2_packed_and_shared_equal_padded():
    """The real model (30 layers, grouped-query attention, 49,152 tokens): one group of 3 samples and a lone row, its
    packed paths within twice the padded path's own spread (each row alone, and the shared-prompt KV cache, vs. the
    batch; see the module docstring)."""
    m = load_causal_lm(resolve_model_path("smollm2-135m-instruct"), dtype="float32")
    batch = group_batch([40, 12], [[24, 9, 31], [17]], seed=11, shared_start=1)
    want, _, want_grads = _scores(m, batch, packed=False, share=False, entropy=False)
    alone_grads: dict[str, torch.Tensor] = {}
    spread = 0.0
    for i in range(batch.num_rows):  # the padded path, one row at a time
        got, _, g = _scores(m, batch.rows(slice(i, i + 1)).trimmed(), packed=False, share=False, entropy=False)
        n = int(batch.inputs.response_lengths[i])
        spread = max(spread, float((got.logprobs[0, :n] - want.logprobs[i, :n]).abs().max()))
        alone_grads = {k: alone_grads.get(k, 0) + v for k, v in g.items()}
    kv, _, kv_grads = _scores(m, batch, packed=False, share=True, entropy=False)  # the padded shared-prompt path
    spread = max(spread, float((kv.logprobs - want.logprobs)[real_tokens(batch)].abs().max()))
    grad_spread = max(float((other[k] - g).norm() / g.norm()) for k, g in want_grads.items()
                      for other in (alone_grads, kv_grads))
    assert 1e-6 < spread < 1e-4 and grad_spread < 1e-4, (spread, grad_spread)  # seen: 3.2e-5, 1.3e-5
    real = real_tokens(batch)
    for share in (False, True):
        got, _, got_grads = _scores(m, batch, packed=True, share=share, entropy=False)
        assert float((got.logprobs - want.logprobs)[real].abs().max()) <= max(2 * spread, 1e-6)
        assert_grads_close(got_grads, want_grads, rel=max(2 * grad_spread, 1e-6))
