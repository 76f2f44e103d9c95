"""The reward stage: weighted reward terms (built-in verifiers and user functions) and a reward model.

**Entries.** Each ``reward.functions[i]`` (``RewardFunctionConfig.model_dump()``) names a reward function in
TRL's convention (``rlray.reward.functions``: prompts, completions, completion_ids and the dataset's columns as
keyword lists, the entry's kwargs bound on top): a built-in verifier (``rlray.reward.verifiers``; run in this
process, trusted and cheap: ``timeout_s``, ``untrusted`` and ``memory_gib`` do not apply to it) or a user
function ``"package.module:function"`` / ``"path/to/file.py:function"``, which runs in its own sandbox
process (``rlray.sandbox``) with a time limit (``timeout_s``) and, when ``untrusted`` (code-execution
rewards), a memory cap, an empty environment and a private working folder. Its term is named ``name``, else
the built-in's or the function's own name (metric ``reward/<name>``); "reward" and "reward_model" are
reserved and names are unique. Signatures are checked when the scorer is built (``BoundFunction.check``).

**Values.** Each term's value for a sample is

- a float;
- None, *skipped*: the function returned None for it (TRL's rule: the term does not apply to this sample);
- NaN, *failed*: the function returned NaN or inf for it, raised (the batch is then scored again one
  completion at a time, so only the completions it raises on fail; a timeout during that retry fails the
  rest of the batch), ran past its timeout, or its process died (a memory cap): every completion of such a
  call fails.

``reward[i]`` is the sum over terms whose value is not None of ``weight * value``, plus ``model_weight *
reward_model[i]`` with a reward model (its raw score, which always applies), summed in Python floats from
0.0 in config order (``rlray.reward.combine``, the one rule for every reward term; so ``[gsm8k_correct 1.0, gsm8k_format 0.2]`` gives exactly
``1.0 * accuracy + 0.2 * format``). It is NaN when any term failed, and also when every term skipped the
sample and there is no reward model: nothing rewarded it, so it counts as failed (TRL marks such rows NaN as
well). A scorer with no terms at all (no functions, no reward model) gives 0.0 to every sample: the task reward
is off, as in a pure on-policy distillation run, where the teacher's signal is the only one (preflight allows
that only with ``teacher.path`` set). The loop leaves NaN samples out of the group statistics and the loss and counts them in
``reward/failed``.

**Hangs.** A user function killed at its ``timeout_s`` is reported with the Python stacks of its process, taken from
it before the kill (``rlray.hangs.Hang``: who, the key, where it was stuck): to ``RewardScorer.watch_hangs``'s callback
when one is set (a run's ``HangWatch.killed``: the ``rlray: hang`` line, the ``hang`` alert, and under
``watchdog.on_hang=stop`` a ``HangError`` that stops the run), else in an ``rlray: hang`` log line.

A function that returns a different *number* of values than completions, or a value that is not a number or
None, is a programming error: ``RewardFunctionError`` names the entry, and the run stops at once.
"""

from __future__ import annotations

import inspect
import logging
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from rlray.hangs import ActorProcess, Hang
from rlray.reward.combine import Term, combine
from rlray.reward.functions import (
    BoundFunction,
    RewardFunctionError,
    check_values,
    column_values,
    load_bound_function,
    load_reward_function,
)
from rlray.reward.verifiers import BUILTIN_VERIFIERS, prepare_kwargs
from rlray.sandbox import Limits, ProcessSandbox, SandboxCrashed, SandboxError, SandboxTimeout

__all__ = ["RewardFunctionError", "RewardScorer", "RewardTerm", "load_reward_function", "summed_reward", "term_name"]
log = logging.getLogger(__name__)
RESERVED_NAMES = ("reward", "reward_model")
_ENTRY_KEYS = ("function", "name", "weight", "kwargs", "timeout_s", "untrusted", "memory_gib")


class RewardTerm:
    """One weighted term: a built-in in this process, or a user function in its own sandbox process.

    Args:
        index: its position in ``reward.functions`` (for messages).
        function: a built-in verifier name or ``"module:function"`` / ``"file.py:function"``.
        name: the term's name (metric ``reward/<name>``); None: the text after the last ':' of ``function``.
        weight: weight of its values in the summed reward.
        kwargs: keyword arguments bound to the function.
        timeout_s, untrusted, memory_gib: a user function's sandbox (``reward.functions[i].*``).
        columns: the dataset's extra column names, or None when unknown (signature check).

    Attributes:
        on_hang: takes the report of a call killed at ``timeout_s`` (``RewardScorer.watch_hangs``; it may raise
            ``HangError``); by default the report is logged.

    Raises:
        RewardFunctionError: an unknown built-in, a function that cannot be loaded or whose signature does not
            fit, a bad ``pattern``, or a built-in's ``column`` that the dataset lacks; names the entry.
    """

    def __init__(self, index: int, *, function: str, name: str | None = None, weight: float = 1.0,
                 kwargs: dict[str, Any] | None = None, timeout_s: float = 10.0, untrusted: bool = False,
                 memory_gib: float = 2.0, columns: Sequence[str] | None = None) -> None:  # fmt: skip
        self.spec, self.weight, self.index, self.timeout_s = function, weight, index, timeout_s
        self.on_hang: Callable[[Hang], object] = _log_hang
        self.name = term_name(function, name)
        self.label = f"reward.functions[{index}] (function='{function}', name='{self.name}')"
        self.box: ProcessSandbox | None = None
        kwargs = dict(kwargs or {})
        if ":" not in function:
            self._call = self._builtin(kwargs, columns)
            return
        factory_kwargs = {"spec": function, "label": self.label, "kwargs": kwargs,
                          "columns": None if columns is None else list(columns)}  # fmt: skip
        try:
            self.box = ProcessSandbox(
                load_bound_function, factory_kwargs, timeout_s=timeout_s, start_timeout_s=max(60.0, timeout_s),
                limits=Limits(untrusted=untrusted, memory_gib=memory_gib), name=f"reward function {self.name}",
            )  # fmt: skip
        except SandboxError as err:
            if isinstance(err.original, RewardFunctionError):
                raise err.original from None
            raise RewardFunctionError(f"{self.label} could not be loaded: {err}") from None
        except SandboxTimeout as err:
            raise RewardFunctionError(f"{self.label}: {err}") from None
        self._call = self.box

    def _builtin(self, kwargs: dict[str, Any], columns: Sequence[str] | None) -> Callable[..., Any]:
        """Returns an in-process caller of the built-in ``self.spec`` that reports a raise as ``SandboxError``."""
        if self.spec not in BUILTIN_VERIFIERS:
            raise RewardFunctionError(
                f"{self.label}: '{self.spec}' is not a built-in verifier ({', '.join(BUILTIN_VERIFIERS)}); a user "
                "function is 'package.module:function' or 'path/to/file.py:function'"
            )
        try:
            bound = BoundFunction.check(BUILTIN_VERIFIERS[self.spec], self.label, prepare_kwargs(kwargs), columns,
                                        named_kwargs_only=True)
        except re.error as err:
            raise RewardFunctionError(f"{self.label}: kwargs pattern {kwargs['pattern']!r} is not a regular expression: {err}") from None
        param = inspect.signature(bound.fn).parameters.get("column")  # the built-ins that read a column name it so
        column = bound.kwargs.get("column", None if param is None else param.default)
        if isinstance(column, str) and columns is not None and column not in columns:
            raise RewardFunctionError(f"{self.label} reads column '{column}', which the dataset lacks (columns: "
                                      f"{sorted(columns)}); set kwargs column to one of them")  # fmt: skip

        def call(*args: Any) -> Any:
            try:
                return bound(*args)
            except Exception as err:  # noqa: BLE001 - a raise fails the samples, as in a user function's sandbox
                raise SandboxError(type(err).__name__, str(err), err) from err

        return call

    def score(self, prompts: list, completions: list, completion_ids: list | None,
              columns: dict[str, list]) -> tuple[list[float | None], list[str]]:  # fmt: skip
        """Returns (values, failures): one value per completion, a float, None (skipped) or NaN (failed; module
        docstring), and per completion "" or why it failed ('ValueError: ...', 'returned NaN or inf', a timeout).

        Raises:
            RewardFunctionError: a wrong number of values, or a value that is not a number or None.
        """
        try:
            values = self._call(prompts, completions, completion_ids, columns)
        except SandboxError as err:
            if len(completions) == 1:
                return self._failed([math.nan], [str(err)])
            return self._one_by_one(prompts, completions, completion_ids, columns, str(err))
        except (SandboxTimeout, SandboxCrashed) as err:
            self._timed_out(err, len(completions))
            return self._failed([math.nan] * len(completions), [str(err)] * len(completions))
        out = check_values(self.label, values, len(completions))
        failures = ["returned NaN or inf" if v is not None and math.isnan(v) else "" for v in out]
        if bad := sum(map(bool, failures)):
            log.warning("reward function '%s' returned NaN/inf for %d of %d completions; they are excluded",
                        self.name, bad, len(out))
        return out, failures

    def _one_by_one(self, prompts: list, completions: list, completion_ids: list | None, columns: dict[str, list],
                    first: str) -> tuple[list[float | None], list[str]]:  # fmt: skip
        """Returns the values and failures of a batch the function raised on, scored one completion at a time."""
        out: list[float | None] = [math.nan] * len(completions)
        failures = [first] * len(completions)
        for i in range(len(completions)):
            ids = None if completion_ids is None else completion_ids[i : i + 1]
            one = {k: v[i : i + 1] for k, v in columns.items()}
            try:
                out[i] = check_values(self.label, self._call(prompts[i : i + 1], completions[i : i + 1], ids, one), 1)[0]
                failures[i] = "returned NaN or inf" if out[i] is not None and math.isnan(out[i]) else ""
            except SandboxError as err:
                failures[i] = str(err)
                continue
            except (SandboxTimeout, SandboxCrashed) as err:
                failures[i:] = [f"{first}; then {err}"] * (len(completions) - i)
                self._timed_out(err, len(completions) - i)
                break
        return self._failed(out, failures)

    def _timed_out(self, err: SandboxTimeout | SandboxCrashed, samples: int) -> None:
        """Reports a call killed at ``timeout_s`` (``err`` carries the process's pid and the stacks taken from it
        before the kill) through ``on_hang``, which may raise ``HangError``; a crash is not a hang (no report)."""
        if not isinstance(err, SandboxTimeout):
            return
        self.on_hang(Hang(
            f"reward function '{self.name}'", f"score of {samples} completions", self.timeout_s, self.timeout_s,
            f"reward.functions[{self.index}].timeout_s", ActorProcess(f"rlray-reward function {self.name}", err.pid, ""),
            err.stacks, "restart", then=f"its process was killed and restarted; the {samples} samples of the call "
                                        "fail (NaN, reward/failed) and the run goes on"))

    def _failed(self, values: list[float | None], failures: list[str]) -> tuple[list[float | None], list[str]]:
        """Returns (values, failures) after logging how many failed and the first reason."""
        bad = [f for f in failures if f]
        log.warning("reward function '%s' failed on %d of %d completions (%s); they are excluded", self.name, len(bad),
                    len(values), (bad or [""])[0][:500])
        return values, failures

    def close(self) -> None:
        """Stops the user function's process (built-ins have none)."""
        if self.box is not None:
            self.box.close()


def _log_hang(hang: Hang) -> None:
    """Logs the ``rlray: hang`` line of a user function killed at its timeout (no hang watch to send it to)."""
    log.error("rlray: %s", hang.message())


def term_name(function: str, name: str | None) -> str:
    """Returns a term's name: ``name``, else the text after the last ':' of ``function`` (a built-in's own name)."""
    return name or function.rsplit(":", 1)[-1]


def summed_reward(terms: Sequence[tuple[float, Sequence[float | None]]], n: int) -> list[float]:
    """Returns ``reward[i] = sum of weight * value[i]`` over (weight, values) terms whose value is not None.

    Summed in Python floats from 0.0 in the order given (``rlray.reward.combine``); NaN where a value is NaN, and
    where every value is None (nothing rewarded the sample; with no terms, every sample).
    """
    if not terms:
        return [math.nan] * n
    return combine([Term(f"term{k}", weight, values) for k, (weight, values) in enumerate(terms)], n)["reward"]


class RewardScorer:
    """Scores completions: weighted reward terms (built-ins and user functions) and a reward model.

    Args:
        functions: the terms, each ``RewardFunctionConfig.model_dump()`` (function, name, weight, kwargs,
            timeout_s, untrusted, memory_gib); see the module docstring.
        model_path: a reward-model snapshot or Hugging Face sequence-classification folder
            (``rlray.reward.reward_model.RewardModel``), or None for no reward-model term.
        model_weight: weight of the reward model's raw score.
        columns: the dataset's extra column names, or None when unknown (a standalone server): the
            signature check then accepts any parameter name, and calls pass the columns the rows carry.

    Raises:
        RewardFunctionError: a bad entry (unknown key, reserved or duplicate name, unknown built-in, a function
            that cannot be loaded or whose signature does not fit); the message names the entry.
        ValueError: a column named prompts, completions or completion_ids.
        rlray.models.ModelError, FileNotFoundError: the reward model cannot be loaded.
    """

    def __init__(self, *, functions: Sequence[dict], model_path: str | None = None, model_weight: float = 1.0,
                 columns: Sequence[str] | None = None) -> None:  # fmt: skip
        self.columns = None if columns is None else list(columns)
        column_values([], self.columns)  # a column named like prompts/completions/completion_ids fails here, not mid-run
        _check_entries(functions)
        self.terms: list[RewardTerm] = []
        try:
            for i, entry in enumerate(functions):
                self.terms.append(RewardTerm(i, **entry, columns=self.columns))
        except BaseException:
            self.close()
            raise
        self.model_weight = model_weight
        self.model = None
        if model_path is not None:
            # deferred: torch + transformers, which the spawned scorer sandbox needs only with a reward model
            from rlray.reward.reward_model import RewardModel

            self.model = RewardModel(model_path)

    def score(self, prompts: list[str | list[dict]], completions: list[str], columns: list[dict[str, Any]],
              completion_ids: list[list[int]] | None = None) -> dict[str, list[float | None]]:  # fmt: skip
        """Returns ``{"reward": [B], <term name>: [B], ...}`` (plus ``"reward_model"`` with a model).

        Args:
            prompts: B prompts as the dataset has them (strings or lists of ``{"role", "content"}`` messages).
            completions: B decoded completions.
            columns: B dicts, each sample's prompt row's other columns (values as in the file).
            completion_ids: B lists of completion token ids, or None.

        Term values are floats, None (skipped) or NaN (failed); "reward" is ``summed_reward`` of the terms in
        config order, then the model term (module docstring); 0.0 for every sample when the scorer has no term.

        Raises:
            ValueError: the four lists differ in length, or a column named like a standard argument.
            RewardFunctionError: a function returned a different number of values than completions, or a value
                that is not a number or None (the message names the entry).
        """
        return self.score_with_failures(prompts, completions, columns, completion_ids)[0]

    def score_with_failures(self, prompts: list[str | list[dict]], completions: list[str], columns: list[dict[str, Any]],
                            completion_ids: list[list[int]] | None = None) -> tuple[dict[str, list[float | None]], list[str]]:  # fmt: skip
        """Returns (``score``'s values, failures): per completion "" when its reward is a number, else why it has
        none, naming the source: "reward function '<name>': <Type>: <message>" (the first term that failed on it,
        in config order), or that every term skipped it. Arguments and errors as ``score``."""
        n = len(completions)
        if len(prompts) != n or len(columns) != n or (completion_ids is not None and len(completion_ids) != n):
            ids = "None" if completion_ids is None else len(completion_ids)
            raise ValueError(f"RewardScorer.score: prompts ({len(prompts)}), completions ({n}), columns "
                             f"({len(columns)}) and completion_ids ({ids}) must have the same length")  # fmt: skip
        values = column_values(columns, self.columns)
        shaped = [[{"role": "assistant", "content": c}] if isinstance(p, list) else c for p, c in zip(prompts, completions, strict=True)]
        scored = {t.name: t.score(list(prompts), shaped, completion_ids, values) if n else ([], []) for t in self.terms}
        weighted = [Term(t.name, t.weight, scored[t.name][0]) for t in self.terms]
        if self.model is not None:
            weighted.append(Term("reward_model", self.model_weight, self.model.score(prompts, completions)))
        values = combine(weighted, n)  # no term at all: 0.0 for every sample
        reward = values["reward"]
        failures = []
        for i, r in enumerate(reward):
            why = next((f"reward function '{name}': {got[1][i]}" for name, got in scored.items() if got[1][i]), "")
            if not why and math.isnan(r):
                why = ("the reward model gave NaN" if self.model is not None
                       else "every reward term skipped it (returned None) and there is no reward model")
            failures.append(why)
        return values, failures

    def watch_hangs(self, on_hang: Callable[[Hang], object]) -> None:
        """Sends the report of each user function killed at its timeout, with its stacks, to ``on_hang`` when it happens
        (a run's ``HangWatch.killed``, which raises ``HangError`` under ``watchdog.on_hang=stop``; in the reward
        server's scorer process, a list the replica hands back with the scores); by default each is logged."""
        for term in self.terms:
            term.on_hang = on_hang

    def close(self) -> None:
        """Stops the user functions' processes."""
        for term in self.terms:
            term.close()


def _check_entries(functions: Sequence[dict]) -> None:
    """Checks the entries' keys and names before any process starts.

    Raises:
        RewardFunctionError: an entry that is not a dict with ``function``, an unknown key, a reserved name
            (reward, reward_model) or two entries with one name (names both).
    """
    seen: dict[str, int] = {}
    for i, entry in enumerate(functions):
        if not isinstance(entry, dict) or not isinstance(entry.get("function"), str):
            raise RewardFunctionError(f"reward.functions[{i}] must be a dict with a 'function' string, got {entry!r:.200}")
        if unknown := sorted(set(entry) - set(_ENTRY_KEYS)):
            raise RewardFunctionError(f"reward.functions[{i}] ('{entry['function']}') has unknown keys {unknown}; "
                                      f"known: {list(_ENTRY_KEYS)}")  # fmt: skip
        name = term_name(entry["function"], entry.get("name"))
        if name in RESERVED_NAMES:
            raise RewardFunctionError(f"reward.functions[{i}] ('{entry['function']}') is named '{name}', a reserved "
                                      "name (the summed reward and the reward model's term); set its name")  # fmt: skip
        if name in seen:
            j = seen[name]
            raise RewardFunctionError(
                f"reward.functions[{j}] ('{functions[j]['function']}') and reward.functions[{i}] ('{entry['function']}') "
                f"are both named '{name}' (metric reward/<name>); give one of them a distinct name"
            )
        seen[name] = i
