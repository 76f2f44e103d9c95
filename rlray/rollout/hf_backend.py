"""The transformers backend of RolloutEngine: a small fallback for machines without vLLM.

It samples with `model.generate` (temperature, top-p, top-k, min-p; no stop strings or penalties) and reads each
generated token's logprob from the raw logits (`output_logits=True`, taken before any logits
processor) divided by the temperature, so rollout_logprobs mean the same as with the vLLM
backend and the learner: log_softmax(logits / temperature) (greedy: the raw logits). Unlike
vLLM, top-p truncation is not renormalised into them.

A LoRA adapter (``load_adapter``) goes in through peft: the model is wrapped once (``get_peft_model`` with the
adapter's config) and each new adapter's tensors are set in place (``set_peft_model_state_dict``), so generation
runs peft's LoRA layers over the unchanged base weights, as the learner's forward does.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from rlray.models.adapters import AdapterWeights
from rlray.rollout.types import Completion, InProcessBackend, SamplingSpec

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class HFBackend(InProcessBackend):
    """A transformers causal LM that samples token ids with temperature-scaled logprobs.

    Args:
        model_path: local Hugging Face folder (config.json and safetensors).
        dtype: "bfloat16" or "float32".
        seed: seed of the sampling generator when a SamplingSpec has no seed.
    """

    def __init__(self, model_path: str, *, dtype: str, seed: int) -> None:
        self._model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=_TORCH_DTYPES[dtype], use_safetensors=True
        ).eval()
        self._eos_ids = _eos_ids(self._model)
        self._generator_seed = seed
        self._peft: torch.nn.Module | None = None  # the model wrapped by peft, once an adapter is loaded
        self._adapter_config: dict | None = None

    def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingSpec, policy_version: int
    ) -> list[Completion]:
        """Returns n completions per prompt, prompt-major, with log_softmax(logits / temperature) logprobs.

        All P*n sequences run as one left-padded batch. With a seed, the batch is sampled under
        torch.manual_seed(sampling.seed) inside a forked RNG (the caller's RNG is untouched);
        the per-sample seeds of the vLLM backend are not reproduced. Without one, a private
        stream seeded at start advances by one per call.

        Args:
            prompt_token_ids: P prompts, each a non-empty list of token ids.
            sampling: what to sample.
            policy_version: stamped on every Completion.
        """
        if sampling.stop:
            raise ValueError(f"stop strings {list(sampling.stop)!r} need rollout.backend=vllm (the hf fallback stops on EOS only)")
        rows = [ids for ids in prompt_token_ids for _ in range(sampling.n)]
        input_ids, attention_mask = _left_pad(rows, pad_id=self._eos_ids[0])
        # Every processor is set explicitly: generate() fills unset (None) fields from the
        # checkpoint's generation_config.json, then from transformers' defaults (top_k=50).
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=0,
            do_sample=not sampling.greedy,
            temperature=1.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            top_k=0 if sampling.greedy else sampling.top_k,
            min_p=None if sampling.greedy or not sampling.min_p else sampling.min_p,
            typical_p=1.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            eos_token_id=self._eos_ids,
            pad_token_id=self._eos_ids[0],
            return_dict_in_generate=True,
            output_logits=True,
        )
        seed = sampling.seed if sampling.seed is not None else self._next_seed()
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            torch.manual_seed(seed)
            out = self._model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        new_ids = out.sequences[:, input_ids.shape[1] :]  # [B, T] int64
        # out.logits: T raw [B, V] logits; one step at a time keeps memory at one [B, V] float32.
        # Temperature-scaled like the learner's logprobs (greedy: raw); top-p truncation is not
        # renormalised here, unlike the vLLM backend (documented deviation of this fallback).
        scale = sampling.temperature or 1.0
        steps = [(step.float() / scale).log_softmax(-1) for step in out.logits]  # T x [B, V] float32
        logprobs = torch.stack([s.gather(-1, new_ids[:, t, None])[:, 0] for t, s in enumerate(steps)], dim=1)  # [B, T]
        asked = list(sampling.logprob_token_ids)
        picked = torch.stack([s[:, asked] for s in steps], dim=1) if asked else None  # [B, T, K] float32
        completions = [
            _to_completion(row, new_ids[row], logprobs[row], sampling, self._eos_ids, policy_version)
            for row in range(len(rows))
        ]
        if picked is not None:
            for row, c in enumerate(completions):
                c.token_id_logprobs = [dict(zip(asked, v, strict=True)) for v in picked[row, : len(c.response_token_ids)].tolist()]
        return completions

    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Copies Hugging Face named tensors into the model in place (cast to its dtype); drops a loaded adapter.

        Raises:
            ValueError: a name the model does not have (names the first ones).
        """
        if self._peft is not None:  # a whole policy replaces base + adapter: back to the plain model
            self._model, self._peft, self._adapter_config = self._peft.unload(), None, None
        result = self._model.load_state_dict(named_tensors, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"update_weights: the model has no parameters named {result.unexpected_keys[:3]}")

    def load_adapter(self, adapter: AdapterWeights, version: int) -> None:
        """Applies a LoRA adapter over the base weights (peft); generate() uses it until the next load.

        Args:
            adapter: peft-named CPU tensors (cast to the model's dtype) and adapter_config.json's content.
            version: the policy version (unused: one adapter is held at a time, generate() being synchronous).

        Raises:
            ValueError: an adapter tensor the wrapped model lacks, or one of its adapter tensors missing.
        """
        if self._peft is not None and adapter.config != self._adapter_config:
            self._model, self._peft = self._peft.unload(), None  # another LoRA layout: wrap afresh
        self._peft = apply_adapter(self._peft or self._model, adapter)
        self._adapter_config = adapter.config



def apply_adapter(model: torch.nn.Module, adapter: AdapterWeights) -> torch.nn.Module:
    """Returns ``model`` wrapped by peft with ``adapter``'s tensors set (eval mode; a peft model is only given them).

    A plain model is wrapped with the adapter's config (``get_peft_model``: its layers are replaced in place), so
    that its forward and ``generate`` apply the adapter over the unchanged base weights.

    Raises:
        ValueError: an adapter tensor the wrapped model lacks, or one of its adapter tensors missing.
    """
    from peft import PeftConfig, PeftModel, get_peft_model, set_peft_model_state_dict  # deferred: LoRA policies only

    if not isinstance(model, PeftModel):
        model = get_peft_model(model, PeftConfig.from_peft_type(**{**adapter.config, "inference_mode": True})).eval()
    result = set_peft_model_state_dict(model, adapter.tensors)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        raise ValueError(f"update_adapter: the adapter does not fit the model: unknown "
                         f"{list(result.unexpected_keys)[:3]}, missing {missing[:3]}")
    return model


def _eos_ids(model: torch.nn.Module) -> list[int]:
    """Returns the model's stop token ids (generation_config first, then config).

    Raises:
        ValueError: the checkpoint names no EOS token.
    """
    for source in (model.generation_config, model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    raise ValueError("the checkpoint's config.json and generation_config.json name no eos_token_id")


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (input_ids [B, L] int64, attention_mask [B, L] int64), left-padded with pad_id."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, width - len(r) :] = 1
    return input_ids, attention_mask


def _to_completion(
    row: int,
    new_ids: torch.Tensor,
    logprobs: torch.Tensor,
    sampling: SamplingSpec,
    eos_ids: list[int],
    policy_version: int,
) -> Completion:
    """Returns the Completion of batch row `row`, cut after its first EOS (kept).

    Args:
        new_ids: [T] int64 generated ids; after an EOS, generate() pads with EOS.
        logprobs: [T] float32 logprob of each generated id (temperature-scaled).
    """
    ids = new_ids.tolist()
    stop_at = next((t for t, tok in enumerate(ids) if tok in eos_ids), None)
    length = len(ids) if stop_at is None else stop_at + 1
    return Completion(
        prompt_index=row // sampling.n,
        sample_index=row % sampling.n,
        response_token_ids=ids[:length],
        rollout_logprobs=logprobs[:length].tolist(),
        finish_reason="length" if stop_at is None else "stop",
        policy_version=policy_version,
    )
