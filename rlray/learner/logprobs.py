"""Per-token log-probabilities of responses under a causal LM.

Legend: B sequences, Pm longest prompt, T longest response, V vocabulary.
"""

from __future__ import annotations

import contextlib

import torch

from rlray.schema import ModelInputs


def autocast_context(dtype: str) -> contextlib.AbstractContextManager:
    """Returns a bf16 autocast context on the model's device type when ``dtype == 'bfloat16'``.

    Master weights stay float32; matmuls run in bf16 (about 2.5x faster on AMX CPUs).
    """
    if dtype != "bfloat16":
        return contextlib.nullcontext()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.autocast(device_type=device, dtype=torch.bfloat16)


@torch.no_grad()
def store_frozen_for_autocast(model: torch.nn.Module, dtype: str) -> int:
    """Stores a frozen model's ``nn.Linear`` weights in bf16 when ``dtype == 'bfloat16'``; returns the bytes saved.

    Under bf16 autocast every ``nn.Linear`` casts its float32 weight to bf16 on each call (autocast caches the cast
    only for weights that require grad, so a frozen model pays it on every forward). A weight already stored in
    bf16 is the very same bf16 tensor (``.to(bfloat16)`` rounds once, to nearest even, either way), so the model's
    outputs are bit-identical while its linear weights take half the memory. Everything else stays float32:
    embeddings and norms run outside autocast's bf16 list, and a Linear whose weight is shared with another module
    (a tied ``lm_head``) is left alone, since casting it would cast the embedding too. For the reference model and
    the teacher (frozen copies under the learner's autocast); never for trained weights (float32 masters).

    Args:
        model: a frozen module (``requires_grad`` False on the parameters it casts); changed in place.
        dtype: the learner's precision ("bfloat16" casts; anything else leaves the model as it is and returns 0).

    Raises:
        ValueError: a Linear weight to cast still requires grad.
    """
    if dtype != "bfloat16":
        return 0
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    linear = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
              and m.weight.dtype == torch.float32 and owners[id(m.weight)] == 1]  # tied ones stay with the embedding
    for name, module in linear:  # checked before anything is cast
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            raise ValueError(f"store_frozen_for_autocast: {name}.weight requires grad; only frozen models are cast")
    for _, module in linear:
        module.to(torch.bfloat16)
    return sum(p.numel() * 2 for _, m in linear for p in m.parameters(recurse=False))


def response_logits(model: torch.nn.Module, inputs: ModelInputs, *, temperature: float = 1.0,
                    share_prompts: bool = True) -> torch.Tensor:
    """Returns [B, T, V] float32 next-token logits at the response positions, divided by ``temperature``.

    Position i holds the logits that predict response token i. Only the logits of the T+1 last positions are
    computed (``logits_to_keep``), so the cost of the vocabulary projection scales with the response, not the
    prompt. Logits are divided by ``temperature`` before any softmax, as TRL's GRPOTrainer
    (``_get_per_token_logps_and_entropies``) and verl's ``logprobs_from_logits`` do, so that ratios are taken
    under the sampling distribution.

    Rows that share their prompt (a GRPO group's samples, neighbours in a step) compute it once
    (``_shared_prompt_logits``): same logits and gradients, fewer tokens. Not with gradient checkpointing,
    which turns the KV cache off.

    Args:
        model: a Hugging Face causal LM (or a DDP wrapper of one).
        inputs: the rows' forward layout (``schema.ModelInputs``: input_ids, attention_mask, position_ids
            [B, Pm+T] int64, response_ids [B, T] int64).
        temperature: sampling temperature of the rollout (> 0).
        share_prompts: compute each run of rows with the same prompt once (False: one pass per row, the
            reference the shared path is tested against).
    """
    t = inputs.response_ids.shape[1]
    counts = shared_prompt_runs(model, inputs, share_prompts)
    if counts is not None:
        return scaled_logits(_shared_prompt_logits(model, inputs, counts), temperature)
    out = model(
        input_ids=inputs.input_ids,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        logits_to_keep=t + 1,
        use_cache=False,
    )
    return scaled_logits(out.logits[:, :-1, :], temperature)


def shared_prompt_runs(model: torch.nn.Module, inputs: ModelInputs, share_prompts: bool) -> torch.Tensor | None:
    """Returns the runs [G] int64 of rows whose prompt ``response_logits`` computes once (``prompt_groups``), or None
    when it takes one pass per row: sharing off, nothing to share, a response of one token, an FSDP-sharded model, or
    gradient checkpointing (which turns the KV cache off)."""
    if not share_prompts or _sharded(model) or inputs.response_ids.shape[1] < 2 or _checkpointing(model):
        return None
    return prompt_groups(inputs)


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Returns ``logits`` as float32 (float64 logits stay float64: a float64 model is the tests' reference
    precision) divided by ``temperature``: in place (the model's own output, which nothing else reads; Linear's
    backward does not need its output), no copy at temperature 1."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits if temperature == 1.0 else logits.div_(temperature)


def prompt_groups(inputs: ModelInputs) -> torch.Tensor | None:
    """Returns the sizes [G] int64 of the runs of consecutive rows that share their prompt (the same prompt tokens
    and padding), or None when no two neighbouring rows do (nothing to share).

    A step's rows come prompt-major (the ``samples_per_prompt`` samples of a prompt are neighbours), so a
    micro-batch of 8 rows at 4 samples per prompt is 2 runs of 4.
    """
    t = inputs.response_ids.shape[1]
    p = inputs.input_ids.shape[1] - t
    if inputs.num_rows < 2 or p < 1:
        return None
    ids, mask = inputs.input_ids[:, :p], inputs.attention_mask[:, :p]
    same = ((ids[1:] == ids[:-1]) & (mask[1:] == mask[:-1])).all(dim=1)
    if not bool(same.any()):
        return None
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.nonzero(~same).flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([ids.shape[0]])])
    return (ends - starts).to(torch.long)


def _sharded(model: torch.nn.Module) -> bool:
    """Returns True for an FSDP-sharded model (FSDP1's wrapper or FSDP2's ``fully_shard`` class): its forward
    gathers the weights, so the shared-prompt path's second call is left to the plain path there."""
    name = type(model).__name__
    return name.startswith("FSDP") or "FullyShardedDataParallel" in name


def _checkpointing(model: torch.nn.Module) -> bool:
    """Returns True when ``model`` (or the model a DDP / peft wrapper holds) recomputes activations in backward
    (Hugging Face turns the KV cache off then, so the prompt cannot be shared)."""
    inner = getattr(model, "module", model)
    return bool(getattr(inner, "is_gradient_checkpointing", False))


def _shared_prompt_logits(model: torch.nn.Module, inputs: ModelInputs, counts: torch.Tensor) -> torch.Tensor:
    """Returns the [B, T, V] response logits of ``response_logits`` with each group's prompt computed once.

    The G distinct prompts ([G, Pm], left-padded) run first, keeping their KV cache (with its autograd graph);
    the cache is repeated per group (``counts``) and the responses' first T-1 tokens run on top of it. Logit i
    predicts response token i: logit 0 comes from the prompt's last position, logits 1..T-1 from the response
    pass. Same values as one pass over prompt + response (up to float rounding), and in backward each prompt
    position gets the sum of its samples' gradients, which is what separate rows give. A GRPO step of 4 samples
    per prompt, prompts ~3x the response length, computes about half the tokens.

    With DDP the prompt pass calls the wrapped module (``model.module``) and the response pass the wrapper, so
    DDP sees one forward per backward; every parameter's gradient still collects both passes before its
    all-reduce hook fires.
    """
    t = inputs.response_ids.shape[1]
    p = inputs.input_ids.shape[1] - t
    first = torch.cumsum(counts, 0) - counts  # the first row of every group
    inner = getattr(model, "module", model) if hasattr(model, "no_sync") else model
    prompt = inner(
        input_ids=inputs.input_ids[first, :p],
        attention_mask=inputs.attention_mask[first, :p],
        position_ids=inputs.position_ids[first, :p],
        use_cache=True,
        logits_to_keep=1,
    )
    cache = prompt.past_key_values
    for layer in cache.layers:
        layer.keys = layer.keys.repeat_interleave(counts, dim=0)
        layer.values = layer.values.repeat_interleave(counts, dim=0)
    out = model(
        input_ids=inputs.input_ids[:, p : p + t - 1],
        attention_mask=inputs.attention_mask[:, : p + t - 1],
        position_ids=inputs.position_ids[:, p : p + t - 1],
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=t - 1,
    )
    return torch.cat([prompt.logits.repeat_interleave(counts, dim=0), out.logits], dim=1)


_CHUNK_ELEMENTS = 1 << 22  # elements of one chunk's temporaries (16 MiB in float32) in token_logprobs


def _chunks(b: int, t: int, v: int) -> list[tuple[int, slice]]:
    """Returns (row, positions) chunks covering [B, T] with about ``_CHUNK_ELEMENTS`` / V positions each."""
    step = max(1, _CHUNK_ELEMENTS // max(v, 1))
    return [(i, slice(s, s + step)) for i in range(b) for s in range(0, t, step)]


class _TokenLogprobs(torch.autograd.Function):
    """Chunked ``logits.gather(ids) - logsumexp(logits)``; see ``token_logprobs``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, inplace: bool) -> torch.Tensor:
        b, t, v = logits.shape
        logz = torch.empty((b, t), dtype=logits.dtype, device=logits.device)
        for i, pos in _chunks(b, t, v):
            logz[i, pos] = torch.logsumexp(logits[i, pos], dim=-1)
        ctx.save_for_backward(logits, ids, logz)
        ctx.inplace = inplace
        return logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - logz

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, ids, logz = ctx.saved_tensors
        b, t, v = logits.shape
        out = logits if ctx.inplace else torch.empty_like(logits)
        for i, pos in _chunks(b, t, v):
            # d logprob / d logits = onehot(id) - softmax(logits); the onehot part is added below
            probs = torch.exp(logits[i, pos] - logz[i, pos].unsqueeze(-1))
            torch.mul(probs, grad[i, pos].unsqueeze(-1).neg(), out=out[i, pos])
        out.scatter_add_(-1, ids.unsqueeze(-1), grad.unsqueeze(-1).to(out.dtype))
        return out, None, None


class _GatheredLogprobs(torch.autograd.Function):
    """``logits[index, ids] - logsumexp(logits)[index]`` over [K, V] logits, chunked; see ``gathered_logprobs``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, index: torch.Tensor, ids: torch.Tensor, inplace: bool) -> torch.Tensor:
        k, v = logits.shape
        logz = torch.empty(k, dtype=logits.dtype, device=logits.device)
        for _, pos in _chunks(1, k, v):
            logz[pos] = torch.logsumexp(logits[pos], dim=-1)
        ctx.save_for_backward(logits, index, ids, logz)
        ctx.inplace = inplace
        return logits[index, ids] - logz[index]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, index, ids, logz = ctx.saved_tensors
        k, v = logits.shape
        # d lp_n / d logits[index_n] = onehot(ids_n) - softmax: the softmax parts of one position's tokens add up
        weight = torch.zeros_like(logz).index_add_(0, index, grad.to(logz.dtype))
        out = logits if ctx.inplace else torch.empty_like(logits)
        for _, pos in _chunks(1, k, v):
            probs = torch.exp(logits[pos] - logz[pos].unsqueeze(-1))
            torch.mul(probs, weight[pos].unsqueeze(-1).neg(), out=out[pos])
        out.index_put_((index, ids), grad.to(out.dtype), accumulate=True)
        return out, None, None, None


def gathered_logprobs(logits: torch.Tensor, index: torch.Tensor, ids: torch.Tensor, *,
                      inplace_backward: bool = False) -> torch.Tensor:
    """Returns [N] logprobs (nats, the logits' dtype) of tokens ``ids`` [N] int64 at rows ``index`` [N] int64 of
    ``logits`` [K, V].

    ``token_logprobs`` for a packed layout (``rlray.learner.packing``): the same chunked forward and hand-written
    backward, where several tokens may read one row of ``logits`` (the last position of a shared prefix predicts
    the first token of each of its continuations) and their gradients add up there.
    """
    return _GatheredLogprobs.apply(logits, index, ids, inplace_backward)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """Returns logprobs [B, T] (nats, the logits' dtype) of ``ids`` [B, T] int64 under ``logits`` [B, T, V].

    ``logits[b, t, ids[b, t]] - logsumexp(logits[b, t])``, computed in chunks of about 4M elements, as TRL's
    ``selective_log_softmax`` does row by row, and differentiable with a hand-written backward
    (``grad * (onehot(ids) - softmax(logits))``, chunk by chunk): autograd's logsumexp + gather keep the
    exp and the scattered gather gradient, two more [B, T, V] tensors, alive in backward; this keeps only the
    logits and the [B, T] logsumexp, and with ``inplace_backward`` builds the logits' gradient in their own
    storage (no [B, T, V] allocation at all in backward; only when nothing else in the graph needs the logits,
    e.g. no entropy or distillation term on them).
    """
    return _TokenLogprobs.apply(logits, ids, inplace_backward)


def logprobs_from_logits(
    logits: torch.Tensor, response_ids: torch.Tensor, *, with_entropy: bool = False, inplace_backward: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns logprobs [B, T] float32 (nats) of ``response_ids`` under ``logits`` [B, T, V], and the entropy [B, T]
    float32 (nats) of each position's distribution or None.

    ``inplace_backward``: the caller uses ``logits`` for nothing else that backward needs (no other loss term on
    them), so the logprobs' backward builds the logits' gradient in their storage (``token_logprobs``); ignored
    with the entropy, which reads them too. (Were another term to read them, autograd would raise, not mix.)
    """
    logprobs = token_logprobs(logits, response_ids, inplace_backward=inplace_backward and not with_entropy)
    entropy = None
    if with_entropy:
        logz = torch.logsumexp(logits, dim=-1)
        probs = torch.softmax(logits, dim=-1)
        entropy = logz - (probs * logits).sum(-1)
    return logprobs, entropy


def response_logprobs(
    model: torch.nn.Module,
    inputs: ModelInputs,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns the logprob of each response token, and optionally the policy entropy per token.

    ``logprobs_from_logits`` over ``response_logits`` (temperature-scaled logits of the T+1 last positions only).

    Args:
        model: a Hugging Face causal LM (or a DDP wrapper of one).
        inputs: the rows' forward layout (``schema.ModelInputs``).
        temperature: sampling temperature of the rollout (> 0).
        with_entropy: also return the entropy of the next-token distribution (nats).

    Returns:
        logprobs [B, T] float32 in nats (values at padded positions are meaningless; mask them),
        and entropy [B, T] float32 or None.
    """
    logits = response_logits(model, inputs, temperature=temperature)
    return logprobs_from_logits(logits, inputs.response_ids, with_entropy=with_entropy)
