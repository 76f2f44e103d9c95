"""The exact layout (``rlray.models.exact``): a row's distribution is the same bits however much of the buffer is
filled, with or without grad, in train or eval mode, whatever the pad; a KV-cached forward is not (the control)."""

import pytest
import torch

from rlray.models import load_causal_lm
from rlray.models.exact import exact_log_softmax

N = 10  # max_new_tokens


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load_causal_lm(tiny_model_path)  # float32, as the learner and the exact sampler load it


def _sequence(seed: int, prompt_tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 40_000, (prompt_tokens + N,), generator=g)


def _rows(model, ids, p, dtype="float32", pad_id=0, temperature=0.7):
    return exact_log_softmax(model, ids, prompt_tokens=p, max_new_tokens=N, temperature=temperature, pad_id=pad_id,
                             dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_sampler_s_row_equals_the_learner_s_bit_for_bit(model, dtype):
    assert model.config._attn_implementation == "sdpa"  # what load_causal_lm gives both sides
    for seed, p in ((0, 3), (1, 8), (2, 21)):
        full = _sequence(seed, p)
        model.train()  # the learner's update: grad on, train mode (dropout 0)
        learner = _rows(model, full, p, dtype, pad_id=7)
        model.eval()
        with torch.no_grad():  # the learner's old logprobs: eval mode, no grad
            old = _rows(model, full, p, dtype)
        assert learner.requires_grad and learner.shape == (N, model.config.vocab_size)
        for t in (0, 1, 4, N - 1):  # the sampler at step t: the prompt and t tokens, the rest pads
            with torch.inference_mode():
                sampler = _rows(model, full[: p + t], p, dtype, pad_id=2)
            assert torch.equal(sampler[t], learner[t].detach()), (dtype, p, t)
            assert torch.equal(sampler[t], old[t])


def test_a_kv_cached_forward_is_not_exact(model):
    # the control: what an engine does (the prompt once, then one position per step on its cache) differs in the
    # last bits from the full forward, so the equality above is a property of the layout, not of the model
    p, full = 8, _sequence(3, 8)
    with torch.no_grad():
        exact = _rows(model, full, p, temperature=1.0)
        out = model(input_ids=full[None, :p], use_cache=True)
        cached, cache = [out.logits[0, -1]], out.past_key_values
        for t in range(N - 1):
            out = model(input_ids=full[None, p + t : p + t + 1], past_key_values=cache, use_cache=True)
            cached.append(out.logits[0, -1])
    cached = torch.stack(cached).log_softmax(-1)
    assert torch.allclose(cached, exact, atol=1e-4)  # the same distribution ...
    assert not torch.equal(cached, exact)  # ... not the same bits


def test_temperature_divides_the_logits_and_greedy_takes_them_raw(model):
    p, full = 5, _sequence(4, 5)
    with torch.no_grad():
        raw = _rows(model, full, p, temperature=1.0)
        assert torch.equal(_rows(model, full, p, temperature=0.0), raw)
        logits_2 = _rows(model, full, p, temperature=2.0)
    # log_softmax(z / 2) from log_softmax(z): z / 2 up to a per-row constant
    assert torch.allclose(logits_2, (raw / 2).log_softmax(-1), atol=1e-5)


def test_a_sequence_outside_the_buffer_is_refused(model):
    full = _sequence(5, 4)
    with pytest.raises(ValueError, match="rollout.max_new_tokens=10"):
        _rows(model, torch.cat([full, full[:1]]), 4)  # 4 + 11 tokens in a buffer of 14
    with pytest.raises(ValueError, match="longer than the buffer"):
        _rows(model, full[:3], 4)  # shorter than its prompt
