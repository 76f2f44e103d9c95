"""The reward stage: the built-in GSM8K terms, user reward functions and a reward model, combined by weight.

User functions use TRL's reward-function convention, so functions written for TRL's trainers work
unchanged: ``fn(prompts: list[str], completions: list[str], **columns) -> list[float]``, called once
per batch with keyword columns ``answer`` (the reference answers). A function is named in the config as
``"package.module:function"`` or ``"path/to/file.py:function"``.

Each user function runs in its own sandbox process (``rlray.reward.sandbox``) with a time limit
(``reward.functions[i].timeout_s``, default 10 s), and, when marked ``untrusted`` (code-execution rewards),
with a memory cap, an empty environment and a private working folder. A sample whose reward cannot be
computed is *failed*: its "reward" (and the function's own term) is NaN, and the loop leaves it out of the
group statistics and the loss and counts it in ``reward/failed``. A sample fails when the function

- returns None, NaN or inf for it;
- raises: the batch is then scored again one completion at a time, so only the completions it raises on
  fail (a timeout during that retry fails the rest of the batch);
- runs past its timeout or its process dies (a memory cap): every completion of that call fails.

A function that returns a different *number* of values than completions, or a value that is not a number,
is a programming error: ``RewardFunctionError`` names the function, and the run stops at once.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import numbers
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlray.reward.gsm8k import gsm8k_reward
from rlray.reward.sandbox import Limits, ProcessSandbox, SandboxCrashed, SandboxError, SandboxTimeout

RewardFn = Callable[..., list[float]]
log = logging.getLogger(__name__)


class RewardFunctionError(ValueError):
    """A user reward function that cannot be loaded or returned unusable values; names the function."""


def load_reward_function(spec: str) -> RewardFn:
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


def _serve_reward_function(spec: str) -> Callable[[list[str], list[str], list[str]], Any]:
    """Sandbox factory (runs in the child): loads ``spec`` and returns a positional caller of it.

    The caller turns the function's result into a list when it is iterable (a generator or an array
    crosses the pipe as a list); anything else is returned as is and rejected by the parent.
    """
    fn = load_reward_function(spec)

    def call(prompts: list[str], completions: list[str], references: list[str]) -> Any:
        values = fn(prompts=prompts, completions=completions, answer=references)
        if isinstance(values, (str, bytes, dict)):
            return values
        try:
            return list(values)
        except TypeError:
            return values

    return call


class UserFunction:
    """One user reward function in its own sandbox process; returns NaN for the samples it fails on.

    Args:
        path: ``"module:function"`` or ``"file.py:function"`` (``reward.functions[i].path``).
        weight: weight of its term in the summed reward.
        timeout_s: seconds one call may take before its process is killed.
        untrusted: run under ``Limits(untrusted=True)`` (memory cap, empty environment, private folder).
        memory_gib: the address-space cap of an untrusted function's process, in GiB.

    Raises:
        RewardFunctionError: the function cannot be loaded (its process reports why) or does not start.
    """

    def __init__(self, path: str, weight: float = 1.0, timeout_s: float = 10.0, untrusted: bool = False,
                 memory_gib: float = 2.0) -> None:
        self.path, self.weight = path, weight
        self.name = path.rsplit(":", 1)[-1]
        try:
            self.sandbox = ProcessSandbox(
                _serve_reward_function, {"spec": path}, timeout_s=timeout_s, start_timeout_s=max(60.0, timeout_s),
                limits=Limits(untrusted=untrusted, memory_gib=memory_gib), name=f"reward function {self.name}",
            )  # fmt: skip
        except SandboxError as err:
            if isinstance(err.original, RewardFunctionError):
                raise err.original from None
            raise RewardFunctionError(f"reward function '{path}' could not be loaded: {err}") from None
        except SandboxTimeout as err:
            raise RewardFunctionError(f"reward function '{path}': {err}") from None

    def score(self, prompts: list[str], completions: list[str], references: list[str]) -> list[float]:
        """Returns one value per completion, NaN where the sample failed (see the module docstring).

        Raises:
            RewardFunctionError: a wrong number of values, or a value that is not a number (names the function).
        """
        try:
            values = self.sandbox(prompts, completions, references)
        except SandboxError as err:
            if len(completions) == 1:
                return self._failed(1, 1, str(err))
            return self._one_by_one(prompts, completions, references, str(err))
        except (SandboxTimeout, SandboxCrashed) as err:
            return self._failed(len(completions), len(completions), str(err))
        out = check_values(self.path, values, len(completions))
        if bad := sum(not math.isfinite(v) for v in out):
            log.warning("reward function '%s' returned None/NaN/inf for %d of %d completions; they are excluded",
                        self.name, bad, len(out))
        return out

    def _one_by_one(self, prompts: list[str], completions: list[str], references: list[str], first: str) -> list[float]:
        """Returns the values of a batch the function raised on, scored one completion at a time."""
        out = [math.nan] * len(completions)
        for i in range(len(completions)):
            try:
                out[i] = check_values(self.path, self.sandbox([prompts[i]], [completions[i]], [references[i]]), 1)[0]
            except SandboxError:
                continue
            except (SandboxTimeout, SandboxCrashed) as err:
                first = f"{first}; then {err}"
                break
        return self._failed(sum(not math.isfinite(v) for v in out), len(out), first, out)

    def _failed(self, bad: int, total: int, why: str, values: list[float] | None = None) -> list[float]:
        log.warning("reward function '%s' failed on %d of %d completions (%s); they are excluded", self.name, bad,
                    total, why[:500])
        return values if values is not None else [math.nan] * total

    def close(self) -> None:
        """Stops the function's process."""
        self.sandbox.close()


def check_values(spec: str, values: object, expected: int) -> list[float]:
    """Returns ``values`` as floats (None, NaN and inf become NaN: failed samples).

    Raises:
        RewardFunctionError: not a list of ``expected`` values, or a value that is not a real number.
    """
    if not isinstance(values, (list, tuple)):
        raise RewardFunctionError(
            f"reward function '{spec}' returned {type(values).__name__}, not a list of {expected} numbers"
        )
    if len(values) != expected:
        raise RewardFunctionError(f"reward function '{spec}' returned {len(values)} values for {expected} completions")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
        elif isinstance(v, numbers.Real) or (hasattr(v, "item") and getattr(v, "ndim", None) == 0):
            out.append(float(v))
        else:
            raise RewardFunctionError(f"reward function '{spec}' returned a non-numeric value {v!r:.60} for completion {i}")
    return [v if math.isfinite(v) else math.nan for v in out]


class RewardScorer:
    """Scores completions: GSM8K correctness and format terms, weighted user functions and a reward model.

    Args:
        correct_weight: weight of the math-verify correctness term (0/1 per completion).
        format_weight: weight of the '#### <number>' format term (0/1 per completion).
        functions: user reward functions, each a dict of ``UserFunction`` arguments (path, weight,
            timeout_s, untrusted, memory_gib); see the module docstring.
        model_path: a reward-model snapshot or Hugging Face sequence-classification folder
            (``rlray.reward.reward_model.RewardModel``), or None for no reward-model term.
        model_weight: weight of the reward model's raw score.

    Raises:
        RewardFunctionError: a user function cannot be loaded.
        rlray.models.ModelError, FileNotFoundError: the reward model cannot be loaded.
    """

    def __init__(
        self,
        *,
        correct_weight: float,
        format_weight: float,
        functions: Sequence[dict] = (),
        model_path: str | None = None,
        model_weight: float = 1.0,
    ) -> None:
        self.correct_weight = correct_weight
        self.format_weight = format_weight
        self.functions: list[UserFunction] = []
        try:
            for f in functions:
                self.functions.append(UserFunction(**f))
        except BaseException:
            self.close()
            raise
        self.model_weight = model_weight
        self.model = None
        if model_path is not None:
            # deferred: torch + transformers, which the spawned scorer sandbox needs only with a reward model
            from rlray.reward.reward_model import RewardModel

            self.model = RewardModel(model_path)

    def score(self, prompts: list[str], completions: list[str], references: list[str]) -> dict[str, list[float]]:
        """Returns {"reward": [...], "accuracy": [...], "format": [...], <function name>: [...]}, B values each.

        ``reward = correct_weight * accuracy + format_weight * format + sum_f weight_f * f
        (+ model_weight * reward_model)``; with a reward model its raw scores are under "reward_model".
        A failed sample (module docstring) has NaN in "reward" and in the failing function's term.

        Raises:
            RewardFunctionError: a user function returned a different number of values than completions,
                or a value that is not a number (the message names the function).
        """
        out = gsm8k_reward(completions, references, correct_weight=self.correct_weight, format_weight=self.format_weight)
        for fn in self.functions:
            values = fn.score(prompts, completions, references)
            out[fn.name] = values
            out["reward"] = [r + fn.weight * v for r, v in zip(out["reward"], values, strict=True)]
        if self.model is not None:
            out["reward_model"] = self.model.score(prompts, completions)
            out["reward"] = [r + self.model_weight * v for r, v in zip(out["reward"], out["reward_model"], strict=True)]
        return out

    def close(self) -> None:
        """Stops the user functions' processes."""
        for fn in self.functions:
            fn.close()
