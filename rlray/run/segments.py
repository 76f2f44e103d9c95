"""Rows of the step's experience beyond one per sample: agent episodes cut into segments, and padding rows.

An agent episode whose agent rewrote history comes back as several token sequences (``EpisodeInfo.agent.segments`` then
the completion itself: ``rlray.run.agents``). Each is a row of the experience table, trained on its own, and all
carry the episode's reward, group and sample index. So a cut episode weighs once per segment in its group's
statistics, as in AReaL's per-call samples and SkyRL's step-wise training (which normalises over the last steps
only). The table holds the samples' rows first (``B``, in order, what reward and group statistics read), then the
extra segment rows.

The update needs every learner rank's shard to hold whole groups and the same number of rows, split into the
same number of mini-batches (``minibatches_per_epoch``). ``layout_for_ranks`` keeps that: each rank takes its
contiguous block of sample rows as before, plus the segment rows of its groups, and is padded to the same size, a
multiple of the mini-batch count, with padding rows (a one-token copy of the block's last row, mask off: no loss,
no statistic; ``segment`` -1). A step without segments keeps its table exactly, and its mini-batches their
``learner.sequences_per_minibatch`` rows; a step with segments has larger mini-batches, never more of them.
"""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa

from rlray import schema
from rlray.rollout import Completion

PADDING = -1  # the ``segment`` of a padding row


def experience_rows(completions: list[Completion]) -> list[tuple[int, Completion, int | None]]:
    """Returns the rows of the step's experience as (sample index into ``completions``, the row's token sequence,
    its segment index or None): one per sample first, in order (a cut episode's last segment, index k), then the
    earlier segments of each cut episode (0..k-1)."""
    rows: list[tuple[int, Completion, int | None]] = []
    earlier = [c.episode.agent.segments if c.episode is not None and c.episode.agent is not None else []
               for c in completions]  # a cut agent episode's earlier segments (EpisodeInfo.agent)
    for i, c in enumerate(completions):
        rows.append((i, c, len(earlier[i]) if earlier[i] else None))
    for i in range(len(completions)):
        rows += [(i, seg, j) for j, seg in enumerate(earlier[i])]
    return rows


def layout_for_ranks(table: pa.Table, samples: int, world: int, minibatches: int) -> pa.Table:
    """Returns ``table`` laid out for ``world`` learner ranks (see the module docstring); ``table`` itself when it has
    no row beyond its ``samples`` rows.

    Args:
        table: the step's experience: ``samples`` sample rows, then segment rows.
        samples: B, the sample rows (a multiple of ``world``; groups are contiguous).
        world: learner ranks.
        minibatches: mini-batches per epoch (``Config.minibatches_per_epoch``).
    """
    if table.num_rows == samples:
        return table
    per = samples // world
    groups = table.column("group_id").to_pylist()
    rank_of = {groups[i]: i // per for i in range(samples)}
    blocks = [list(range(r * per, (r + 1) * per)) for r in range(world)]
    for i in range(samples, table.num_rows):
        blocks[rank_of[groups[i]]].append(i)
    size = minibatches * math.ceil(max(len(b) for b in blocks) / minibatches)
    rows = table.to_pylist()
    laid = []
    for block in blocks:
        laid += [rows[i] for i in block] + [_padding(rows[block[-1]])] * (size - len(block))
    return pa.Table.from_pylist(laid, schema=schema.EXPERIENCE_SCHEMA)


def _padding(row: dict[str, Any]) -> dict[str, Any]:
    """Returns a padding row: ``row`` cut to one prompt and one response token, its mask off, segment -1."""
    one = {name: row[name][:1] for name in ("response_token_ids", "rollout_logprobs", "old_logprobs", "ref_logprobs",
                                            "advantages", "token_versions") if row[name] is not None}
    return {**row, **one, "prompt_token_ids": row["prompt_token_ids"][-1:], "response_mask": [False],
            "segment": PADDING}


def sample_rows(table: pa.Table) -> list[int]:
    """Returns the indices of the rows that hold a sample or a segment (every row but the padding rows)."""
    return [i for i, s in enumerate(table.column("segment").to_pylist()) if s != PADDING]
