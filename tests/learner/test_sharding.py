"""rlray.learner.sharding without Ray: FSDP2 over a one-rank gloo group in this process shards the policy, the
reference and the teacher, and gives the unsharded learner's logprobs and weights (two ranks: tests/learner/test_fsdp.py,
marked ray)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlray import schema
from rlray.learner.batching import MicroBatching
from rlray.learner.parallel import FSDP2
from rlray.learner.sharding import gathered_state_dict, is_sharded
from rlray.models import resolve_model_path
from tests.learner.test_policy import _learner, _table


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_policy_reference_and_teacher_shard_and_give_the_unsharded_logprobs(one_rank_group, tiny_model_path,
                                                                            tiny_tokenizer):
    teacher = resolve_model_path("tiny-random@1")  # other weights than the policy's
    batch = schema.collate(_table(tiny_tokenizer.pad_token_id), tiny_tokenizer.pad_token_id)
    plain = _learner(tiny_model_path, teacher_path=teacher)
    sharded = _learner(tiny_model_path, teacher_path=teacher, parallel=FSDP2(mixed_precision=False))
    assert (plain.sharded, sharded.sharded) == (False, True)
    assert is_sharded(sharded.reference.module) and is_sharded(sharded.teacher.module) and not is_sharded(plain.teacher.module)
    for reference in (False, True):
        got = sharded.logprobs(batch.inputs, reference=reference, batching=MicroBatching(3))
        torch.testing.assert_close(got, plain.logprobs(batch.inputs, reference=reference, batching=MicroBatching(3)),
                                   rtol=0, atol=1e-5)
    got = sharded.teacher_logprobs(batch.inputs, batching=MicroBatching(3))
    want = plain.teacher_logprobs(batch.inputs, batching=MicroBatching(3))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got - sharded.logprobs(batch.inputs, reference=False, batching=MicroBatching(3))).abs().max() > 1e-2  # a teacher


def test_gathered_state_dict_is_the_whole_model_once(one_rank_group, tiny_model_path):
    plain = _learner(tiny_model_path, use_reference=False)
    sharded = _learner(tiny_model_path, use_reference=False, parallel=FSDP2(mixed_precision=False))
    want = plain.module.state_dict()
    got = gathered_state_dict(sharded.module, dtype=torch.bfloat16)
    assert set(got) == set(want)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
    if plain.module.config.tie_word_embeddings:  # a tied lm_head is the embedding's tensor, not a second copy
        assert got["lm_head.weight"] is got["model.embed_tokens.weight"]
    exported = sharded.export_weights(torch.float32)
    assert all(torch.equal(exported[k], want[k]) for k in want)


def test_a_frozen_model_must_be_frozen_before_sharding(one_rank_group, tiny_model_path):
    from rlray.models import load_causal_lm

    with pytest.raises(ValueError, match="FSDP2.frozen: the model has parameters that require grad"):
        FSDP2(mixed_precision=False).frozen(load_causal_lm(tiny_model_path, dtype=torch.float32))
