"""rlray.reward.reward_model: the reward-model term on the tiny random Llama (a fresh one-label head)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from rlray.checkpoint.storage import SnapshotError, write_snapshot
from rlray.models import ModelError
from rlray.models.heads import sequence_scores
from rlray.reward.reward_model import RewardModel, reward_model_dir
from rlray.schema import pack_sequences

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from snapshot_manifests import manifest  # noqa: E402

PROMPTS = ["What is 2 + 3?", "Name a colour.", "Count to three.", "Say hi."]
COMPLETIONS = ["5", "Blue, like the sky over the sea.", "one two three", ""]


@pytest.fixture(scope="module")
def reward(tiny_model_path):
    torch.manual_seed(0)
    return RewardModel(tiny_model_path, batch_size=3, max_prompt_tokens=512, max_completion_tokens=512)


def test_plain_folder_is_used_as_is(tiny_model_path):
    assert reward_model_dir(tiny_model_path) == tiny_model_path


def test_missing_folder_names_the_key(tmp_path):
    path = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=f"reward.model_path='{path}' is not a folder or snapshot URI"):
        reward_model_dir(path)


def test_snapshot_folder_resolves_to_its_model_folder(tmp_path):
    payload = tmp_path / "payload"
    (payload / "model").mkdir(parents=True)
    (payload / "model" / "config.json").write_text("{}")
    snap = tmp_path / "snap"
    write_snapshot(str(snap), payload, manifest(1))
    assert reward_model_dir(str(snap)) == str(snap / "model")


def test_snapshot_uri_without_manifest_is_refused(tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(SnapshotError, match="manifest.json is missing"):
        reward_model_dir(f"file://{tmp_path}")


def test_token_ids_follow_the_training_layout(reward):
    tok = reward.tokenizer
    prompt_ids, completion_ids = reward.token_ids("Say hi.", "hello")
    text = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=False)
    assert prompt_ids == tok(text, add_special_tokens=False)["input_ids"]
    assert completion_ids == tok("hello", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert reward.token_ids("x", "")[1] == [tok.eos_token_id]  # an empty completion is EOS alone


def test_conversational_prompts_go_through_the_template_as_they_are(reward):
    tok = reward.tokenizer
    assert reward.token_ids([{"role": "user", "content": "Say hi."}], "hello") == reward.token_ids("Say hi.", "hello")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    prompt_ids, completion_ids = reward.token_ids(chat, "hello")
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert prompt_ids == tok(text, add_special_tokens=False)["input_ids"]
    assert "Be brief." in tok.decode(prompt_ids) and completion_ids == reward.token_ids("Say hi.", "hello")[1]


def test_token_ids_keep_the_prompt_end_and_the_completion_start(reward, monkeypatch):
    full_prompt, full_completion = reward.token_ids("Count to three.", "one two three four five")
    monkeypatch.setattr(reward, "max_prompt_tokens", 4)
    monkeypatch.setattr(reward, "max_completion_tokens", 2)
    prompt_ids, completion_ids = reward.token_ids("Count to three.", "one two three four five")
    assert prompt_ids == full_prompt[-4:]  # the generation prompt stays
    assert completion_ids == full_completion[:2]  # EOS falls off a cut completion


@torch.no_grad()
def test_scores_equal_the_head_on_each_pair(reward):
    scores = reward.score(PROMPTS, COMPLETIONS)
    assert len(scores) == 4 and all(isinstance(s, float) for s in scores)
    for p, c, s in zip(PROMPTS, COMPLETIONS, scores, strict=True):
        prompt_ids, completion_ids = reward.token_ids(p, c)
        alone = sequence_scores(reward.model, pack_sequences([prompt_ids], [completion_ids], reward.tokenizer.pad_token_id))
        assert s == pytest.approx(alone.item(), abs=1e-5)
    assert len(set(round(s, 4) for s in scores)) == 4  # a fresh random head still tells the pairs apart


@torch.no_grad()
def test_scores_do_not_depend_on_batch_size_or_order(reward, monkeypatch):
    base = reward.score(PROMPTS, COMPLETIONS)  # batch_size 3: batches of 3 and 1
    monkeypatch.setattr(reward, "batch_size", 1)
    assert reward.score(PROMPTS, COMPLETIONS) == pytest.approx(base, abs=1e-5)
    monkeypatch.setattr(reward, "batch_size", 8)
    assert reward.score(PROMPTS[::-1], COMPLETIONS[::-1]) == pytest.approx(base[::-1], abs=1e-5)
    assert reward.score([], []) == []


def test_model_is_in_eval_mode(reward):
    assert not reward.model.training


def test_unusable_folder_is_refused(tmp_path, tiny_model_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):  # no weights
        shutil.copy(Path(tiny_model_path) / name, tmp_path / name)
    with pytest.raises(ModelError, match="cannot load a AutoModelForSequenceClassification with one label"):
        RewardModel(str(tmp_path))
