"""Batching on the learner: which rows go into each forward/backward (micro-batch), and slices with padding trimmed.

The records are ``rlray.schema.ModelInputs`` (what a model reads) and ``rlray.schema.StepBatch`` (those inputs
plus the per-token training tensors); both take rows (``rows``, a slice or an index tensor), trim padding
(``trimmed``) and move to a device (``to``).

A micro-batch is cut by sequences (``MicroBatching.sequences`` consecutive rows, what ``split_microbatches`` does)
or by a token budget (``MicroBatching.tokens``): rows binned by length so that each micro-batch computes about
the same number of tokens, counted as the chosen layout computes them (``plan_microbatches``). Which rows share
a micro-batch never changes a loss: every aggregation divides by counts of the whole mini-batch
(``rlray.learner.objective.Normaliser``). Legend: B sequences, Pm longest prompt, T longest response.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

from rlray.schema import ModelInputs, StepBatch

Batch = TypeVar("Batch", ModelInputs, StepBatch)

PACKING_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class MicroBatching:
    """How a learner cuts rows into forward/backward passes and lays them out (``learner.*`` of the config).

    Attributes:
        sequences: rows per micro-batch when ``tokens`` is None (learner.sequences_per_microbatch).
        tokens: token budget of one micro-batch (learner.tokens_per_microbatch), or None to cut by ``sequences``.
        packing: "on" packs a micro-batch's rows into one row without padding (``rlray.learner.packing``), "off"
            keeps padded rows (the reference layout), "auto" packs where the model can (``attention.packing_blocker``).
        share_prefixes: rows that share a prompt compute it once per micro-batch (packed: a tree of segments;
            padded: the prompt's KV cache, ``logprobs.response_logits``).
        exact_new_tokens: N of the exact layout (``rollout.backend=exact``: rollout.max_new_tokens), or None. Set,
            every row runs alone in a buffer of its prompt + N tokens (``rlray.models.exact``), as the exact sampler
            ran it, whatever ``packing`` and ``share_prefixes`` say; the micro-batches only group the backwards.
    """

    sequences: int
    tokens: int | None = None
    packing: str = "off"
    share_prefixes: bool = True
    exact_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.sequences < 1 or (self.tokens is not None and self.tokens < 1):
            raise ValueError(f"MicroBatching: sequences={self.sequences} and tokens={self.tokens} must be >= 1")
        if self.packing not in PACKING_MODES:
            raise ValueError(f"MicroBatching: packing={self.packing!r}; use one of {PACKING_MODES}")
        if self.exact_new_tokens is not None and (self.exact_new_tokens < 1 or self.packing == "on"):
            raise ValueError(f"MicroBatching: exact_new_tokens={self.exact_new_tokens} needs >= 1 and packing off or "
                             f"auto, not {self.packing!r} (the exact layout runs each row alone)")


def split_microbatches(batch: Batch, size: int) -> Iterator[Batch]:
    """Yields consecutive row slices of ``batch`` with ``size`` rows each (the last may be shorter).

    Padding columns that are empty in every row of a slice are trimmed (``trimmed``), so short micro-batches do
    not pay for the longest response of the step; [B] tensors are sliced, never trimmed.

    Args:
        batch: a ``ModelInputs`` or a ``StepBatch`` (``schema.collate`` output) of B rows.
        size: rows per micro-batch (>= 1).
    """
    for start in range(0, batch.num_rows, size):
        yield batch.rows(slice(start, start + size)).trimmed()


def microbatches(batch: Batch, batching: MicroBatching, *, packed: bool) -> Iterator[tuple[torch.Tensor, Batch]]:
    """Yields (rows [b] int64, the micro-batch: those rows of ``batch``, padding trimmed) of ``plan_microbatches``."""
    inputs = batch if isinstance(batch, ModelInputs) else batch.inputs
    for rows in plan_microbatches(inputs, batching, packed=packed):
        yield rows, batch.rows(rows).trimmed()


def plan_microbatches(inputs: ModelInputs, batching: MicroBatching, *, packed: bool) -> list[torch.Tensor]:
    """Returns the rows of each micro-batch ([b] int64, ascending), covering every row once.

    Without a token budget: consecutive runs of ``batching.sequences`` rows. With one: rows binned by length so
    that each micro-batch computes about ``batching.tokens`` tokens, first-fit by decreasing size; a row longer
    than the budget gets a micro-batch of its own. What a micro-batch costs follows the layout: packed, the sum of
    its rows' lengths, a group's prompt counted once when ``share_prefixes`` (a group is binned whole when it
    fits, else cut into parts that each repeat the prompt); padded, its rows times the longest prompt plus the
    longest response (rows of similar lengths binned together, so little is padding).

    Args:
        inputs: the rows' padded layout (``schema.ModelInputs``).
        batching: the micro-batch settings.
        packed: the rows will run packed (``rlray.learner.packing``), else padded.
    """
    b = inputs.num_rows
    if batching.tokens is None:
        return [torch.arange(s, min(s + batching.sequences, b)) for s in range(0, b, batching.sequences)]
    t = inputs.response_ids.shape[1]
    prompt = inputs.attention_mask[:, : inputs.input_ids.shape[1] - t].sum(1).tolist()
    response = inputs.attention_mask[:, inputs.input_ids.shape[1] - t :].sum(1).tolist()
    if packed:
        bins = _bin_packed(_units(inputs, prompt, response, batching), batching.tokens)
    else:
        bins = _bin_padded(prompt, response, batching.tokens)
    return [torch.tensor(sorted(rows), dtype=torch.long) for rows in bins]


def row_tokens(inputs: ModelInputs) -> tuple[list[torch.Tensor], list[int]]:
    """Returns each row's real tokens (prompt then response, [n_b] int64 on the CPU) and its prompt length."""
    t = inputs.response_ids.shape[1]
    p = inputs.input_ids.shape[1] - t
    mask = inputs.attention_mask.detach().cpu().bool()
    ids = inputs.input_ids.detach().cpu()
    prompt = mask[:, :p].sum(1).tolist()
    response = mask[:, p:].sum(1).tolist()
    return [ids[i, p - prompt[i] : p + response[i]] for i in range(len(prompt))], prompt


def same_prompt_groups(seqs: list[torch.Tensor], prompt_lengths: list[int]) -> list[list[int]]:
    """Returns the rows grouped by identical prompt tokens, groups in the order of their first row."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (seq, p) in enumerate(zip(seqs, prompt_lengths, strict=True)):
        groups.setdefault(tuple(seq[:p].tolist()), []).append(i)
    return list(groups.values())


def _units(inputs: ModelInputs, prompt: list[int], response: list[int],
           batching: MicroBatching) -> list[tuple[int, list[int]]]:
    """Returns (tokens, rows) of what is binned whole: each group of rows with one prompt (sharing, the prompt
    counted once), cut into parts within the budget, or each row alone."""
    if not batching.share_prefixes:
        return [(p + r, [i]) for i, (p, r) in enumerate(zip(prompt, response, strict=True))]
    seqs, _ = row_tokens(inputs)
    units = []
    for rows in same_prompt_groups(seqs, prompt):
        head, part, cost = prompt[rows[0]], [], prompt[rows[0]]
        for r in rows:
            if part and cost + response[r] > batching.tokens:
                units.append((cost, part))
                part, cost = [], head
            part.append(r)
            cost += response[r]
        units.append((cost, part))
    return units


def _bin_packed(units: list[tuple[int, list[int]]], budget: int) -> list[list[int]]:
    """Returns the rows of each bin: ``units`` placed first-fit by decreasing tokens into bins of ``budget``."""
    bins: list[list[int]] = []
    room: list[int] = []
    for cost, rows in sorted(units, key=lambda u: (-u[0], u[1][0])):
        k = next((i for i, left in enumerate(room) if cost <= left), None)
        if k is None:
            bins.append([])
            room.append(budget)
            k = len(bins) - 1
        bins[k].extend(rows)
        room[k] -= cost
    return bins


def _bin_padded(prompt: list[int], response: list[int], budget: int) -> list[list[int]]:
    """Returns the rows of each padded micro-batch: rows by decreasing length, cut where one more row would make
    rows x (longest prompt + longest response) exceed ``budget``."""
    order = sorted(range(len(prompt)), key=lambda i: (-(prompt[i] + response[i]), i))
    bins: list[list[int]] = []
    width_p = width_r = 0
    for i in order:
        p, r = max(width_p, prompt[i]), max(width_r, response[i])
        if bins and bins[-1] and (len(bins[-1]) + 1) * (p + r) > budget:
            bins.append([])
            p, r = prompt[i], response[i]
        elif not bins:
            bins.append([])
        bins[-1].append(i)
        width_p, width_r = p, r
    return bins
