"""Packed rows: a micro-batch's sequences one after another in one row, without padding, prefixes shared.

``pack_rows`` lays the rows of a padded micro-batch (``schema.ModelInputs``) out as one row of L tokens. Without
sharing, each sequence is a segment of its own (position ids restart at 0). With sharing, the rows of a group
(rows with the same prompt: a GRPO group's samples, an episode group's) keep their longest common prefix once
(the prompt, and whatever tokens all of them sampled alike after it), followed by each row's continuation, whose
position ids go on from the prefix's; ``rlray.learner.attention`` makes a continuation attend to its prefix and
to itself only. A row's response token j is predicted at the packed position of its token Pj - 1 (the prefix's
when that lies inside it), so logits are computed only at those positions (K of them; the last prefix position
serves every continuation of its group) and each (row, token) gathers its own.

Exactness: the packed forward computes every sequence's tokens as the padded forward does (same positions, the
same keys attended), so logprobs, values and gradients are the padded path's up to float rounding (other matmul
shapes); a prefix's gradient is the sum over its continuations, as separate rows give.

Legend: B sequences, T longest response, L packed tokens, K logit positions, N response tokens (sum over rows),
V vocabulary, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlray.learner.attention import Segment, Segments, enable_packed_attention, packed_mask_placeholder
from rlray.learner.batching import row_tokens, same_prompt_groups
from rlray.learner.logprobs import gathered_logprobs, scaled_logits
from rlray.schema import ModelInputs


@dataclass
class TokenCounts:
    """Tokens the learner's forward passes covered (summed over passes).

    Attributes:
        real: positions computed that hold a real token.
        padding: positions computed that hold padding.
        shared: real tokens of the rows that were not computed because another row's identical prefix was (or, in
            the padded layout's shared-prompt path, that were never needed as inputs: each row's last token).
    """

    real: int = 0
    padding: int = 0
    shared: int = 0

    def add(self, other: TokenCounts) -> None:
        """Adds ``other``'s counts to these, in place."""
        self.real += other.real
        self.padding += other.padding
        self.shared += other.shared


@dataclass(frozen=True)
class PackedRows:
    """B rows of a micro-batch packed into one row (``pack_rows``).

    Attributes:
        input_ids: [1, L] int64 tokens, segment after segment.
        position_ids: [1, L] int64 each token's position in its own sequence.
        segments: the row's segments (``attention.Segments``), what the attention reads.
        logit_positions: [K] int64 packed positions whose next-token distribution is needed (sorted, unique).
        target_index: [N] int64 index into ``logit_positions`` of the position predicting each response token.
        target_ids: [N] int64 the response tokens.
        rows, cols: [N] int64 where each response token sits in the padded [B, T] layout.
        shape: (B, T) of the padded layout.
        tokens: what the packed forward computes (no padding; ``shared`` = tokens the prefixes saved).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: Segments
    logit_positions: torch.Tensor
    target_index: torch.Tensor
    target_ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple[int, int]
    tokens: TokenCounts = field(default_factory=TokenCounts)

    def to(self, device: torch.device | str) -> PackedRows:
        """Returns the layout with every tensor on ``device``."""
        move = {name: getattr(self, name).to(device) for name in
                ("input_ids", "position_ids", "logit_positions", "target_index", "target_ids", "rows", "cols")}
        return PackedRows(**move, segments=self.segments, shape=self.shape, tokens=self.tokens)


def common_prefix(seqs: list[torch.Tensor]) -> int:
    """Returns the length of the longest common prefix of ``seqs`` (1-D int64 tensors)."""
    n = min(len(s) for s in seqs)
    same = torch.ones(n, dtype=torch.bool)
    for s in seqs[1:]:
        same &= s[:n] == seqs[0][:n]
    return n if bool(same.all()) else int((~same).nonzero()[0])


def pack_rows(inputs: ModelInputs, *, share_prefixes: bool) -> PackedRows:
    """Returns the packed layout of ``inputs``'s rows (see the module docstring), built on the CPU.

    Args:
        inputs: a micro-batch's padded forward layout (``schema.ModelInputs``).
        share_prefixes: keep the longest common prefix of each group of rows with the same prompt once.

    Raises:
        ValueError: a row with an empty prompt (nothing would predict its first response token).
    """
    seqs, prompt = row_tokens(inputs)
    if any(p < 1 for p in prompt):
        raise ValueError("pack_rows: every row needs at least one prompt token")
    groups = same_prompt_groups(seqs, prompt) if share_prefixes else [[i] for i in range(len(seqs))]
    pieces, positions, segments = [], [], []
    where: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * len(seqs)  # packed index of each row token
    cursor = 0
    for rows in groups:
        lcp = common_prefix([seqs[r] for r in rows]) if len(rows) > 1 else 0
        start = cursor
        prefix = torch.arange(start, start + lcp)
        if lcp:
            segments.append(Segment(cursor, lcp))
            pieces.append(seqs[rows[0]][:lcp])
            positions.append(torch.arange(lcp))
            cursor += lcp
        for r in rows:
            n = len(seqs[r]) - lcp
            if n:
                segments.append(Segment(cursor, n, start, lcp) if lcp else Segment(cursor, n))
                pieces.append(seqs[r][lcp:])
                positions.append(torch.arange(lcp, lcp + n))
            where[r] = torch.cat([prefix, torch.arange(cursor, cursor + n)])
            cursor += n
    return _layout(inputs, seqs, prompt, pieces, positions, segments, where)


def _layout(inputs: ModelInputs, seqs, prompt, pieces, positions, segments, where) -> PackedRows:
    """Returns the ``PackedRows`` of ``pack_rows``'s pieces: the logit positions and each response token's index."""
    b, t = inputs.response_ids.shape
    predicted, rows, cols = [], [], []
    for r, (seq, p) in enumerate(zip(seqs, prompt, strict=True)):
        n = len(seq) - p
        predicted.append(where[r][p - 1 : p - 1 + n])
        rows.append(torch.full((n,), r, dtype=torch.long))
        cols.append(torch.arange(n))
    logit_positions, target_index = torch.unique(torch.cat(predicted), sorted=True, return_inverse=True)
    rows_t, cols_t = torch.cat(rows), torch.cat(cols)
    length = sum(len(piece) for piece in pieces)
    return PackedRows(
        input_ids=torch.cat(pieces)[None], position_ids=torch.cat(positions)[None], segments=Segments(tuple(segments)),
        logit_positions=logit_positions, target_index=target_index,
        target_ids=inputs.response_ids.detach().cpu()[rows_t, cols_t], rows=rows_t, cols=cols_t, shape=(b, t),
        tokens=TokenCounts(real=length, padding=0, shared=sum(len(s) for s in seqs) - length),
    )


def unpack(values: torch.Tensor, packed: PackedRows) -> torch.Tensor:
    """Returns [B, T] (``values``' dtype) with ``values`` [N] at each response token's place, 0 past each response
    (differentiable)."""
    out = values.new_zeros(packed.shape)
    return out.index_put((packed.rows, packed.cols), values)


def per_token(per_position: torch.Tensor, packed: PackedRows) -> torch.Tensor:
    """Returns [B, T]: a value per logit position ([K], e.g. an entropy) at every response token it predicts."""
    return unpack(per_position[packed.target_index], packed)


def gathered_token_logprobs(logits: torch.Tensor, packed: PackedRows, *, inplace_backward: bool = False) -> torch.Tensor:
    """Returns [N] logprobs (nats) of the layout's response tokens under [K, V] ``logits`` at its logit positions
    (``logprobs.gathered_logprobs``: several tokens may read one position, the last of a shared prefix)."""
    return gathered_logprobs(logits, packed.target_index, packed.target_ids, inplace_backward=inplace_backward)


def packed_logits(model: torch.nn.Module, packed: PackedRows, *, temperature: float = 1.0) -> torch.Tensor:
    """Returns [K, V] float32 next-token logits at the layout's logit positions, divided by ``temperature``.

    One forward over the packed row (``attention`` switched to ``ATTENTION_NAME`` on first use), the vocabulary
    projection only at the K positions (``logits_to_keep`` as an index tensor).

    Args:
        model: a Hugging Face causal LM (or a DDP / FSDP / peft wrapper of one) that can pack (``packing_blocker``).
        packed: the layout, on the model's device.
        temperature: sampling temperature of the rollout (> 0).

    Raises:
        ValueError: the model cannot run packed rows.
    """
    enable_packed_attention(model)
    out = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                attention_mask=packed_mask_placeholder(packed.input_ids.device), logits_to_keep=packed.logit_positions,
                use_cache=False, packed_segments=packed.segments)
    return scaled_logits(out.logits[0], temperature)


def packed_hidden(model: torch.nn.Module, packed: PackedRows) -> torch.Tensor:
    """Returns [K, H] last hidden states of a head model's trunk (``model.<base_model_prefix>``, through a DDP
    wrapper's ``module``) at the layout's logit positions: where a critic reads V(s_t) (``rlray.models.heads``)."""
    enable_packed_attention(model)
    inner = getattr(model, "module", model)
    trunk = getattr(inner, inner.base_model_prefix)
    out = trunk(input_ids=packed.input_ids, position_ids=packed.position_ids,
                attention_mask=packed_mask_placeholder(packed.input_ids.device), use_cache=False,
                packed_segments=packed.segments)
    return out.last_hidden_state[0, packed.logit_positions]
