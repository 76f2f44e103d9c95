"""rlray.models.heads: one-label value and reward heads on the tiny random Llama, read at length-computed positions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlray.models.heads import load_reward_model, load_value_model, response_values, sequence_scores
from rlray.models.loading import ModelError
from rlray.schema import pack_sequences

EOS = 2  # the tiny model's eos_token_id, which is also its pad_token_id
PROMPTS = [[5, 17, 230], [40, 41, 42, 43, 44]]
RESPONSES = [[101, 102, 103, 104], [300, EOS]]  # row 1 ends in EOS, which equals the pad token


@pytest.fixture(scope="module")
def value_model(tiny_model_path):
    torch.manual_seed(0)
    return load_value_model(tiny_model_path)


@pytest.fixture(scope="module")
def reward_model(tiny_model_path):
    torch.manual_seed(0)
    return load_reward_model(tiny_model_path)


def test_heads_have_one_label_and_float32_weights(value_model, reward_model):
    assert type(value_model).__name__ == "LlamaForTokenClassification"
    assert type(reward_model).__name__ == "LlamaForSequenceClassification"
    for model in (value_model, reward_model):
        assert model.config.num_labels == 1 and model.score.out_features == 1
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert model.config.pad_token_id == EOS


def test_constant_value_head_gives_that_value_at_every_position(value_model):
    batch = pack_sequences(PROMPTS, RESPONSES, EOS)
    score = value_model.score
    saved = score.weight.detach().clone(), score.bias.detach().clone()
    try:
        with torch.no_grad():
            score.weight.zero_()
            score.bias.fill_(0.25)  # V(s) = 0 . h + 0.25
            values = response_values(value_model, batch)
    finally:
        with torch.no_grad():
            score.weight.copy_(saved[0])
            score.bias.copy_(saved[1])
    assert values.shape == (2, 4) and values.dtype == torch.float32
    assert torch.equal(values, torch.full((2, 4), 0.25))


@torch.no_grad()
def test_value_of_state_t_sees_response_tokens_before_t_only(value_model):
    # V(s_t) is read where response token t is predicted, so changing token k moves values t > k only
    base = response_values(value_model, pack_sequences(PROMPTS[:1], RESPONSES[:1], EOS))
    for k in range(4):
        changed = list(RESPONSES[0])
        changed[k] = 999
        other = response_values(value_model, pack_sequences(PROMPTS[:1], [changed], EOS))
        torch.testing.assert_close(other[:, : k + 1], base[:, : k + 1], atol=1e-6, rtol=0)
        if k < 3:
            assert (other[:, k + 1] - base[:, k + 1]).abs().item() > 1e-6


@torch.no_grad()
def test_values_do_not_depend_on_padding_or_batch_companions(value_model):
    both = response_values(value_model, pack_sequences(PROMPTS, RESPONSES, EOS))
    for i in range(2):
        alone = response_values(value_model, pack_sequences([PROMPTS[i]], [RESPONSES[i]], EOS))
        n = len(RESPONSES[i])
        torch.testing.assert_close(both[i, :n], alone[0, :n], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_sequence_scores_read_the_last_response_token_even_when_it_is_eos(reward_model):
    scores = sequence_scores(reward_model, pack_sequences(PROMPTS, RESPONSES, EOS))
    assert scores.shape == (2,) and scores.dtype == torch.float32
    reward_model.config.pad_token_id = None  # HF then pools at the last position of a one-row batch
    try:
        for i in range(2):
            ids = torch.tensor([PROMPTS[i] + RESPONSES[i]])
            expected = reward_model(input_ids=ids).logits[0, 0]
            torch.testing.assert_close(scores[i], expected, atol=1e-5, rtol=1e-5)
    finally:
        reward_model.config.pad_token_id = EOS


def test_a_folder_without_weights_names_the_key(tiny_model_path, tmp_path):
    shutil.copy(Path(tiny_model_path) / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelError) as err:
        load_value_model(str(tmp_path))
    assert str(err.value).startswith(f"critic.model_path='{tmp_path}': cannot load a AutoModelForTokenClassification")


def test_config_without_pad_token_takes_eos(tiny_model_path, tmp_path):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_model_path) / name, tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["pad_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_reward_model(str(tmp_path)).config.pad_token_id == EOS


@pytest.mark.parametrize("loader, key", [(load_value_model, "critic.model_path"), (load_reward_model, "reward.model_path")])
def test_a_folder_without_config_json_is_a_model_error_naming_the_key(loader, key, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")  # a folder, but not a Hugging Face one
    with pytest.raises(ModelError) as err:
        loader(str(tmp_path))
    assert str(err.value).startswith(f"{key}='{tmp_path}' has no config.json")
    missing = tmp_path / "absent"
    with pytest.raises(ModelError) as err:
        loader(str(missing))
    assert str(err.value).startswith(f"{key}='{missing}' is not an existing folder")


def test_reward_model_errors_name_the_key_the_caller_gives(tmp_path):
    with pytest.raises(ModelError, match=r"^model\.path='"):
        load_reward_model(str(tmp_path), key="model.path")


def test_an_unreadable_config_json_is_a_model_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError) as err:
        load_value_model(str(tmp_path))
    assert str(err.value).startswith(f"critic.model_path='{tmp_path}': cannot read its config.json")
