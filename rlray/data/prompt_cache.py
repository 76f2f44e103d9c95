"""Prompt token ids kept on disk between runs: tokenizing every rendered prompt of a data set costs seconds (GSM8K's
7,473 chat-templated prompts: 1.5 s of CPU with SmolLM2's fast tokenizer, measured on a 2-core AMD EPYC), and an
online run does it on learner rank 0 before its first step, at every start (issue 39).

An entry is keyed by the SHA-256 of the tokenizer (its class, its ``tokenizers`` and ``transformers`` versions and
its whole serialized fast tokenizer: vocabulary, merges, normalizer, pre-tokenizer, added tokens) and of every
rendered prompt text in order. The text already holds the chat template, the instruction, the system prompt and the
rows, so a change to any of them, or to the tokenizer, is another key: a stale entry is never read. Slow (Python)
tokenizers have no serialized form and are not cached.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

KEEP_ENTRIES = 16  # entries kept per folder, newest first (an entry of GSM8K's train set is ~6 MB)


def tokenizer_fingerprint(tokenizer: Any) -> str | None:
    """Returns the SHA-256 hex digest that identifies how ``tokenizer`` turns text into ids, or None for a tokenizer
    without a serialized fast form (``backend_tokenizer``), which ``tokenize_cached`` never caches."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    import tokenizers
    import transformers

    digest = hashlib.sha256()
    for part in (type(tokenizer).__name__, tokenizers.__version__, transformers.__version__, backend.to_str()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def cache_key(tokenizer_digest: str, texts: list[str]) -> str:
    """Returns the entry name of ``texts`` tokenized by the tokenizer of ``tokenizer_digest`` (hex SHA-256)."""
    digest = hashlib.sha256(tokenizer_digest.encode())
    for text in texts:
        digest.update(text.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def tokenize_cached(tokenizer: Any, texts: list[str], folder: Path | None) -> list[list[int]]:
    """Returns the token ids of each text (``tokenizer(text, add_special_tokens=False)``), read from ``folder`` when
    an earlier call stored them there, else computed and stored (written atomically; the folder keeps its
    ``KEEP_ENTRIES`` newest entries).

    Args:
        tokenizer: a transformers tokenizer.
        texts: the rendered prompts (``rlray.data.prompts.prompt_text``).
        folder: the cache folder (``rlray.cache.cache_dir() / "prompts"``), or None to compute without a cache.

    An entry that cannot be read (a partial copy, another format) is computed again and replaced; a folder that
    cannot be written is logged and skipped: the cache never fails a run.
    """
    digest = tokenizer_fingerprint(tokenizer) if folder is not None and texts else None
    if digest is None:
        return [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    path = Path(folder, f"{cache_key(digest, texts)}.npz")
    ids = _read(path, len(texts))
    if ids is not None:
        return ids
    ids = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    _write(path, ids)
    return ids


def _read(path: Path, count: int) -> list[list[int]] | None:
    """Returns the ids stored at ``path`` when it holds ``count`` prompts, else None."""
    try:
        with np.load(path) as entry:
            flat, lengths = entry["ids"], entry["lengths"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as err:  # a damaged entry: computed again and replaced
        log.warning("prompt token cache %s is unreadable (%s); tokenizing again", path, err)
        return None
    if len(lengths) != count or int(lengths.sum()) != len(flat):
        return None
    os.utime(path)  # the newest entries are kept
    return [part.tolist() for part in np.split(flat, np.cumsum(lengths)[:-1])]


def _write(path: Path, ids: list[list[int]]) -> None:
    """Stores ``ids`` at ``path`` (a temporary file renamed into place), then removes all but the newest entries."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        flat = np.fromiter((t for one in ids for t in one), dtype=np.int32)  # vocabularies are far below 2**31
        lengths = np.array([len(one) for one in ids], dtype=np.int64)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                np.savez(out, ids=flat, lengths=lengths)
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)  # gone after the rename; removes a partial file otherwise
        entries = sorted(path.parent.glob("*.npz"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[KEEP_ENTRIES:]:
            old.unlink(missing_ok=True)
    except OSError as err:
        log.warning("prompt token cache %s not written (%s)", path, err)
