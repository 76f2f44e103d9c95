"""The exact backend of RolloutEngine (``rollout.backend=exact``): seeded, stops at EOS, refuses what the learner would
not see, takes float32 weights bit for bit. Its logprobs against the learner's: tests/learner/test_exact_on_policy.py."""

import pytest
import torch

from rlray.models import load_causal_lm
from rlray.models.adapters import AdapterWeights
from rlray.models.exact import exact_log_softmax
from rlray.rollout.engine import RolloutEngine
from rlray.rollout.exact_backend import ExactBackend
from rlray.rollout.types import SamplingSpec

N = 8


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return RolloutEngine(tiny_model_path, backend="exact", dtype="float32", seed=0, max_model_len=64)


def test_the_exact_engine_is_seeded_and_stops_at_eos(engine, tiny_tokenizer):
    prompt = [tiny_tokenizer.encode("Count to three.")]
    one, two, other = (engine.generate(prompt, SamplingSpec(n=2, max_new_tokens=6, temperature=1.0, seed=seed))
                       for seed in (5, 5, 6))
    assert [c.response_token_ids for c in one] == [c.response_token_ids for c in two]
    assert [c.rollout_logprobs for c in one] == [c.rollout_logprobs for c in two]
    assert [c.response_token_ids for c in one] != [c.response_token_ids for c in other]  # the seed decides
    for c in one + other:
        assert len(c.rollout_logprobs) == len(c.response_token_ids) <= 6
        assert (c.finish_reason == "stop") == (c.response_token_ids[-1] == tiny_tokenizer.eos_token_id)


@pytest.mark.parametrize(("field", "spec"), [("rollout.top_p", {"top_p": 0.9}), ("rollout.top_k", {"top_k": 5}),
                                             ("rollout.min_p", {"min_p": 0.1}), ("rollout.stop", {"stop": ("\n",)})])
def test_the_exact_engine_refuses_what_the_learner_does_not_see(engine, field, spec):
    with pytest.raises(ValueError, match=f"rlray: rollout.backend=exact .*{field}"):
        engine.generate([[1, 2, 3]], SamplingSpec(n=1, max_new_tokens=N, temperature=1.0, **spec))


def test_logprobs_and_asked_tokens_come_from_the_exact_rows_and_new_weights_are_used(tiny_model_path, tiny_tokenizer):
    backend = ExactBackend(tiny_model_path, dtype="float32", seed=0, torch_threads=torch.get_num_threads())
    prompt = tiny_tokenizer.encode("Hello there")
    spec = SamplingSpec(n=1, max_new_tokens=4, temperature=0.5, seed=3, logprob_token_ids=(5, 17))
    got = backend.generate([prompt], spec, policy_version=0)[0]
    model = load_causal_lm(tiny_model_path)
    ids = torch.tensor(prompt + got.response_token_ids)
    with torch.no_grad():
        rows = exact_log_softmax(model, ids, prompt_tokens=len(prompt), max_new_tokens=4, temperature=0.5,
                                 pad_id=0, dtype="float32")
    want = [float(rows[t, tok]) for t, tok in enumerate(got.response_token_ids)]
    assert got.rollout_logprobs == want  # the learner's rows, bit for bit
    assert got.token_id_logprobs == [{5: float(rows[t, 5]), 17: float(rows[t, 17])}
                                     for t in range(len(got.response_token_ids))]
    greedy = backend.generate([prompt], SamplingSpec(n=1, max_new_tokens=4, temperature=0.0), 0)[0]
    with torch.no_grad():
        raw = exact_log_softmax(model, torch.tensor(prompt + greedy.response_token_ids), prompt_tokens=len(prompt),
                                max_new_tokens=4, temperature=0.0, pad_id=0, dtype="float32")
    assert greedy.response_token_ids == raw[: len(greedy.response_token_ids)].argmax(-1).tolist()
    zeros = {name: torch.zeros_like(p) for name, p in model.state_dict().items()}
    backend.load_weights(zeros)  # all-zero weights: uniform logits, every logprob -log V
    flat = backend.generate([prompt], SamplingSpec(n=1, max_new_tokens=2, temperature=1.0, seed=0), 1)[0]
    assert flat.rollout_logprobs == [float(torch.tensor(1.0 / model.config.vocab_size).log())] * 2
    with pytest.raises(ValueError, match="rlray: rollout.backend=exact does not take LoRA"):
        backend.load_adapter(AdapterWeights({}, {"peft_type": "LORA", "r": 8}), 1)
