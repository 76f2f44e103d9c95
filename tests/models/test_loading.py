"""Tests for rlray.models.loading: aliases, the tiny random model, tokenizer rules, atomic builds."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlray.models import loading
from rlray.models.loading import ModelError, load_causal_lm, load_tokenizer, resolve_model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tokenizer_copy(src: str, dst: Path, *, chat_template: bool, pad: bool) -> str:
    """Copies the tokenizer files of ``src`` to ``dst``, optionally without chat template or pad token."""
    dst.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(Path(src) / name, dst / name)
    if not chat_template:
        (dst / "chat_template.jinja").unlink()
    if not pad:
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        cfg.pop("pad_token")
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_cache_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("RLRAY_CACHE", str(tmp_path / "c"))
    assert loading.cache_dir() == tmp_path / "c"
    assert (tmp_path / "c").is_dir()


def test_tiny_random_is_bit_identical_on_rebuild(tmp_path, monkeypatch, tiny_model_path):
    monkeypatch.setenv("RLRAY_CACHE", str(tmp_path))
    rebuilt = Path(resolve_model_path("tiny-random"))
    assert rebuilt == tmp_path / "models" / "tiny-random"
    assert rebuilt != Path(tiny_model_path)
    first = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    second = load_file(str(rebuilt / "model.safetensors"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert _sha256(Path(tiny_model_path) / name) == _sha256(rebuilt / name)


def test_tiny_random_shape_dtype_and_tokenizer(tiny_model_path):
    config = json.loads((Path(tiny_model_path) / "config.json").read_text())
    tokenizer = load_tokenizer(tiny_model_path)
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (128, 2, 32)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["vocab_size"] == len(tokenizer) == 49152
    assert config["tie_word_embeddings"] is True
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == config["eos_token_id"]
    weights = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.float32}
    model = load_causal_lm(tiny_model_path)
    assert model.dtype == torch.float32 and not model.training
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 49152) and torch.isfinite(logits).all()


def test_load_causal_lm_dtype(tiny_model_path):
    model = load_causal_lm(tiny_model_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_existing_folder_is_returned_as_is(tiny_model_path):
    assert resolve_model_path(tiny_model_path) == tiny_model_path


def test_unknown_path_names_the_key_and_aliases():
    # (an org/name value is a Hub id: tests/models/test_hub.py)
    with pytest.raises(ModelError) as err:
        resolve_model_path("not-here")
    message = str(err.value)
    assert "model.path='not-here'" in message
    assert "'smollm2-135m-instruct'" in message and "'tiny-random'" in message


def test_folder_without_config_and_missing_gguf(tmp_path):
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ModelError, match="GGUF file not found"):
        resolve_model_path(str(tmp_path / "absent.gguf"))


def test_load_causal_lm_needs_safetensors(tmp_path, tiny_model_path):
    shutil.copy(Path(tiny_model_path) / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelError, match="cannot load a causal LM from safetensors"):
        load_causal_lm(str(tmp_path))


def test_tokenizer_without_chat_template(tmp_path, tiny_model_path):
    folder = _tokenizer_copy(tiny_model_path, tmp_path / "tok", chat_template=False, pad=True)
    with pytest.raises(ModelError, match="set model.chat_template"):
        load_tokenizer(folder)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    tokenizer = load_tokenizer(folder, chat_template=template)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "[user] hi\n"


def test_tokenizer_pad_falls_back_to_eos(tmp_path, tiny_model_path):
    folder = _tokenizer_copy(tiny_model_path, tmp_path / "tok", chat_template=True, pad=False)
    tokenizer = load_tokenizer(folder)
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"


def test_failed_build_leaves_nothing_and_retry_works(tmp_path, monkeypatch):
    monkeypatch.setenv("RLRAY_CACHE", str(tmp_path))

    def crash(out: Path) -> None:
        (out / "config.json").write_text("{}")  # half written, then the crash
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError, match="killed mid-build"):
        loading._build_once("demo", crash)
    models = tmp_path / "models"
    assert not (models / "demo").exists()
    assert [p.name for p in models.iterdir() if "tmp" in p.name] == []
    built = loading._build_once("demo", lambda out: (out / "config.json").write_text('{"ok": 1}'))
    assert json.loads((built / "config.json").read_text()) == {"ok": 1}
    assert loading._build_once("demo", crash) == built  # done folders are reused, the builder is not called


def test_gguf_path_is_cached_by_file_identity(tmp_path, monkeypatch):
    monkeypatch.setenv("RLRAY_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_convert(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        (out / "config.json").write_text(json.dumps({"from": gguf.name}))

    monkeypatch.setattr(loading, "_convert_gguf", fake_convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    first = resolve_model_path(str(gguf))
    assert resolve_model_path(str(gguf)) == first and len(calls) == 1
    os.utime(gguf, ns=(1_000_000_000, 1_000_000_000))  # the file changed: convert again, into a new folder
    second = resolve_model_path(str(gguf))
    assert second != first and len(calls) == 2
    assert Path(first).name.startswith("gguf-m-")


@pytest.mark.slow
def test_smollm2_alias_converts_and_generates(tmp_path, monkeypatch):
    monkeypatch.setenv("RLRAY_CACHE", str(tmp_path))
    folder = resolve_model_path("smollm2-135m-instruct")
    config = json.loads((Path(folder) / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (576, 30, 64)
    assert "quantization_config" not in config
    weights = load_file(str(Path(folder) / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    tokenizer = load_tokenizer(folder)
    model = load_causal_lm(folder)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])


def test_model_dtype_auto_is_bf16_only_where_bf16_is_native(monkeypatch):
    from rlray.models import loading

    assert loading.resolve_dtype("auto", gpu=True) == "bfloat16"
    assert loading.resolve_dtype("float32", gpu=True) == "float32" and loading.resolve_dtype("bfloat16", gpu=False) == "bfloat16"
    monkeypatch.setattr(loading, "cpu_supports_bf16", lambda: False)
    assert loading.resolve_dtype("auto", gpu=False) == "float32"
    monkeypatch.setattr(loading, "cpu_supports_bf16", lambda: True)
    assert loading.resolve_dtype("auto", gpu=False) == "bfloat16"
    with pytest.raises(ValueError, match="model.dtype='float16': use auto, float32 or bfloat16"):
        loading.resolve_dtype("float16", gpu=False)


def test_tiny_random_seed_suffix_builds_a_differently_seeded_twin(tmp_path, monkeypatch, tiny_model_path):
    # a distillation teacher for tests: same architecture and tokenizer (vocabulary), other weights
    monkeypatch.setenv("RLRAY_CACHE", str(tmp_path))
    twin = Path(resolve_model_path("tiny-random@1"))
    assert twin == tmp_path / "models" / "tiny-random-seed1"
    first = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    second = load_file(str(twin / "model.safetensors"))
    assert first.keys() == second.keys() and all(first[k].shape == second[k].shape for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], second["model.embed_tokens.weight"])
    assert _sha256(Path(tiny_model_path) / "tokenizer.json") == _sha256(twin / "tokenizer.json")
    assert loading.tiny_random_seed("tiny-random") == 0 and loading.tiny_random_seed("tiny-random@12") == 12
    with pytest.raises(ModelError, match="'tiny-random@x': write 'tiny-random' or 'tiny-random@N'"):
        resolve_model_path("tiny-random@x")
