"""Model loading: resolve ``model.path`` (folder, .gguf, alias) to a Hugging Face folder and load it."""

from rlray.models.loading import (
    ALIASES,
    CHAT_TEMPLATES,
    ModelError,
    cache_dir,
    cpu_supports_bf16,
    hub_local_path,
    load_causal_lm,
    load_tokenizer,
    resolve_chat_template,
    resolve_dtype,
    resolve_model_path,
    vocabulary,
)

__all__ = [
    "ALIASES",
    "CHAT_TEMPLATES",
    "ModelError",
    "cache_dir",
    "cpu_supports_bf16",
    "hub_local_path",
    "load_causal_lm",
    "load_tokenizer",
    "resolve_dtype",
    "resolve_chat_template",
    "resolve_model_path",
    "vocabulary",
]
