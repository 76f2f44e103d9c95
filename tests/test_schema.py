"""Experience schema: the Arrow table, validation errors, sharding and collation."""

import pyarrow as pa
import pytest
import torch

from rlray import schema


def _rows():
    return {
        "prompt_id": ["a", "a", "b", "b"],
        "group_id": [0, 0, 1, 1],
        "sample_index": [0, 1, 0, 1],
        "prompt_token_ids": [[5, 6, 7], [5, 6, 7], [8], [8]],
        "response_token_ids": [[1, 2], [3], [4, 4, 2], [9]],
        "response_mask": [[True, True], [True], [True, True, True], [False]],
        "rollout_logprobs": [[-0.5, -1.0], [-2.0], [-0.1, -0.2, -0.3], [-4.0]],
        "reward": [1.0, 0.0, 0.2, 0.2],
        "reward_components": [{"accuracy": 1.0}, {"accuracy": 0.0}, {"accuracy": 0.0}, {"accuracy": 0.0}],
        "policy_version": [3, 3, 3, 3],
        "finish_reason": ["stop", "length", "stop", "length"],
    }


def test_schema_lists_every_field_once():
    assert len(set(schema.FIELD_NAMES)) == len(schema.FIELD_NAMES)
    for name in ("response_mask", "rollout_logprobs", "old_logprobs", "ref_logprobs", "advantages", "policy_version",
                 "prompt_id", "group_id", "finish_reason"):
        assert name in schema.EXPERIENCE_SCHEMA.names
    assert schema.EXPERIENCE_SCHEMA.field("response_mask").type == pa.list_(pa.bool_())


def test_make_table_fills_nullable_columns():
    t = schema.make_table(_rows())
    assert t.num_rows == 4
    assert t.schema == schema.EXPERIENCE_SCHEMA
    assert t.column("old_logprobs").null_count == 4


def test_missing_required_and_unknown_columns():
    rows = _rows()
    del rows["reward"]
    with pytest.raises(schema.ExperienceError, match="'reward' is required"):
        schema.make_table(rows)
    with pytest.raises(schema.ExperienceError, match="unknown experience columns \\['rewards'\\]"):
        schema.make_table({**_rows(), "rewards": [0] * 4})


def test_token_length_mismatch_names_row_and_column():
    rows = _rows()
    rows["rollout_logprobs"][2] = [-0.1]
    with pytest.raises(schema.ExperienceError, match="row 2: column 'rollout_logprobs' has 1 values, response has 3 tokens"):
        schema.make_table(rows)


def test_set_column_checks_lengths():
    t = schema.make_table(_rows())
    t2 = schema.set_column(t, "advantages", [[1.0, 1.0], [0.5], [0.0, 0.0, 0.0], [2.0]])
    assert t2.column("advantages").to_pylist()[3] == [2.0]
    with pytest.raises(schema.ExperienceError, match="row 1"):
        schema.set_column(t, "advantages", [[1.0, 1.0], [0.5, 0.5], [0.0, 0.0, 0.0], [2.0]])


def test_shard_rows():
    assert schema.shard_rows(8, 1, 2) == slice(4, 8)
    with pytest.raises(schema.ExperienceError):
        schema.shard_rows(7, 0, 2)


def test_collate_layout_left_prompt_right_response():
    t = schema.make_table(_rows())
    b = schema.collate(t, pad_token_id=2)  # pad == a token id that appears in responses (EOS-like)
    # Pm = 3, T = 3: row 2 = [pad pad 8 | 4 4 2]
    assert b.inputs.input_ids[2].tolist() == [2, 2, 8, 4, 4, 2]
    assert b.inputs.attention_mask[2].tolist() == [0, 0, 1, 1, 1, 1]
    assert b.inputs.position_ids[2].tolist() == [0, 0, 0, 1, 2, 3]
    assert b.inputs.input_ids[1].tolist() == [5, 6, 7, 3, 2, 2]
    assert b.inputs.attention_mask[1].tolist() == [1, 1, 1, 1, 0, 0]
    # masks come from the table and lengths, not token values: token 2 inside row 0 counts
    assert b.response_mask.tolist() == [[True, True, False], [True, False, False], [True, True, True], [False, False, False]]
    assert torch.equal(b.rollout_logprobs[0], torch.tensor([-0.5, -1.0, 0.0]))
    assert b.old_logprobs is None and b.advantages is None  # columns not filled in every row stay None
    assert b.reward.dtype == torch.float32 and b.group_id.tolist() == [0, 0, 1, 1]


def test_collate_carries_remax_baseline_when_filled():
    rows = _rows()
    assert schema.collate(schema.make_table(rows), pad_token_id=0).baseline_reward is None
    rows["baseline_reward"] = [0.5, 0.5, 0.25, 0.25]
    out = schema.collate(schema.make_table(rows), pad_token_id=0)
    assert out.baseline_reward.tolist() == [0.5, 0.5, 0.25, 0.25] and out.baseline_reward.dtype == torch.float32
