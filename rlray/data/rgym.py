"""reasoning-gym tasks as prompt rows: a ``reasoning-gym:`` source in ``data.train_files`` / ``data.eval_files``.

reasoning-gym (PyPI ``reasoning-gym``, https://github.com/open-thought/reasoning-gym) is a library of procedural
generators, each with its own ``score_answer``. A source names one generator, or a weighted mix, with its size,
seed, split and generator options::

    reasoning-gym:leg_counting?size=500&seed=1
    reasoning-gym:leg_counting?size=100&seed=1&split=heldout&max_animals=3
    reasoning-gym:leg_counting:3,basic_arithmetic:1?size=1000&seed=2&basic_arithmetic.max_terms=3

- ``name`` or ``name:weight,name:weight,...``: a generator (any name of ``reasoning_gym.factory.DATASETS`` but
  ``composite``), or a mix: each item's generator is drawn with probability weight / sum of weights (reasoning-gym's
  own ``CompositeDataset`` draws it, ``random.Random(seed + index).choices``).
- ``size`` (default 500, reasoning-gym's default): the number of rows; ``seed`` (default 0): which items.
- ``split``: ``train`` (the default) or ``heldout`` (also ``calibration``, for choosing a task before training).
- any other ``key=value`` is an option of the generator's config dataclass (``name.key=value`` in a mix); values
  are read as YAML scalars (``3``, ``0.5``, ``true``, ``[1, 2]``).

Held-out items never equal training items, whatever the seeds and sizes: an item's split is a function of its
question text alone (``rlray.data.generate.split_of``: sha256 of the question mod 100 gives train for 0-79,
calibration for 80-89, heldout for 90-99), so two items with the same question fall in the same split. The rows of
a split are the first ``size`` distinct questions of that split in the generator's index order 0, 1, 2, ... under
the library seed ``seed * SEED_STRIDE`` (reasoning-gym seeds item ``i`` with ``Random(seed + i)``, so neighbouring
library seeds would share almost every item; the stride keeps the streams of rlray's seeds apart). A split smaller
than ``size`` (a generator with few distinct questions) is an error after ``MAX_DRAWS_PER_ROW * size`` draws.

Each row: the question is the prompt (under ``data.prompt_column``, whatever its name), ``id`` is
``rg:<generator>:<split>:<seed>:<index>``, ``answer`` is the item's oracle answer (a string, or None for tasks with
many right answers), and ``reasoning_gym`` is ``{"dataset": generator, "config": {the options given}, "metadata":
repr(item metadata)}``. The metadata rides as a Python literal (``ast.literal_eval`` gives it back exactly) because
JSON would turn its tuples into lists and its integer keys into strings, and some generators' ``score_answer``
compare against them (arc_agi's grids are tuples of tuples). The built-in reward ``reasoning_gym``
(``rlray.reward.rgym``) rebuilds the entry from these columns and calls the generator's ``score_answer``.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib
from dataclasses import fields
from typing import Any
from urllib.parse import parse_qsl

import yaml

from rlray.data.generate import SPLITS, split_of
from rlray.data.jsonl import DataError

PREFIX = "reasoning-gym:"
SEED_STRIDE = 2**20  # library seed = seed * SEED_STRIDE: rlray seeds' index streams never meet below 2**20 draws
MAX_DRAWS_PER_ROW = 50  # draws per row asked before a split is declared too small (10% of questions are heldout)
DEFAULT_SIZE = 500


def is_reasoning_gym(source: str) -> bool:
    """Returns True when a data source names reasoning-gym generators (``reasoning-gym:...``)."""
    return source.startswith(PREFIX)


def generator_names() -> list[str]:
    """Returns every generator name of the installed reasoning-gym, sorted (``composite`` excluded: use a mix).

    Raises:
        DataError: reasoning-gym is not installed (names the extra that installs it).
    """
    return sorted(n for n in _library().factory.DATASETS if n != "composite")


@functools.lru_cache(maxsize=32)
def reasoning_gym_records(source: str, prompt_column: str) -> tuple[tuple[str, dict[str, Any]], ...]:
    """Returns (where, record) for each row of a ``reasoning-gym:`` source (module docstring), as a prompt file's rows.

    Cached per (source, prompt_column): a run loads its data files in several places (preflight, the driver, the
    lead), and generation is deterministic. Treat the records as read-only.

    Args:
        source: the source string, e.g. ``"reasoning-gym:leg_counting?size=100&seed=1&split=heldout"``.
        prompt_column: ``data.prompt_column``: the key the question goes under.

    Raises:
        DataError: reasoning-gym missing; a malformed source; an unknown generator (the message lists the close
            names, ``difflib``), option, split or parameter; a generator config that reasoning-gym rejects; or a
            split with fewer distinct questions than ``size``. Each names the source.
    """
    names, weights, params, options = _parse(source)
    size, seed, split = params["size"], params["seed"], params["split"]
    dataset = _dataset(source, names, weights, options, seed * SEED_STRIDE, size * MAX_DRAWS_PER_ROW)
    records: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    for index in range(size * MAX_DRAWS_PER_ROW):
        item = dataset[index]
        question = item["question"]
        if question in seen or split_of(question) != split:
            continue
        seen.add(question)
        name = item["metadata"].get("source_dataset", names[0])
        record = {"id": f"rg:{name}:{split}:{seed}:{index}", prompt_column: question, "answer": item["answer"],
                  "reasoning_gym": {"dataset": name, "config": options.get(name, {}),
                                    "metadata": literal_metadata(source, item["metadata"])}}
        records.append((f"{source} item {index}", record))
        if len(records) == size:
            return tuple(records)
    raise DataError(
        f"{source}: only {len(records)} distinct questions of split '{split}' in {size * MAX_DRAWS_PER_ROW} draws, "
        f"fewer than size={size}; lower size or widen the generator's options"
    )


def literal_metadata(source: str, metadata: dict[str, Any]) -> str:
    """Returns ``repr`` of an item's metadata after checking that ``ast.literal_eval`` gives it back equal.

    numpy scalars (``np.str_``, ``np.int64``) become the Python values they equal first.

    Raises:
        DataError: the metadata holds a value that is not a Python literal (names the source).
    """
    plain = _plain(metadata)
    text = repr(plain)
    try:
        back = ast.literal_eval(text)
    except (ValueError, SyntaxError) as err:
        raise DataError(f"{source}: an item's metadata is not a Python literal ({err}): {text[:120]}") from None
    if back != plain:
        raise DataError(f"{source}: an item's metadata does not survive repr/literal_eval: {text[:120]}")
    return text


def _plain(value: Any) -> Any:
    """Returns ``value`` with numpy scalars replaced by the Python scalars they equal, containers kept as they are."""
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return value.item()
    return value


def _parse(source: str) -> tuple[list[str], list[float], dict[str, Any], dict[str, dict[str, Any]]]:
    """Returns (generator names, weights, {size, seed, split}, {generator: options}) of a source string."""
    spec, _, query = source[len(PREFIX):].partition("?")
    if not spec:
        raise DataError(f"{source}: name a generator, e.g. '{PREFIX}leg_counting?size=500&seed=0'")
    known = generator_names()
    names, weights = [], []
    for part in spec.split(","):
        name, _, weight = part.strip().partition(":")
        if name not in known:
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
            hint = f"close matches: {', '.join(close)}" if close else f"{len(known)} generators: {', '.join(known)}"
            raise DataError(f"{source}: reasoning-gym has no generator '{name}'; {hint}")
        try:
            weights.append(float(weight) if weight else 1.0)
        except ValueError:
            raise DataError(f"{source}: weight '{weight}' of '{name}' is not a number") from None
        if weights[-1] <= 0:
            raise DataError(f"{source}: weight of '{name}' must be > 0, got {weights[-1]}")
        if name in names:
            raise DataError(f"{source}: '{name}' appears twice in the mix")
        names.append(name)
    params: dict[str, Any] = {"size": DEFAULT_SIZE, "seed": 0, "split": "train"}
    options: dict[str, dict[str, Any]] = {}
    # a '+' is the option's own character ("chain_sum.operators=['+','-']"), never a space as in a form's query
    for key, text in parse_qsl(query.replace("+", "%2B"), keep_blank_values=True, strict_parsing=bool(query)):
        value = yaml.safe_load(text) if text else text
        if key in params:
            params[key] = _param(source, key, value)
            continue
        owner, dot, option = key.partition(".")
        owner, option = (owner, option) if dot else (names[0], key)
        if not dot and len(names) > 1:
            raise DataError(f"{source}: option '{key}' in a mix must name its generator ('<generator>.{key}')")
        if owner not in names:
            raise DataError(f"{source}: option '{key}' names '{owner}', which is not in the mix {names}")
        options.setdefault(owner, {})[option] = value
    for name, given in options.items():
        _check_options(source, name, given)
    return names, weights, params, options


def _param(source: str, key: str, value: Any) -> Any:
    """Returns a checked value of size (int >= 1), seed (int >= 0) or split (a name of ``SPLITS``)."""
    if key == "split":
        if value not in SPLITS:
            raise DataError(f"{source}: split '{value}' is not one of {list(SPLITS)}")
        return value
    low = 1 if key == "size" else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise DataError(f"{source}: {key}={value!r} must be an integer >= {low}")
    return value


def _check_options(source: str, name: str, given: dict[str, Any]) -> None:
    """Checks that each option is a field of the generator's config dataclass (not seed or size, which rlray sets)."""
    _, config_cls = _library().factory.DATASETS[name]
    allowed = sorted(f.name for f in fields(config_cls) if f.name not in ("seed", "size"))
    for key in given:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise DataError(f"{source}: '{key}' is not an option of generator '{name}'; {hint}options: {allowed}")


def _dataset(source: str, names: list[str], weights: list[float], options: dict[str, dict[str, Any]], seed: int,
             size: int) -> Any:
    """Returns the reasoning-gym dataset of a source: one generator, or a ``CompositeDataset`` for a mix."""
    rg = _library()
    try:
        if len(names) == 1:
            return rg.create_dataset(names[0], **options.get(names[0], {}), seed=seed, size=size)
        specs = [rg.composite.DatasetSpec(name=n, weight=w, config=dict(options.get(n, {})))
                 for n, w in zip(names, weights, strict=True)]
        return rg.create_dataset("composite", datasets=specs, seed=seed, size=size)
    except (AssertionError, ValueError, TypeError) as err:  # reasoning-gym validates configs with assert
        raise DataError(f"{source}: reasoning-gym rejects the generator config: {type(err).__name__}: {err}") from None


def _library() -> Any:
    """Returns the imported ``reasoning_gym`` package (imported on first use: it takes ~3 s).

    Raises:
        DataError: it is not installed.
    """
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError as err:
        raise DataError(f"reasoning-gym sources need the reasoning-gym package ({err}); pip install "
                        "'rlray[reasoning-gym]' (make install does)") from None
