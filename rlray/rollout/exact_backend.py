"""The exact backend of RolloutEngine (``rollout.backend=exact``): samples with the learner's own forward, so that every
rollout logprob equals the learner's bit for bit.

Each sequence runs alone, one token at a time, through ``rlray.models.exact.exact_log_softmax``: the prompt and
the response so far in a buffer of prompt + max_new_tokens tokens, a full forward without KV cache. The learner
scores the finished sequence through the same function (``MicroBatching.exact_new_tokens``), with the same shapes,
so on an on-policy step every importance ratio is exactly 1 and ``algo/rollout_kl`` exactly 0. The model is the
learner's too: float32 master weights loaded by ``load_causal_lm`` (same attention implementation), run under the
same bf16 autocast when ``dtype`` is bfloat16, with the learner's torch thread count.

The price: a full forward of P + N positions per generated token, one sequence at a time (no batching, no cache),
where an engine computes one position per token for a whole batch; docs/algorithms.md has the measured cost.
Plain temperature sampling only: top-p, top-k, min-p and stop strings are refused (the learner's logprobs do not
see them). Sampling draws from exp(row) of the returned log_softmax with a torch.Generator seeded per call.

Legend: P prompt tokens, N max_new_tokens, V vocabulary.
"""

from __future__ import annotations

import torch

from rlray.models import load_causal_lm
from rlray.models.adapters import AdapterWeights
from rlray.models.exact import exact_log_softmax
from rlray.rollout.hf_backend import _eos_ids
from rlray.rollout.types import Completion, InProcessBackend, SamplingSpec


class ExactBackend(InProcessBackend):
    """A causal LM that samples one sequence at a time in the exact layout, logprobs bitwise the learner's.

    Args:
        model_path: local Hugging Face folder (config.json and safetensors).
        dtype: the learner's precision: "bfloat16" (bf16 autocast over float32 weights) or "float32".
        seed: seed of the sampling generator when a SamplingSpec has no seed.
        torch_threads: torch.set_num_threads for this process, the learner's count (a reduction split over another
            number of threads sums in another order); None keeps the process's.
    """

    def __init__(self, model_path: str, *, dtype: str, seed: int, torch_threads: int | None = None) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self._model = load_causal_lm(model_path, dtype=torch.float32).requires_grad_(False)
        self._dtype = dtype
        self._eos_ids = _eos_ids(self._model)
        self._generator_seed = seed

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingSpec,
                 policy_version: int) -> list[Completion]:
        """Returns n completions per prompt, prompt-major, with log_softmax(logits / temperature) logprobs.

        Sequences are sampled in order (prompt 0's n samples, then prompt 1's), all from one generator seeded with
        ``sampling.seed`` (None: a private stream seeded at start, advanced by one per call); greedy takes the
        argmax. A sequence ends after an EOS token (kept) or at ``sampling.max_new_tokens``.

        Raises:
            ValueError: top_p < 1, top_k > 0, min_p > 0 or stop strings (names the rollout.* field).
        """
        refused = {"rollout.top_p": sampling.top_p < 1.0, "rollout.top_k": sampling.top_k > 0,
                   "rollout.min_p": sampling.min_p > 0.0, "rollout.stop": bool(sampling.stop)}
        if bad := [name for name, on in refused.items() if on]:
            raise ValueError(f"rlray: rollout.backend=exact samples with temperature alone; {', '.join(bad)} would change the "
                             "distribution without the learner seeing it: leave them at their defaults")
        seed = sampling.seed if sampling.seed is not None else self._next_seed()
        generator = torch.Generator().manual_seed(seed)
        out = []
        for p, prompt in enumerate(prompt_token_ids):
            for s in range(sampling.n):
                ids, logprobs, picked = self._sample(prompt, sampling, generator)
                stopped = ids[-1] in self._eos_ids
                out.append(Completion(prompt_index=p, sample_index=s, response_token_ids=ids, rollout_logprobs=logprobs,
                                      finish_reason="stop" if stopped else "length", policy_version=policy_version))
                if sampling.logprob_token_ids:
                    out[-1].token_id_logprobs = picked
        return out

    @torch.inference_mode()
    def _sample(self, prompt: list[int], sampling: SamplingSpec,
                generator: torch.Generator) -> tuple[list[int], list[float], list[dict[int, float]]]:
        """Returns one completion's token ids, their logprobs and the asked tokens' logprobs at each position."""
        tokens = torch.tensor(prompt, dtype=torch.long)
        ids: list[int] = []
        logprobs: list[float] = []
        picked: list[dict[int, float]] = []
        asked = list(sampling.logprob_token_ids)
        for t in range(sampling.max_new_tokens):
            row = exact_log_softmax(self._model, tokens, prompt_tokens=len(prompt),
                                    max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                    pad_id=self._eos_ids[0], dtype=self._dtype)[t]  # [V] float32
            if sampling.greedy:
                token = int(row.argmax())
            else:
                token = int(torch.multinomial(row.exp(), 1, generator=generator))
            ids.append(token)
            logprobs.append(float(row[token]))
            if asked:
                picked.append(dict(zip(asked, row[asked].tolist(), strict=True)))
            tokens = torch.cat([tokens, torch.tensor([token])])
            if token in self._eos_ids:
                break
        return ids, logprobs, picked

    def load_weights(self, named_tensors: dict[str, torch.Tensor]) -> None:
        """Copies Hugging Face named tensors into the float32 model in place (a float32 sync keeps every bit).

        Raises:
            ValueError: a name the model does not have (names the first ones).
        """
        result = self._model.load_state_dict(named_tensors, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"update_weights: the model has no parameters named {result.unexpected_keys[:3]}")

    def load_adapter(self, adapter: AdapterWeights, version: int) -> None:
        """Refuses: a LoRA policy is not exact (the learner computes W x + B A x, a merged engine (W + B A) x).

        Raises:
            ValueError: always.
        """
        raise ValueError("rlray: rollout.backend=exact does not take LoRA adapters (model.lora.rank must be 0)")
