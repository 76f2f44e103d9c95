"""Hugging Face Hub ids as model paths (``rlray.models.loading.hub_snapshot``), offline: a Hugging Face cache laid
out as ``huggingface_hub`` lays it (blobs named by content hash, a snapshot folder of links to them per commit, a
ref naming the commit), holding the 'tiny-random' model under an org/name id. Nothing here reaches the Hub."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import httpx
import huggingface_hub
import pytest
from huggingface_hub import errors as hub

from rlray.models import ModelError, load_causal_lm, loading, resolve_model_path

REPO_ID = "rlray-test/tiny-random"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_hub_cache(cache: Path, source: str, repo_id: str = REPO_ID, commit: str = COMMIT,
                      ref: str = "main", skip: tuple[str, ...] = ()) -> Path:
    """Writes ``source``'s files (a model folder) into ``cache`` as the snapshot ``commit`` of ``repo_id``, with
    ``refs/<ref>`` naming it; returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(source).iterdir()):
        if f.is_file() and f.name not in skip:
            blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copyfile(f, blob)
            (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_model_path) -> Path:
    """An offline Hugging Face cache holding tiny-random as ``REPO_ID``; returns the cache folder."""
    cache = tmp_path / "hf-cache"
    lay_out_hub_cache(cache, tiny_model_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_id_resolves_to_its_cached_snapshot_and_loads(hub_cache, tiny_model_path):
    folder = resolve_model_path(REPO_ID)
    assert Path(folder) == hub_cache / "models--rlray-test--tiny-random" / "snapshots" / COMMIT
    assert resolve_model_path(REPO_ID, revision=COMMIT) == folder  # a commit pins the same snapshot
    got, want = load_causal_lm(folder), load_causal_lm(tiny_model_path)
    assert all(bool((got.state_dict()[k] == v).all()) for k, v in want.state_dict().items())


def test_offline_without_the_model_in_the_cache_says_so(hub_cache):
    with pytest.raises(ModelError, match=r"model.path='rlray-test/other': HF_HUB_OFFLINE=1 and the model is not in "
                                         r"the Hugging Face cache .*hf download rlray-test/other"):
        resolve_model_path("rlray-test/other")
    with pytest.raises(ModelError, match=r"teacher.path='rlray-test/tiny-random' \(revision 'v2'\): HF_HUB_OFFLINE"):
        resolve_model_path(REPO_ID, revision="v2", key="teacher.path")


def test_a_snapshot_without_safetensors_weights_is_refused(hub_cache, tiny_model_path):
    lay_out_hub_cache(hub_cache, tiny_model_path, repo_id="rlray-test/pickled", skip=("model.safetensors",))
    with pytest.raises(ModelError, match=r"no \*.safetensors weights \(rlray loads weights through safetensors only"):
        resolve_model_path("rlray-test/pickled")


@pytest.mark.parametrize(("error", "token", "message"), [
    (hub.GatedRepoError, True, r"is a gated repository: accept its terms on the Hugging Face Hub, and HF_TOKEN is set"),
    # an unknown id and a private one answer alike (the Hub does not say which): with a token that cannot read it ...
    (hub.RepositoryNotFoundError, True, r"model.path='org/private-model' was not found on the Hugging Face Hub, or it "
                                        r"is private: check the id, or HF_TOKEN is set but cannot read it"),
    # ... and without a token
    (hub.RepositoryNotFoundError, False, r"model.path='org/private-model' was not found on the Hugging Face Hub, or "
                                         r"it is private: check the id, or set HF_TOKEN to a token that can read it"),
    (hub.GatedRepoError, False, r"is a gated repository: .* and set HF_TOKEN to a token that can read it"),
    (hub.RevisionNotFoundError, True, r"no branch, tag or commit 'None' in this repository"),
])
def test_hub_errors_name_the_key_and_the_fix_and_never_the_token(monkeypatch, error, token, message):
    def refuse(*args, **kwargs):  # what the Hub's answer raises (a local response: nothing is sent)
        raise error("refused", response=httpx.Response(404, request=httpx.Request("GET", "http://127.0.0.1/")))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    if token:
        monkeypatch.setenv("HF_TOKEN", "hf_secret_value_never_shown")
    else:
        monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ModelError, match=message) as info:
        resolve_model_path("org/private-model")
    assert "hf_secret_value_never_shown" not in str(info.value)


def test_hub_local_path_pins_hub_ids_only(hub_cache, tiny_model_path, tmp_path, monkeypatch):
    snapshot = str(hub_cache / "models--rlray-test--tiny-random" / "snapshots" / COMMIT)
    assert loading.hub_local_path(REPO_ID, revision="main") == snapshot
    for value in ("tiny-random", "tiny-random@3", tiny_model_path, "org/model.gguf"):
        assert loading.hub_local_path(value) == value  # aliases, folders and .gguf files are left as they are
    local = tmp_path / "org" / "name"  # a relative folder that looks like an id is a folder
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert loading.hub_local_path("org/name") == "org/name"


def test_an_adapter_hub_id_needs_adapter_config(hub_cache, tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    lay_out_hub_cache(hub_cache, str(adapter), repo_id="rlray-test/lora")
    folder = loading.hub_local_path("rlray-test/lora", key="model.adapter_path", adapter=True)
    assert Path(folder, "adapter_config.json").is_file()
    with pytest.raises(ModelError, match=r"model.adapter_path='rlray-test/tiny-random': the snapshot has no "
                                         r"adapter_config.json, so it is not a PEFT adapter"):
        loading.hub_local_path(REPO_ID, key="model.adapter_path", adapter=True)


def test_values_that_are_not_hub_ids_keep_their_own_errors(tmp_path):
    assert loading.HUB_ID.fullmatch("Qwen/Qwen2.5-0.5B-Instruct")
    assert not loading.HUB_ID.fullmatch("a/b/c") and not loading.HUB_ID.fullmatch("no-slash")
    with pytest.raises(ModelError, match="is not an existing folder, a .gguf file, a Hugging Face Hub id"):
        resolve_model_path(str(tmp_path / "missing" / "deeper"))
    with pytest.raises(ModelError, match="GGUF file not found"):
        resolve_model_path("org/model.gguf")
