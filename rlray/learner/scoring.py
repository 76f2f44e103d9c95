"""Scoring a micro-batch's rows with a model, padded or packed: logprobs (and entropy, JSD) or critic values.

Every forward of the learner goes through here: the policy's update and its old logprobs, the reference's and the
teacher's logprobs, the critic's values and its update. The layout is chosen per model (``packs``): packed rows
(``rlray.learner.packing``, no padding, a group's prompt computed once) where the model can, padded rows (the
reference layout, ``rlray.learner.logprobs.response_logits``) otherwise or when asked. Both give the same values
and gradients up to float rounding; each pass reports the tokens it computed (``packing.TokenCounts``).

Legend: B sequences, Pm longest prompt, T longest response, V vocabulary.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rlray import algos
from rlray.learner.attention import packing_blocker
from rlray.learner.batching import MicroBatching, microbatches
from rlray.learner.logprobs import autocast_context, logprobs_from_logits, response_logits, shared_prompt_runs
from rlray.learner.packing import (
    TokenCounts,
    gathered_token_logprobs,
    pack_rows,
    packed_hidden,
    packed_logits,
    per_token,
    unpack,
)
from rlray.models.exact import exact_log_softmax
from rlray.models.heads import response_values
from rlray.schema import ModelInputs

log = logging.getLogger(__name__)
_TOLD: set[str] = set()


def packs(model: torch.nn.Module, packing: str) -> bool:
    """Returns True when ``model``'s rows run packed under ``packing`` ("on", "off" or "auto").

    Raises:
        ValueError: packing "on" for a model that cannot pack (the reason, from ``attention.packing_blocker``).
    """
    if packing == "off":
        return False
    why = packing_blocker(model)
    if why is None:
        return True
    if packing == "on":
        raise ValueError(f"learner.sequence_packing=on, but {why}; set learner.sequence_packing=auto (pack where the "
                         "model can) or off")
    if why not in _TOLD:
        _TOLD.add(why)
        log.info("learner.sequence_packing=auto: padded rows, since %s", why)
    return False


def padded_tokens(inputs: ModelInputs, runs: torch.Tensor | None) -> TokenCounts:
    """Returns the tokens a padded forward of ``inputs`` computes: B x (Pm + T) positions, or with prompt runs
    ``runs`` [G] (``logprobs.shared_prompt_runs``) G x Pm prompt positions and B x (T - 1) response positions."""
    t = inputs.response_ids.shape[1]
    p = inputs.input_ids.shape[1] - t
    mask = inputs.attention_mask.detach().cpu()
    rows_tokens = int(mask.sum())
    if runs is None:
        return TokenCounts(real=rows_tokens, padding=mask.numel() - rows_tokens, shared=0)
    first = (torch.cumsum(runs, 0) - runs).cpu()
    real = int(mask[first, :p].sum() + mask[:, p : p + t - 1].sum())
    computed = len(runs) * p + mask.shape[0] * (t - 1)
    return TokenCounts(real=real, padding=computed - real, shared=rows_tokens - real)


@dataclass
class Scores:
    """What one forward gives per response token ([B, T] float32, 0 or meaningless past each response).

    Attributes:
        logprobs: logprobs of the response tokens (nats; with grad when the forward had it).
        entropy: the policy's entropy at each position (nats), when asked.
        jsd: the generalized JSD to the teacher at each position (nats), when a teacher was given.
        tokens: the tokens the forward computed.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    jsd: torch.Tensor | None
    tokens: TokenCounts


def response_scores(model: torch.nn.Module, inputs: ModelInputs, *, dtype: str, temperature: float, packed: bool,
                    share_prefixes: bool, with_entropy: bool = False, teacher: torch.nn.Module | None = None,
                    jsd_beta: float = 0.5, inplace_backward: bool = False,
                    exact_new_tokens: int | None = None) -> Scores:
    """Returns the ``Scores`` of one micro-batch under ``model`` (the forward under ``dtype``'s autocast).

    Args:
        model: a Hugging Face causal LM (or a wrapper of one), on the device of ``inputs``.
        inputs: the micro-batch's padded layout (``schema.ModelInputs``).
        dtype: the learner's precision ("bfloat16": bf16 autocast; "float32").
        temperature: sampling temperature of the rollout (> 0); logits are divided by it.
        packed: run the rows packed (``packs``), else padded.
        share_prefixes: rows with the same prompt compute it once.
        with_entropy: also return the entropy.
        teacher: a frozen teacher whose full distributions give the per-token generalized JSD (no grad), or None.
        jsd_beta: the JSD's beta (``algos.generalized_jsd``).
        inplace_backward: the logprobs' backward may build the logits' gradient in their storage (only when
            nothing else reads the logits: neither the entropy nor a JSD).
        exact_new_tokens: run each row alone in the exact layout (``exact_scores``; ``packed`` and
            ``share_prefixes`` do not apply), or None.

    Raises:
        ValueError: a teacher (JSD) with ``exact_new_tokens``, or a response longer than ``exact_new_tokens``.
    """
    if exact_new_tokens is not None:
        if teacher is not None:
            raise ValueError("rlray: rollout.backend=exact does not compute teacher.divergence=jsd (full logits per "
                             "micro-batch); use teacher.divergence=reverse_kl")
        return exact_scores(model, inputs, dtype=dtype, temperature=temperature, new_tokens=exact_new_tokens,
                            with_entropy=with_entropy)
    inplace = inplace_backward and not with_entropy and teacher is None
    if packed:
        layout = pack_rows(inputs, share_prefixes=share_prefixes).to(inputs.input_ids.device)
        with autocast_context(dtype):
            logits = packed_logits(model, layout, temperature=temperature)
        logprobs = unpack(gathered_token_logprobs(logits, layout, inplace_backward=inplace), layout)
        entropy = per_token(_entropy(logits), layout) if with_entropy else None
        jsd = None
        if teacher is not None:
            with torch.no_grad(), autocast_context(dtype):
                teacher_logits = packed_logits(teacher, layout, temperature=temperature)
            jsd = per_token(algos.generalized_jsd(logits[None], teacher_logits[None], beta=jsd_beta)[0], layout)
        return Scores(logprobs, entropy, jsd, layout.tokens)
    runs = shared_prompt_runs(model, inputs, share_prefixes)
    with autocast_context(dtype):
        logits = response_logits(model, inputs, temperature=temperature, share_prompts=share_prefixes)
    logprobs, entropy = logprobs_from_logits(logits, inputs.response_ids, with_entropy=with_entropy,
                                             inplace_backward=inplace)
    jsd = None
    if teacher is not None:
        with torch.no_grad(), autocast_context(dtype):
            teacher_logits = response_logits(teacher, inputs, temperature=temperature, share_prompts=share_prefixes)
        jsd = algos.generalized_jsd(logits, teacher_logits, beta=jsd_beta)
    return Scores(logprobs, entropy, jsd, padded_tokens(inputs, runs))


def exact_scores(model: torch.nn.Module, inputs: ModelInputs, *, dtype: str, temperature: float, new_tokens: int,
                 with_entropy: bool = False) -> Scores:
    """Returns the ``Scores`` of a micro-batch with each row alone in the exact layout (``models.exact``), the
    forward the exact sampler ran (``rollout.backend=exact``): the same logprobs bit for bit.

    Row b's prompt (P_b real tokens) and response (R_b <= N) go into a buffer of P_b + N tokens; its logprobs are
    ``exact_log_softmax``'s rows gathered at the response tokens (autograd through log_softmax and gather). Each
    forward computes P_b + N positions: the real tokens count as real, the rest of the buffer as padding.

    Args:
        model: a Hugging Face causal LM (or a DDP wrapper of one) with float32 parameters.
        inputs: the micro-batch's padded layout (``schema.ModelInputs``: prompts left-padded, responses right-padded).
        dtype: the learner's precision ("bfloat16": bf16 autocast; "float32").
        temperature: sampling temperature of the rollout (> 0).
        new_tokens: N, rollout.max_new_tokens.
        with_entropy: also return the entropy (nats) of each position's distribution.

    Raises:
        ValueError: a response longer than N (names the row).
    """
    b, t = inputs.response_ids.shape
    p_full = inputs.input_ids.shape[1] - t
    prompt = inputs.attention_mask[:, :p_full].sum(1).tolist()
    response = inputs.attention_mask[:, p_full:].sum(1).tolist()
    logprobs, entropy = [], []
    for i in range(b):
        if response[i] > new_tokens:
            raise ValueError(f"rlray: rollout.backend=exact: row {i} has a response of {response[i]} tokens, more than "
                             f"rollout.max_new_tokens={new_tokens} (multi-turn episodes are not exact)")
        ids = inputs.input_ids[i, p_full - prompt[i] : p_full + response[i]]
        rows = exact_log_softmax(model, ids, prompt_tokens=prompt[i], max_new_tokens=new_tokens,
                                 temperature=temperature, pad_id=0, dtype=dtype)[:t]  # [min(T, N), V]
        kept = rows.shape[0]  # columns past N (padding in every row of an untrimmed batch) get 0
        lp = rows.gather(-1, inputs.response_ids[i, :kept, None]).squeeze(-1)
        logprobs.append(torch.nn.functional.pad(lp, (0, t - kept)))
        if with_entropy:
            entropy.append(torch.nn.functional.pad(-(rows.exp() * rows).sum(-1), (0, t - kept)))
    real = sum(prompt) + sum(response)
    tokens = TokenCounts(real=real, padding=sum(prompt) + b * new_tokens - real, shared=0)
    return Scores(torch.stack(logprobs), torch.stack(entropy) if with_entropy else None, None, tokens)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Returns the entropy (nats) of each row's distribution over the last dimension of ``logits``."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def response_value_scores(model: torch.nn.Module, inputs: ModelInputs, *, dtype: str, packed: bool,
                          share_prefixes: bool) -> tuple[torch.Tensor, TokenCounts]:
    """Returns a value model's [B, T] float32 values (float64 for a float64 model) V(s_t) at the response states (``models.heads.response_values``'
    positions; 0 past each response when packed) and the tokens the forward computed.

    Args:
        model: a model from ``rlray.models.load_value_model`` (or its DDP wrapper), on the device of ``inputs``.
        inputs: the micro-batch's padded layout.
        dtype: the learner's precision (autocast).
        packed: run the rows packed, else padded.
        share_prefixes: rows with the same prompt compute it once (packed only).
    """
    if not packed:
        with autocast_context(dtype):
            values = response_values(model, inputs)
        return _at_least_float32(values), padded_tokens(inputs, None)
    layout = pack_rows(inputs, share_prefixes=share_prefixes).to(inputs.input_ids.device)
    with autocast_context(dtype):
        hidden = packed_hidden(model, layout)
        values = getattr(model, "module", model).score(hidden).squeeze(-1)
    return per_token(_at_least_float32(values), layout), layout.tokens


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Returns ``x`` as float32 when it is narrower (bf16 autocast), else unchanged (float32, or a float64 model's)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@torch.no_grad()
def batched_logprobs(model: torch.nn.Module, inputs: ModelInputs, *, dtype: str, temperature: float,
                     batching: MicroBatching, tokens: TokenCounts | None = None) -> torch.Tensor:
    """Returns [B, T] float32 response logprobs without grad, computed micro-batch by micro-batch (``batching``).

    Runs in eval mode (restored afterwards) under the learner's autocast, so that the policy, a reference copy on
    the learner and a reference actor give identical values for the same weights.

    Args:
        model: a Hugging Face causal LM.
        inputs: the rows' forward layout (``schema.ModelInputs``; response_ids [B, T]).
        dtype: "bfloat16" (bf16 autocast) or "float32".
        temperature: sampling temperature (> 0); see ``logprobs.response_logits``.
        batching: micro-batches and layout (``batching.MicroBatching``).
        tokens: adds the tokens the passes computed to it, when given.

    Raises:
        ValueError: ``batching.packing`` is "on" and the model cannot pack.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    packed = packs(model, batching.packing)
    out = torch.zeros(inputs.response_ids.shape, dtype=torch.float32)
    for rows, mb in microbatches(inputs, batching, packed=packed):
        got = response_scores(model, mb.to(device), dtype=dtype, temperature=temperature, packed=packed,
                              share_prefixes=batching.share_prefixes, exact_new_tokens=batching.exact_new_tokens)
        out[rows, : got.logprobs.shape[1]] = got.logprobs.float().cpu()
        if tokens is not None:
            tokens.add(got.tokens)
    model.train(was_training)
    return out
