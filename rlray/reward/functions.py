"""TRL's reward-function convention: load a function, check its signature, call it, check what it returns.

For a batch of B samples a reward function is called once as (``GRPOTrainer._calculate_rewards`` in TRL)

    fn(prompts=[...], completions=[...], completion_ids=[...], <column>=[...] for every dataset column, **kwargs)

- ``prompts[i]``: the prompt as the dataset has it, a string or a list of ``{"role", "content"}`` messages;
- ``completions[i]``: the decoded text, or, when that sample's prompt is conversational, TRL's conversational
  completion ``[{"role": "assistant", "content": text}]``;
- ``completion_ids[i]``: the completion's token ids (None when the caller has none);
- one keyword per dataset column other than the prompt, a list of B values as in the file (any JSON type;
  None where a row lacks the column): every column any row has, plus every column the scorer was told of
  (``column_values``);
- ``kwargs``: the entry's ``reward.functions[i].kwargs``, bound to the function; they win over a column of
  the same name.

A function without ``**kwargs`` gets only the keyword arguments it names (TRL would raise TypeError). It
returns B values, each a real number or None (the term does not apply to that sample); an ``async def``
function, or one that returns an awaitable, is run to completion with ``asyncio.run``. TRL also passes
``trainer_state``, ``log_extra`` and ``log_metric``; rlray does not (a function needing them must give them
defaults).

``BoundFunction.check`` checks a signature once, when the scorer is built (for a user function inside its
sandbox process, where it is loaded): a parameter without a default must be prompts, completions,
completion_ids, a key of the entry's kwargs or, when the dataset's columns are known, a dataset column.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlray.reward.verifiers import BUILTIN_VERIFIERS

STANDARD_ARGS = ("prompts", "completions", "completion_ids")
_KW = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class RewardFunctionError(ValueError):
    """A reward function that cannot be loaded or returned unusable values; names the entry."""


def load_reward_function(spec: str) -> Callable[..., Any]:
    """Returns the callable named by ``"module.path:function"`` or ``"file.py:function"``.

    Raises:
        RewardFunctionError: malformed spec, missing module/file, or missing or non-callable attribute.
    """
    if ":" not in spec:
        raise RewardFunctionError(f"reward function '{spec}' must be 'module.path:function' or 'file.py:function'")
    target, name = spec.rsplit(":", 1)
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            if not path.is_file():
                raise RewardFunctionError(f"reward function '{spec}': file {path} does not exist")
            mod_spec = importlib.util.spec_from_file_location(f"rlray_user_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ImportError as err:
        raise RewardFunctionError(f"reward function '{spec}': cannot import '{target}': {err}") from err
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardFunctionError(f"reward function '{spec}': '{target}' has no callable '{name}'")
    return fn


@dataclass(frozen=True)
class BoundFunction:
    """A reward function with its entry's kwargs bound, called in TRL's convention (module docstring).

    Attributes:
        fn: the function.
        kwargs: the entry's kwargs, passed on every call.
        accepted: the keyword names it takes, or None when it has ``**kwargs`` (it gets everything).
    """

    fn: Callable[..., Any]
    kwargs: dict[str, Any]
    accepted: frozenset[str] | None

    @classmethod
    def check(cls, fn: Callable[..., Any], label: str, kwargs: dict[str, Any], columns: Sequence[str] | None, *,
              named_kwargs_only: bool = False) -> BoundFunction:  # fmt: skip
        """Returns ``fn`` bound to ``kwargs`` once its signature fits (module docstring).

        ``named_kwargs_only`` (the built-ins, whose ``**columns`` is for dataset columns only) also refuses a
        kwargs key that is not a named parameter, so a typo such as ``colum`` is not swallowed.

        Raises:
            RewardFunctionError: a kwargs key it does not take or that shadows prompts/completions/completion_ids,
                a positional-only parameter, or a parameter without a default that nothing provides; names
                ``label``, the parameter and the available columns.
        """
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # no signature to read (some C callables): give it everything
            return cls(fn, dict(kwargs), None)
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        names = frozenset(p.name for p in params if p.kind in _KW)
        for key in kwargs:
            if key in STANDARD_ARGS or ((named_kwargs_only or not takes_all) and key not in names):
                raise RewardFunctionError(f"{label}: kwargs key '{key}' is {'reserved' if key in STANDARD_ARGS else 'not one of its parameters'} "
                                          f"(parameters: {sorted(names)})")  # fmt: skip
        known = {*STANDARD_ARGS, *kwargs, *(columns or ())}
        for p in params:
            if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is p.empty:
                raise RewardFunctionError(f"{label}: parameter '{p.name}' is positional-only; reward functions are "
                                          "called with keyword arguments")  # fmt: skip
            if p.kind in _KW and p.default is p.empty and p.name not in known and columns is not None:
                raise RewardFunctionError(
                    f"{label}: parameter '{p.name}' has no default and is not prompts, completions, completion_ids, a "
                    f"key of its kwargs or a dataset column (columns: {sorted(columns)}); give it a default, set it "
                    "in the entry's kwargs, or use a dataset with that column"
                )
        return cls(fn, dict(kwargs), None if takes_all else names)

    def __call__(self, prompts: list, completions: list, completion_ids: list | None, columns: dict[str, list]) -> Any:
        """Returns the function's result for one batch (a list when it is iterable); awaits an awaitable."""
        args = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
        args = {k: v for k, v in args.items() if k not in self.kwargs and (self.accepted is None or k in self.accepted)}
        values = self.fn(**args, **self.kwargs)
        if inspect.isawaitable(values):
            values = asyncio.run(_awaited(values))
        if isinstance(values, (str, bytes, dict)):
            return values
        try:
            return list(values)  # a generator or an array crosses the pipe as a list
        except TypeError:
            return values  # rejected by check_values


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def load_bound_function(spec: str, label: str, kwargs: dict[str, Any], columns: list[str] | None) -> BoundFunction:
    """Returns the function of ``spec`` bound to ``kwargs``: a user function's sandbox factory (runs in the child).

    Raises:
        RewardFunctionError: it cannot be loaded or its signature does not fit; names ``label``.
    """
    try:
        fn = load_reward_function(spec)
    except RewardFunctionError as err:
        raise RewardFunctionError(f"{label}: {err} (built-in verifiers: {', '.join(BUILTIN_VERIFIERS)})") from None
    return BoundFunction.check(fn, label, kwargs, columns)


def check_values(label: str, values: object, expected: int) -> list[float | None]:
    """Returns ``values`` as floats, None kept (skipped) and NaN/inf as NaN (failed).

    Raises:
        RewardFunctionError: not a list of ``expected`` values, or a value that is not a real number or None.
    """
    if not isinstance(values, (list, tuple)):
        raise RewardFunctionError(f"{label} returned {type(values).__name__}, not a list of {expected} numbers")
    if len(values) != expected:
        raise RewardFunctionError(f"{label} returned {len(values)} values for {expected} completions")
    out: list[float | None] = []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
        elif isinstance(v, numbers.Real) or (hasattr(v, "item") and getattr(v, "ndim", None) == 0):
            out.append(float(v) if math.isfinite(float(v)) else math.nan)
        else:
            raise RewardFunctionError(f"{label} returned a non-numeric value {v!r:.60} for completion {i}")
    return out


def column_values(rows: Sequence[dict[str, Any]], known: Sequence[str] | None = None) -> dict[str, list[Any]]:
    """Returns ``{column: [B values]}`` for every column in ``known`` or in any row (None where a row lacks it).

    Raises:
        ValueError: a column named prompts, completions or completion_ids (they would shadow those arguments).
    """
    names = dict.fromkeys(known or ())
    for row in rows:
        names.update(dict.fromkeys(row))
    if clash := [n for n in STANDARD_ARGS if n in names]:
        raise ValueError(f"dataset column(s) {clash} have the names of reward-function arguments; rename them")
    return {name: [row.get(name) for row in rows] for name in names}
