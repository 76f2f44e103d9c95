"""The exact layout: one forward that the sampler and the learner both run, so that their logprobs agree bit for bit.

``rollout.backend=exact`` (docs/algorithms.md, "Exact on-policy mode"). Floating-point results depend on the shapes a kernel
sees (GEMM blocking, the split of a reduction over threads, the attention kernel chosen), not only on the values. A
KV-cached sampler computes one new position per step, [1, H] GEMMs; the learner computes the whole sequence, [L, H]
GEMMs, in batches of rows padded to other lengths: the two logprobs differ in the last bits (rlray measures ~1e-7
nats of k3 on SmolLM2 in float32, docs/algorithms.md). Here both sides call ``exact_log_softmax``, which gives every
forward the same shapes whatever the step:

- one sequence alone (batch 1), its prompt's P tokens first, then the response so far, right-padded with
  ``pad_id`` to a buffer of W = P + N tokens (N = ``max_new_tokens``): the same [1, W] input at every sampling step
  and in the learner;
- an all-ones attention mask and position ids 0..W-1 (causal attention alone hides the later positions, so the mask
  and the kernel path never depend on how much of the buffer is filled), no KV cache;
- the logits of the N + 1 last positions (``logits_to_keep``; [N+1, H] x [H, V] in both), float32, divided by the
  temperature, and ``log_softmax`` over the whole [N, V] block.

With causal attention, position t's hidden state depends on positions <= t only: every GEMM computes each output
element from its own row with a value-independent order, a masked key's softmax weight is exactly 0.0 and adds
exactly 0 to its row, so the logits at position P + t - 1 are the same bits whether the buffer holds pads or the
finished response after t. tests/models/test_exact.py checks it (torch.equal) against a KV-cached forward, which
differs. What it needs besides: the same model code and attention implementation (both load with
``load_causal_lm``), the same parameter dtype (float32 master weights; under bf16 the same ``torch.autocast``), and
the same torch thread count (a reduction split over another number of threads sums in another order).

Legend: P prompt tokens, N max_new_tokens, W = P + N, V vocabulary, H hidden size.
"""

from __future__ import annotations

import contextlib

import torch


def exact_autocast(model: torch.nn.Module, dtype: str) -> contextlib.AbstractContextManager:
    """Returns bf16 autocast on the model's device type when ``dtype == "bfloat16"``, else a null context.

    The same context as the learner's (``rlray.learner.logprobs.autocast_context``) for a CPU model: float32 master
    weights, bf16 matmuls.
    """
    if dtype != "bfloat16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=next(model.parameters()).device.type, dtype=torch.bfloat16)


def exact_log_softmax(model: torch.nn.Module, token_ids: torch.Tensor, *, prompt_tokens: int, max_new_tokens: int,
                      temperature: float, pad_id: int, dtype: str) -> torch.Tensor:
    """Returns [N, V] float32 (float64 for a float64 model) log_softmax(logits / temperature) at the N response positions of the exact layout.

    Row t is the distribution of response token t (the logits of position P + t - 1), and depends only on the
    prompt and the response's first t tokens: the sampler calls this with the response so far and reads row t; the
    learner calls it with the whole response and gathers every row. With grad when the caller has grad enabled.

    Args:
        model: a Hugging Face causal LM (or a DDP wrapper of one) with float32 parameters.
        token_ids: [n] int64, the prompt's P tokens then the response so far (P <= n <= W); on the model's device.
        prompt_tokens: P (>= 1).
        max_new_tokens: N, the response buffer (>= 1): rollout.max_new_tokens.
        temperature: sampling temperature (> 0); 0 (greedy) divides by 1, as the other backends do.
        pad_id: the token that fills the buffer past ``token_ids`` (any id: causal attention never reads it).
        dtype: "bfloat16" (bf16 autocast) or "float32".

    Raises:
        ValueError: ``token_ids`` shorter than the prompt or longer than the buffer W.
    """
    n, width = token_ids.shape[0], prompt_tokens + max_new_tokens
    if prompt_tokens < 1 or not prompt_tokens <= n <= width:
        raise ValueError(f"exact layout: {n} tokens for a prompt of {prompt_tokens} and a buffer of {width} "
                         f"(rollout.max_new_tokens={max_new_tokens}); a response may not be longer than the buffer")
    ids = torch.full((1, width), pad_id, dtype=torch.long, device=token_ids.device)
    ids[0, :n] = token_ids
    with exact_autocast(model, dtype):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                    position_ids=torch.arange(width, device=ids.device)[None], logits_to_keep=max_new_tokens + 1,
                    use_cache=False)
    logits = out.logits[0, :-1]  # [N, V]: position P - 1 + t predicts response token t
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 (a float64 model's stay float64)
    return (logits / (temperature or 1.0)).log_softmax(-1)
