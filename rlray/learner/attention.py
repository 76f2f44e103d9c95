"""Attention over packed rows: several sequences (and shared prefixes) in one row, none attending across another.

A packed row (``rlray.learner.packing.PackedRows``) holds segments one after another. A segment is a run of one
sequence's tokens; it may continue a shared prefix (a GRPO group's prompt, kept once in the row), whose keys and
values it then reads before its own. So query i of a segment sees the prefix's tokens and its own tokens 0..i,
which is what that sequence's query sees in a padded row of its own: a tree mask, computed segment by segment
with torch's ``scaled_dot_product_attention`` (the prefix's segment with ``is_causal``, a continuation with a
bool mask [q, prefix + q]), so nothing is spent on pairs that never attend (a block-diagonal mask over the whole
row would cost O(L^2)). In backward every continuation's gradient flows into the prefix's keys and values through
autograd: the prefix's gradient is the sum over its continuations.

Hooked into transformers through its attention interface (``ATTENTION_NAME``, registered in ``AttentionInterface``
and, with SDPA's mask builder, in ``AttentionMaskInterface``). A model switched to it (``enable_packed_attention``)
computes exactly as under ``sdpa`` unless a forward passes ``packed_segments``; then the 2D mask is replaced by
``packed_mask_placeholder`` (a 4D tensor transformers hands through unchanged, and that SDPA would reject, so a
layer that bypasses this function fails loudly instead of attending across segments).

Legend: L tokens of the packed row, H query heads, d head size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTENTION_NAME = "rlray_packed"
_REGISTERED: list[bool] = []


@dataclass(frozen=True)
class Segment:
    """One segment of a packed row: a sequence's own tokens, after the shared prefix it continues (if any).

    Attributes:
        start: packed position of the segment's first token.
        length: its tokens (>= 1).
        prefix_start: packed position of the prefix it continues (ignored when ``prefix_length`` is 0).
        prefix_length: the prefix's tokens; 0 for a segment that continues nothing (a whole sequence, or a prefix).
    """

    start: int
    length: int
    prefix_start: int = 0
    prefix_length: int = 0


@dataclass
class Segments:
    """The segments of one packed row, in order and covering it (passed to the model as ``packed_segments``).

    Attributes:
        segments: the row's segments, in packed order.
        masks: bool masks [q, prefix + q] of the continuations by (q, prefix), built once per device and dtype-free,
            reused by every layer.
    """

    segments: tuple[Segment, ...]
    masks: dict[tuple[int, int, str], torch.Tensor] = field(default_factory=dict)

    def mask(self, length: int, prefix: int, device: torch.device) -> torch.Tensor:
        """Returns the [length, prefix + length] bool mask of a continuation: every prefix key, its own keys <= i."""
        key = (length, prefix, str(device))
        if key not in self.masks:
            self.masks[key] = torch.ones(length, prefix + length, dtype=torch.bool, device=device).tril(prefix)
        return self.masks[key]


def packed_mask_placeholder(device: torch.device | str) -> torch.Tensor:
    """Returns the [1, 1, 0, 0] bool tensor passed as ``attention_mask`` with ``packed_segments``: transformers
    passes a 4D mask through unbuilt (no O(L^2) mask is made), and SDPA would refuse it if it ever got it."""
    return torch.ones((1, 1, 0, 0), dtype=torch.bool, device=device)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Returns [1, Hkv * groups, L, d] from [1, Hkv, L, d] (grouped-query attention's key/value heads repeated)."""
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: Segments, *,
                      scaling: float | None, dropout: float = 0.0) -> torch.Tensor:
    """Returns [1, L, H, d] attention outputs of a packed row, segment by segment (see the module docstring).

    The row is cut into its segments with ``split`` (whose backward is one concatenation; slicing would add each
    piece's gradient into a zero tensor of the whole row, once per segment and layer), and a continuation's keys
    and values are its prefix segment's followed by its own.

    Args:
        query: [1, H, L, d] queries (rotary embeddings applied).
        key, value: [1, H, L, d] keys and values (grouped-query heads already repeated).
        plan: the row's segments.
        scaling: softmax scale (None: 1/sqrt(d)).
        dropout: attention dropout probability (0 in eval).
    """
    lengths = [s.length for s in plan.segments]
    index = {s.start: i for i, s in enumerate(plan.segments)}
    queries, keys, values = (x.split(lengths, dim=2) for x in (query, key, value))
    outs = []
    for i, s in enumerate(plan.segments):
        if s.prefix_length == 0:
            o = F.scaled_dot_product_attention(queries[i], keys[i], values[i], dropout_p=dropout, is_causal=True,
                                               scale=scaling)
        else:
            p = index[s.prefix_start]  # the prefix is a segment of its own
            mask = plan.mask(s.length, s.prefix_length, query.device)
            o = F.scaled_dot_product_attention(queries[i], torch.cat([keys[p], keys[i]], 2),
                                               torch.cat([values[p], values[i]], 2), attn_mask=mask,
                                               dropout_p=dropout, scale=scaling)
        outs.append(o)
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     packed_segments: Segments | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Returns (attention output [B, L, H, d], None): transformers' attention-interface function ``ATTENTION_NAME``.

    With ``packed_segments`` (a packed row, B = 1): ``segment_attention``. Without: transformers' own SDPA
    function, unchanged (the padded layout, and generation).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    out = segment_attention(query, _repeat_kv(key, groups), _repeat_kv(value, groups), packed_segments,
                            scaling=scaling, dropout=dropout)
    return out, None


def register() -> None:
    """Registers ``ATTENTION_NAME`` with transformers (attention function, and SDPA's mask builder); idempotent."""
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, packed_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    _REGISTERED.append(True)


def hf_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """Returns the outermost Hugging Face ``PreTrainedModel`` inside ``model`` (a DDP, FSDP or peft wrapper, or the
    model itself), or None."""
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def packing_blocker(model: torch.nn.Module) -> str | None:
    """Returns why ``model`` cannot run packed rows (a sentence), or None when it can.

    It can when it is a Hugging Face model whose attention goes through transformers' attention interface with
    SDPA (or already ``ATTENTION_NAME``), without sliding-window layers (a window would need its own mask here).
    """
    inner = hf_model(model)
    if inner is None:
        return f"{type(model).__name__} is not a Hugging Face model"
    config = inner.config
    impl = config._attn_implementation
    if impl not in ("sdpa", ATTENTION_NAME):
        return f"its attention is {impl!r}; packing runs on transformers' sdpa attention"
    if not getattr(inner, "_supports_attention_backend", False):
        return f"{type(inner).__name__} does not dispatch attention through transformers' AttentionInterface"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"{type(inner).__name__} has sliding-window attention layers"
    return None


def enable_packed_attention(model: torch.nn.Module) -> None:
    """Switches ``model``'s attention to ``ATTENTION_NAME`` (SDPA unless a forward passes ``packed_segments``).

    For good, not for one call: gradient checkpointing recomputes a layer in backward, outside any call, and must
    find the same attention there. Idempotent.

    Raises:
        ValueError: the model cannot pack (``packing_blocker``'s reason).
    """
    why = packing_blocker(model)
    if why is not None:
        raise ValueError(f"packed sequences need transformers' sdpa attention: {why}")
    register()
    inner = hf_model(model)
    if inner.config._attn_implementation != ATTENTION_NAME:
        inner.set_attn_implementation(ATTENTION_NAME)
