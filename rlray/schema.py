"""The experience record: one row per generated sequence, one Arrow table per step.

Every field is listed once in ``FIELDS`` with its dtype, shape and meaning; the Arrow schema and the
tensor collation are derived from that list. Shapes: B sequences in the step, T response tokens of
one row (ragged across rows), Lp prompt tokens of one row (ragged), K assistant turns of an episode.
An episode's response holds its sampled and observation tokens; response_mask is its loss mask.

A table moves through Ray's object store (``ray.put``) from the rollout side to the learner ranks;
each rank takes its rows with ``shard_rows`` and turns them into a ``StepBatch`` of padded tensors with
``collate``: the model inputs (``ModelInputs``) apart from the per-token training tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch


@dataclass(frozen=True)
class Field:
    """One column of the experience table.

    Attributes:
        name: column name.
        arrow_type: the Arrow type of one row's value.
        shape: per-row shape in the legend's letters ("" for a scalar, "T" for per response token).
        doc: what it holds and its unit.
        nullable: whether the column may be filled later in the step (then null until set).
    """

    name: str
    arrow_type: pa.DataType
    shape: str
    doc: str
    nullable: bool = False


FIELDS: tuple[Field, ...] = (
    Field("prompt_id", pa.string(), "", "dataset id of the prompt (stable across epochs)"),
    Field("group_id", pa.int64(), "", "index of the prompt within the step; samples of one prompt share it"),
    Field("sample_index", pa.int32(), "", "0..G-1 within the group"),
    Field("prompt_token_ids", pa.list_(pa.int32()), "Lp", "chat-templated prompt token ids"),
    Field("response_token_ids", pa.list_(pa.int32()), "T", "generated token ids, EOS included when finish_reason == 'stop'"),
    Field("response_mask", pa.list_(pa.bool_()), "T", "True where the response token counts in the loss"),
    Field("rollout_logprobs", pa.list_(pa.float32()), "T", "logprob of each generated token under the rollout engine (nats)"),
    Field("old_logprobs", pa.list_(pa.float32()), "T", "logprob under the learner's policy before this step's update (nats)", True),
    Field("ref_logprobs", pa.list_(pa.float32()), "T", "logprob under the frozen reference model (nats)", True),
    Field("reward", pa.float32(), "", "scalar sequence reward (weighted sum of the components)"),
    Field("reward_components", pa.map_(pa.string(), pa.float32()), "", "named reward terms (NaN failed, null skipped)"),
    Field("advantages", pa.list_(pa.float32()), "T", "per-token advantage (a sequence advantage broadcast over T)", True),
    Field("baseline_reward", pa.float32(), "", "ReMax: reward of the greedy response to the same prompt (else null)", True),
    Field("policy_version", pa.int64(), "", "policy version of the rollout engine that generated the row (its "
          "oldest token's, when a partial rollout continued it under newer weights)"),
    Field("finish_reason", pa.string(), "", "'stop' (EOS) or 'length' (hit max_new_tokens)"),
    Field("prompt_columns", pa.string(), "", "the prompt row's other dataset columns as one JSON object (any types)", True),
    Field("stop_reason", pa.string(), "", "why an episode ended (rlray.envs.episode.STOP_REASONS); null when single-turn "
          "without environments", True),
    Field("num_turns", pa.int32(), "", "assistant turns of an episode (null without environments)", True),
    Field("turn_rewards", pa.list_(pa.float32()), "K", "the environment's reward after each turn, NaN where none was "
          "given (null without environments)", True),
    Field("segment", pa.int32(), "", "the row's token sequence within an agent episode cut where the agent rewrote "
          "history (0 the first, each trained on its own with the episode's reward); null for an uncut episode or a "
          "single-turn row; -1 for a padding row (mask off) that evens the learner ranks' shards", True),
    Field("failure", pa.string(), "", "why the sample has no reward, naming the source (its episode's environment, a "
          "reward function); null when it has one (rlray.run.failures)", True),
    Field("token_versions", pa.list_(pa.int64()), "T", "policy version that sampled each response token (the "
          "weights its rollout_logprobs come from); all policy_version unless a partial rollout (rollout.partial) "
          "continued the row under newer weights; an episode's observation tokens carry the version of the token before "
          "them", True),
    Field("judge_outputs", pa.map_(pa.string(), pa.string()), "", "each judge's raw output on the row, by judge name "
          "(null without reward.judges)", True),
)

FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS)
EXPERIENCE_SCHEMA: pa.Schema = pa.schema([pa.field(f.name, f.arrow_type, nullable=f.nullable) for f in FIELDS])
_TOKEN_FIELDS = {f.name for f in FIELDS if f.shape == "T"}


class ExperienceError(ValueError):
    """An experience table or row that does not fit the schema; the message names the column and row."""


def make_table(rows: dict[str, list[Any]]) -> pa.Table:
    """Returns an experience table built from column lists, validated against ``EXPERIENCE_SCHEMA``.

    Args:
        rows: column name -> list of B values. Nullable columns may be omitted (filled with nulls).

    Raises:
        ExperienceError: a missing or unknown column, columns of different lengths, or a row whose
            per-token columns disagree in length with ``response_token_ids``.
    """
    unknown = set(rows) - set(FIELD_NAMES)
    if unknown:
        raise ExperienceError(f"unknown experience columns {sorted(unknown)}; valid: {list(FIELD_NAMES)}")
    lengths = {name: len(col) for name, col in rows.items()}
    if len(set(lengths.values())) > 1:
        raise ExperienceError(f"experience columns differ in length: {lengths}")
    n = next(iter(lengths.values()), 0)
    arrays = []
    for f in FIELDS:
        if f.name not in rows:
            if not f.nullable:
                raise ExperienceError(f"experience column '{f.name}' is required ({f.doc})")
            arrays.append(pa.nulls(n, f.arrow_type))
        else:
            arrays.append(pa.array(rows[f.name], type=f.arrow_type))
    table = pa.Table.from_arrays(arrays, schema=EXPERIENCE_SCHEMA)
    check_token_lengths(table)
    return table


def check_token_lengths(table: pa.Table) -> None:
    """Checks that every per-token column of each row has the response's length.

    Raises:
        ExperienceError: naming the column and the first bad row.
    """
    ref = np.asarray(table.column("response_token_ids").combine_chunks().value_lengths())
    for name in _TOKEN_FIELDS - {"response_token_ids"}:
        col = table.column(name).combine_chunks()
        if col.null_count == len(col):
            continue
        lens = np.asarray(col.value_lengths().fill_null(-1))
        bad = np.nonzero((lens != ref) & (lens != -1))[0]
        if bad.size:
            i = int(bad[0])
            raise ExperienceError(f"row {i}: column '{name}' has {lens[i]} values, response has {ref[i]} tokens")


def set_column(table: pa.Table, name: str, values: list[Any]) -> pa.Table:
    """Returns ``table`` with column ``name`` replaced by ``values`` (B entries), type-checked.

    Raises:
        ExperienceError: an unknown column, a wrong number of rows, or per-token lengths that disagree.
    """
    if name not in FIELD_NAMES:
        raise ExperienceError(f"unknown experience column '{name}'")
    if len(values) != table.num_rows:
        raise ExperienceError(f"column '{name}': {len(values)} values for {table.num_rows} rows")
    idx = table.schema.get_field_index(name)
    table = table.set_column(idx, EXPERIENCE_SCHEMA.field(name), pa.array(values, type=EXPERIENCE_SCHEMA.field(name).type))
    check_token_lengths(table)
    return table


def shard_rows(num_rows: int, rank: int, world_size: int) -> slice:
    """Returns the contiguous row slice that learner ``rank`` of ``world_size`` owns.

    Raises:
        ExperienceError: when ``num_rows`` does not divide evenly (the config validator prevents this).
    """
    if num_rows % world_size:
        raise ExperienceError(f"{num_rows} experience rows do not split over {world_size} learner ranks")
    per = num_rows // world_size
    return slice(rank * per, (rank + 1) * per)


def _pad(lists: list[list[Any]], width: int, value: Any, dtype: torch.dtype, left: bool = False) -> torch.Tensor:
    out = torch.full((len(lists), width), value, dtype=dtype)
    for i, row in enumerate(lists):
        if row:
            vals = torch.tensor(row, dtype=dtype)
            if left:
                out[i, width - len(row) :] = vals
            else:
                out[i, : len(row)] = vals
    return out


def map_tensors(record: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Returns a copy of the dataclass ``record`` with ``fn`` applied to every tensor field, recursing into nested
    records (``ModelInputs`` in ``StepBatch``); None fields stay None. The records' ``rows`` and ``to`` use it."""
    changes = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = fn(value)
        elif dataclasses.is_dataclass(value):
            changes[f.name] = map_tensors(value, fn)
    return dataclasses.replace(record, **changes)


@dataclass(frozen=True)
class ModelInputs:
    """What a causal LM (or a value or reward head) needs to score B (prompt, response) rows: the padded layout.

    Prompts are left-padded to the longest prompt (Pm) and responses right-padded to the longest response (T), so
    every row's response starts at column Pm. Masks and position ids come from lengths, never from token values, so
    ``pad_token_id == eos_token_id`` is safe. This is all a reference or teacher actor receives of a step.

    Attributes:
        input_ids: [B, Pm+T] int64 prompt then response tokens.
        attention_mask: [B, Pm+T] int64, 1 = a real token.
        position_ids: [B, Pm+T] int64, 0 at each row's first real token.
        response_ids: [B, T] int64, the response tokens (pad_token_id past each response).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_ids: torch.Tensor

    @property
    def num_rows(self) -> int:
        """Returns B, the number of rows."""
        return self.input_ids.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        """Returns [B] int64 response lengths in tokens (the real tokens after column Pm)."""
        return self.attention_mask[:, self.input_ids.shape[1] - self.response_ids.shape[1] :].sum(1)

    def rows(self, rows: slice | torch.Tensor) -> ModelInputs:
        """Returns the rows ``rows``: a slice (views) or a [b] int64 index tensor (copies, in its order); columns
        unchanged."""
        return map_tensors(self, lambda v: v[rows])

    def to(self, device: torch.device | str) -> ModelInputs:
        """Returns the record with every tensor on ``device`` (the same tensors where they already are)."""
        return map_tensors(self, lambda v: v.to(device, non_blocking=True))

    def kept_columns(self) -> tuple[int, int]:
        """Returns (prompt columns, response columns) holding a real token in some row: the rest is padding."""
        t_full = self.response_ids.shape[1]
        t = int(self.attention_mask[:, -t_full:].sum(1).max().item()) if t_full else 0
        p_full = self.input_ids.shape[1] - t_full
        p = int(self.attention_mask[:, :p_full].sum(1).max().item())
        return p, t

    def cropped(self, prompt_columns: int, response_columns: int) -> ModelInputs:
        """Returns the record with only the last ``prompt_columns`` prompt and first ``response_columns`` response
        columns (``kept_columns`` gives the ones that hold tokens)."""
        p_full = self.input_ids.shape[1] - self.response_ids.shape[1]
        full = slice(p_full - prompt_columns, p_full + response_columns)
        return ModelInputs(self.input_ids[:, full], self.attention_mask[:, full], self.position_ids[:, full],
                           self.response_ids[:, :response_columns])

    def trimmed(self) -> ModelInputs:
        """Returns the record without the prompt and response columns that are padding in every row."""
        return self.cropped(*self.kept_columns())


@dataclass
class StepBatch:
    """One learner rank's rows of a step as tensors (``collate``), filled stage by stage.

    The model inputs (``inputs``) are kept apart from the per-token training tensors [B, T] and the per-row ones
    [B]. Optional fields are None until the stage that fills them: stage 4 (``rlray.learner.online
    .reference_and_old``) sets ref_logprobs, teacher_logprobs, old_logprobs and old_values where the step needs
    them, stage 5 advantages and returns. Per-token floats are 0.0 at padded positions.

    Attributes:
        inputs: the forward layout of the rows (``ModelInputs``).
        response_mask: [B, T] bool, True where a response token counts in the loss (False past each response).
        reward: [B] float32 sequence reward (NaN where it failed).
        group_id: [B] int64, index of the prompt within the step.
        policy_version: [B] int64, policy version of the engine that generated the row.
        rollout_logprobs: [B, T] float32 engine logprobs (nats), when every row has them.
        baseline_reward: [B] float32 ReMax's greedy reward, when filled.
        ref_logprobs: [B, T] float32 logprobs under the reference model (nats), when there is one.
        teacher_logprobs: [B, T] float32 logprobs under a reverse-KL distillation teacher (nats).
        old_logprobs: [B, T] float32 logprobs under the policy before the update (nats), when taken before it.
        old_values: [B, T] float32 critic values at rollout time (PPO), reward units.
        advantages: [B, T] float32 per-token advantages.
        returns: [B, T] float32 value targets of a critic (PPO).
    """

    inputs: ModelInputs
    response_mask: torch.Tensor
    reward: torch.Tensor
    group_id: torch.Tensor
    policy_version: torch.Tensor
    rollout_logprobs: torch.Tensor | None = None
    baseline_reward: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        """Returns B, the number of rows."""
        return self.inputs.num_rows

    def rows(self, rows: slice | torch.Tensor) -> StepBatch:
        """Returns the rows ``rows`` of every tensor (a mini-batch or micro-batch): a slice (views) or a [b] int64
        index tensor (copies, in its order)."""
        return map_tensors(self, lambda v: v[rows])

    def to(self, device: torch.device | str) -> StepBatch:
        """Returns the batch with every tensor on ``device`` (the same tensors where they already are)."""
        return map_tensors(self, lambda v: v.to(device, non_blocking=True))

    def trimmed(self) -> StepBatch:
        """Returns the batch without the prompt and response columns that are padding in every row: the inputs
        cropped (``ModelInputs.trimmed``) and every [B, T] tensor cut to the kept response columns."""
        p, t = self.inputs.kept_columns()
        per_token = {f.name: v[:, :t] for f in dataclasses.fields(self)
                     if isinstance(v := getattr(self, f.name), torch.Tensor) and v.dim() == 2}
        return dataclasses.replace(self, inputs=self.inputs.cropped(p, t), **per_token)


@dataclass(frozen=True)
class PairBatch:
    """P preference pairs as 2P rows, the chosen responses first (``rlray.data.pairs.collate_pairs``): the offline
    methods' counterpart of ``StepBatch``.

    Attributes:
        inputs: the forward layout of the 2P rows (``ModelInputs``).
        response_mask: [2P, T] bool, True over each response (from its length).
        ref_chosen_logps / ref_rejected_logps / ref_kl_logps: [P] float32 reference sequence logprobs (nats) cached
            in the pair table, or None where the column is not filled.
        kl_inputs: KTO: the forward layout of the P (prompt, kl_token_ids) rows (the next pair's chosen response),
            or None.
        kl_response_mask: [P, T'] bool, True over each of those responses, or None.
        labels: [P] bool, KTO: True where row i's chosen side is desirable (every pair; an unpaired row's label), or
            None.
        paired_mask: [P] bool, KTO: True where row i is a pair (its rejected row is an undesirable example); False for
            an unpaired row (its rejected row is empty and counts nowhere), or None.
    """

    inputs: ModelInputs
    response_mask: torch.Tensor
    ref_chosen_logps: torch.Tensor | None = None
    ref_rejected_logps: torch.Tensor | None = None
    ref_kl_logps: torch.Tensor | None = None
    kl_inputs: ModelInputs | None = None
    kl_response_mask: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    paired_mask: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> PairBatch:
        """Returns the batch with every tensor on ``device`` (the same tensors where they already are)."""
        return map_tensors(self, lambda v: v.to(device, non_blocking=True))


def response_mask_from_lengths(inputs: ModelInputs) -> torch.Tensor:
    """Returns [B, T] bool, True over each row's response (``ModelInputs.response_lengths``), never from token values."""
    t = inputs.response_ids.shape[1]
    return torch.arange(t)[None, :] < inputs.response_lengths[:, None]


def pack_sequences(prompts: list[list[int]], responses: list[list[int]], pad_token_id: int) -> ModelInputs:
    """Returns the forward layout (``ModelInputs``) of (prompt, response) token lists: left-padded prompts,
    right-padded responses, every row's response starting at column Pm (the longest prompt)."""
    p_max = max((len(p) for p in prompts), default=0)
    t_max = max((len(r) for r in responses), default=0)
    ones = lambda rows: [[1] * len(r) for r in rows]  # noqa: E731
    attention = torch.cat([_pad(ones(prompts), p_max, 0, torch.long, left=True), _pad(ones(responses), t_max, 0, torch.long)], 1)
    response_ids = _pad(responses, t_max, pad_token_id, torch.long)
    return ModelInputs(
        input_ids=torch.cat([_pad(prompts, p_max, pad_token_id, torch.long, left=True), response_ids], 1),
        attention_mask=attention,
        position_ids=(attention.cumsum(1) - 1).clamp(min=0),
        response_ids=response_ids,
    )


def collate(table: pa.Table, pad_token_id: int) -> StepBatch:
    """Returns the rows of ``table`` as a ``StepBatch`` for the learner.

    The inputs come from ``pack_sequences``; response_mask [B, T] bool from the table (False past each response),
    reward [B] float32, group_id and policy_version [B] int64; rollout_logprobs, old_logprobs, ref_logprobs and
    advantages [B, T] float32 (0.0 at padded positions) and baseline_reward [B] float32 where their column is filled
    in every row, else None.
    """
    responses = table.column("response_token_ids").to_pylist()
    inputs = pack_sequences(table.column("prompt_token_ids").to_pylist(), responses, pad_token_id)
    t_max = inputs.response_ids.shape[1]
    filled = {}
    for name in ("rollout_logprobs", "old_logprobs", "ref_logprobs", "advantages"):
        col = table.column(name)
        if col.null_count == 0:
            filled[name] = _pad(col.to_pylist(), t_max, 0.0, torch.float32)
    if table.column("baseline_reward").null_count == 0:
        filled["baseline_reward"] = torch.tensor(table.column("baseline_reward").to_pylist(), dtype=torch.float32)
    return StepBatch(
        inputs=inputs,
        response_mask=_pad(table.column("response_mask").to_pylist(), t_max, False, torch.bool),
        reward=torch.tensor(table.column("reward").to_pylist(), dtype=torch.float32),
        group_id=torch.tensor(table.column("group_id").to_pylist(), dtype=torch.long),
        policy_version=torch.tensor(table.column("policy_version").to_pylist(), dtype=torch.long),
        **filled,
    )
