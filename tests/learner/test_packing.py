"""Packed rows (``rlray.learner.packing``, ``rlray.learner.attention``): the layout by hand, and the packed forward's
logprobs, entropy, values and gradients against the padded, unshared path on real models.

Bounds, and where they come from (they must hold on any IEEE float32 backend: AVX2, AVX-512, AMX, CUDA):
- Exactness is judged in float64 (``float64_reference``: the model cast to float64, its RMSNorms computing in
  float64). Both layouts then compute the same function up to float64 rounding: logprobs and entropies within
  ``F64_ATOL`` = 1e-10 nats (seen: <= 4e-15 on values up to 12 nats; float64's epsilon is 2.2e-16), gradients within
  ``F64_REL`` = 1e-9 of each parameter's norm plus 1e-12 of the whole gradient's (seen: <= 1.1e-15). A real layout
  error (one position id off, a token attending to another row) moves logprobs by 1e-3 or more, which these bounds
  catch by 7 orders of magnitude (``test_a_wrong_packing_is_caught``).
- Each float32 path (padded and packed) is then held to the float64 truth: logprobs and entropies within
  ``F32_ATOL`` = 1e-4 nats (seen: <= 1.6e-6; float32's epsilon is 1.19e-7, so this is ~70 ulps of a 12-nat logprob,
  room for any reduction order over the 2 layers and the 49,152-token softmax), gradients within 1e-4 of each
  parameter's norm plus 1e-4 of the whole gradient's (seen: <= 1.1e-6 of the whole gradient, on a parameter whose
  exact gradient is zero). Two float32 paths are never compared with each other: their difference is two
  rounding errors, each from another kernel's summation order.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rlray.learner import scoring
from rlray.learner.attention import ATTENTION_NAME, enable_packed_attention, packing_blocker
from rlray.learner.packing import TokenCounts, pack_rows
from rlray.learner.scoring import packs, padded_tokens, response_scores, response_value_scores
from rlray.models import load_causal_lm, resolve_model_path
from rlray.models.heads import load_value_model
from rlray.schema import pack_sequences
from tests.learner.packed_rows import assert_grads_close, float64_reference, grads, group_batch, real_tokens

F64_ATOL = 1e-10  # nats; float64 rounding of the same sums in another order (module docstring)
F64_REL, F64_FLOOR = 1e-9, 1e-12  # of each parameter's gradient norm; of the whole gradient's norm
F32_ATOL = 1e-4  # nats, float32 path vs the float64 truth (module docstring)
F32_REL = F32_FLOOR = 1e-4


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load_causal_lm(tiny_model_path, dtype="float32")


@pytest.fixture(scope="module")
def model64(tiny_model_path):
    return float64_reference(load_causal_lm(tiny_model_path, dtype="float32"))


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
    loss = torch.where(mask, got.logprobs * batch.advantages.to(got.logprobs.dtype), 0.0).sum()
    if entropy:
        loss = loss + 0.1 * torch.where(mask, got.entropy, 0.0).sum()
    loss.backward()
    return got, float(loss.detach()), grads(model)


def _assert_near(got, want, real, *, atol, rel, floor, entropy=True):
    """Asserts ``_scores`` results ``got`` are within the bounds of ``want`` (the float64 padded path's)."""
    (g, g_loss, g_grads), (w, w_loss, w_grads) = got, want
    torch.testing.assert_close(g.logprobs[real].double(), w.logprobs[real].double(), atol=atol, rtol=0)
    if entropy:
        torch.testing.assert_close(g.entropy[real].double(), w.entropy[real].double(), atol=atol, rtol=0)
    # the loss sums <= 2 terms per token: its bound is the per-token bound times the tokens summed
    assert abs(g_loss - w_loss) <= 2 * atol * int(real.sum())
    assert_grads_close(g_grads, w_grads, rel=rel, floor=floor)


def _assert_same(model, model64, batch, *, entropy=True):
    """Every layout in float64 equals the padded unshared one to float64 rounding; every float32 layout is within
    float32 rounding of that float64 truth (module docstring)."""
    real = real_tokens(batch)
    want = _scores(model64, batch, packed=False, share=False, entropy=entropy)
    groups = bool((batch.group_id.bincount() > 1).any())
    for packed, share in ((False, True), (True, False), (True, True)):
        got = _scores(model64, batch, packed=packed, share=share, entropy=entropy)
        _assert_near(got, want, real, atol=F64_ATOL, rel=F64_REL, floor=F64_FLOOR, entropy=entropy)
        if packed:
            assert got[0].tokens.padding == 0 and (got[0].tokens.shared > 0) == (share and groups)
    for packed, share in ((False, False), (True, False), (True, True)):
        got = _scores(model, batch, packed=packed, share=share, entropy=entropy)
        _assert_near(got, want, real, atol=F32_ATOL, rel=F32_REL, floor=F32_FLOOR, entropy=entropy)


# Two examples that failed the earlier float32-vs-float32 bounds on an AMD EPYC with AVX-512: a loss 1.9e-6 apart
# under abs=1e-6, and a one-token prompt with one-token responses, whose query projections' exact gradient is zero
# (both paths returned noise, compared relative to a norm clamped at 1e-30).
@example(prompts=[14, 1], samples=[[1], [1], [1]], shared_start=0, seed=197)
@example(prompts=[1], samples=[[1], [1], [1]], shared_start=0, seed=0)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(st.integers(1, 24), min_size=1, max_size=3),
       samples=st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=4), min_size=3, max_size=3),
       shared_start=st.integers(0, 3), seed=st.integers(0, 10**6))
def test_packed_rows_give_the_padded_rows_logprobs_entropy_and_gradients(model, model64, prompts, samples,
                                                                          shared_start, seed):
    batch = group_batch(prompts, samples[: len(prompts)], seed=seed, shared_start=shared_start)
    _assert_same(model, model64, batch)


@pytest.mark.parametrize("shift", ["position", "token"])
def test_a_wrong_packing_is_caught(model, model64, monkeypatch, shift):
    """The bounds above are tight enough to fail a real layout error: one position id off by one in the second
    segment, or the second segment's first token attending as if it were the previous row's."""
    batch = group_batch([9, 4], [[5, 12, 3], [7, 7]], seed=5, shared_start=1)
    _assert_same(model, model64, batch)  # the right layout passes
    real_pack = scoring.pack_rows

    def wrong(inputs, *, share_prefixes):
        layout = real_pack(inputs, share_prefixes=share_prefixes)
        second = layout.segments.segments[1]
        if shift == "position":
            layout.position_ids[0, second.start] += 1
        else:
            layout.input_ids[0, second.start] = (layout.input_ids[0, second.start] + 1) % 1000 + 3
        return layout

    monkeypatch.setattr(scoring, "pack_rows", wrong)
    with pytest.raises(AssertionError):
        _assert_same(model, model64, batch)


def test_multi_turn_rows_of_very_different_lengths(model, model64):
    # an episode group: one opening, samples of 1..3 turns (observation tokens masked), one row 40x another
    batch = group_batch([37, 5], [[2, 80, 41, 9], [120, 3]], seed=3, shared_start=2)
    assert not bool(batch.response_mask.all())  # observation tokens are off
    _assert_same(model, model64, batch)


def test_identical_samples_are_computed_once(model64):
    inputs = pack_sequences([[5, 6, 7]] * 3, [[8, 9, 10]] * 3, pad_token_id=0)
    packed = pack_rows(inputs, share_prefixes=True)
    assert packed.tokens == TokenCounts(real=6, padding=0, shared=12)
    lp = response_scores(model64, inputs, dtype="float32", temperature=1.0, packed=True, share_prefixes=True).logprobs
    want = response_scores(model64, inputs, dtype="float32", temperature=1.0, packed=False,
                           share_prefixes=False).logprobs
    torch.testing.assert_close(lp, want, atol=F64_ATOL, rtol=0)


def test_gradient_checkpointing_recomputes_the_packed_attention(tiny_model_path):
    m = float64_reference(load_causal_lm(tiny_model_path, dtype="float32"))
    batch = group_batch([9, 4], [[5, 12, 3], [7, 7]], seed=5, shared_start=1)
    _, _, want = _scores(m, batch, packed=False, share=False)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    _, _, got = _scores(m, batch, packed=True, share=True)
    assert_grads_close(got, want, rel=F64_REL, floor=F64_FLOOR)


def test_bf16_autocast_packed_logprobs_are_close_to_padded(model):
    batch = group_batch([9, 4], [[5, 12, 3], [7, 7]], seed=6)
    real = real_tokens(batch)
    with torch.no_grad():
        got = response_scores(model, batch.inputs, dtype="bfloat16", temperature=1.0, packed=True, share_prefixes=True)
        want = response_scores(model, batch.inputs, dtype="bfloat16", temperature=1.0, packed=False,
                               share_prefixes=False)
    # bf16 matmuls round their inputs to 8 significant bits (relative 2^-8 = 3.9e-3) and other shapes round
    # differently: two layouts' logprobs differ by a few such roundings of logits of a few nats (a tolerance, not
    # exactness, which the float64 tests above hold)
    torch.testing.assert_close(got.logprobs[real], want.logprobs[real], atol=0.05, rtol=0.01)


def test_critic_values_and_their_gradients_packed(tiny_model_path):
    critic = float64_reference(load_value_model(tiny_model_path))
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
        torch.testing.assert_close(out[key][0][real], want_values[real], atol=F64_ATOL, rtol=0)
        assert_grads_close(out[key][1], want_grads, rel=F64_REL, floor=F64_FLOOR)


@pytest.mark.timeout(180)
def test_smollm2_packed_and_shared_equal_padded():
    """The real model (30 layers, grouped-query attention, 49,152 tokens): one group of 3 samples and a lone row.
    In float64 every layout equals the padded one to float64 rounding; in float32 each is within ``F32_ATOL`` of the
    float64 truth (seen on an AMX Xeon: 2.9e-5 on logprobs up to 35 nats, the 30 layers' float32 rounding)."""
    m = load_causal_lm(resolve_model_path("smollm2-135m-instruct"), dtype="float32")
    batch = group_batch([40, 12], [[24, 9, 31], [17]], seed=11, shared_start=1)
    real = real_tokens(batch)
    m64 = float64_reference(load_causal_lm(resolve_model_path("smollm2-135m-instruct"), dtype="float32"))
    want = _scores(m64, batch, packed=False, share=False, entropy=False)
    for packed, share in ((False, True), (True, False), (True, True)):
        got = _scores(m64, batch, packed=packed, share=share, entropy=False)
        _assert_near(got, want, real, atol=F64_ATOL, rel=F64_REL, floor=F64_FLOOR, entropy=False)
    del m64
    for packed, share in ((False, False), (True, True)):
        got = _scores(m, batch, packed=packed, share=share, entropy=False)
        _assert_near(got, want, real, atol=F32_ATOL, rel=F32_REL, floor=F32_FLOOR, entropy=False)


def _tiny(arch: str, **extra):
    """Returns a seeded random 2-layer ``arch`` causal LM on SDPA attention (vocabulary 1024, hidden 64)."""
    import transformers

    config = getattr(transformers, f"{arch}Config")(vocab_size=1024, hidden_size=64, intermediate_size=128,
                                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                    max_position_embeddings=256, **extra)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, f"{arch}ForCausalLM")(config).float()


@pytest.mark.parametrize("arch, extra", [("Qwen2", {}), ("Qwen3", {"head_dim": 16}), ("Mistral", {"sliding_window": None}),
                                         ("Phi3", {"pad_token_id": 0})])  # fmt: skip
def test_architectures_beside_llama_pack_exactly(arch, extra):
    """docs/models.md's list: these pass ``packing_blocker`` and their packed, shared rows give the padded rows'
    logprobs and gradients to float64 rounding (a Qwen3's per-head q/k norms included)."""
    model64 = float64_reference(_tiny(arch, **extra))
    assert packing_blocker(model64) is None
    batch = group_batch([5, 9], [[4, 7, 1], [6, 2, 3]], seed=1, shared_start=2)
    real = real_tokens(batch)
    want = _scores(model64, batch, packed=False, share=False, entropy=False)
    got = _scores(model64, batch, packed=True, share=True, entropy=False)
    _assert_near(got, want, real, atol=F64_ATOL, rel=F64_REL, floor=F64_FLOOR, entropy=False)
    assert got[0].tokens.padding == 0 and got[0].tokens.shared > 0


@pytest.mark.parametrize("arch, extra, why", [
    ("Mistral", {"sliding_window": 32}, "has sliding-window attention layers"),
    ("Gemma2", {"head_dim": 16}, "has sliding-window attention layers"),
])  # fmt: skip
def test_sliding_window_architectures_run_padded(arch, extra, why):
    model = _tiny(arch, **extra)
    assert why in packing_blocker(model) and not packs(model, "auto")
