"""The reward stage: the built-in GSM8K terms, user reward functions and a reward model, combined by weight.

User functions use TRL's reward-function convention, so functions written for TRL's trainers work
unchanged: ``fn(prompts: list[str], completions: list[str], **columns) -> list[float]``, called once
per batch with keyword columns ``answer`` (the reference answers). A function is named in the config as
``"package.module:function"`` or ``"path/to/file.py:function"``.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path

from rlray.reward.gsm8k import gsm8k_reward

RewardFn = Callable[..., list[float]]


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


class RewardScorer:
    """Scores completions: GSM8K correctness and format terms, weighted user functions and a reward model.

    Args:
        correct_weight: weight of the math-verify correctness term (0/1 per completion).
        format_weight: weight of the '#### <number>' format term (0/1 per completion).
        functions: (spec, weight) pairs of user reward functions (see module docstring).
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
        functions: list[tuple[str, float]] = (),
        model_path: str | None = None,
        model_weight: float = 1.0,
    ) -> None:
        self.correct_weight = correct_weight
        self.format_weight = format_weight
        self.functions = [(spec, spec.rsplit(":", 1)[-1], load_reward_function(spec), w) for spec, w in functions]
        self.model_weight = model_weight
        self.model = None
        if model_path is not None:
            from rlray.reward.reward_model import RewardModel  # loads transformers models only when asked

            self.model = RewardModel(model_path)

    def score(self, prompts: list[str], completions: list[str], references: list[str]) -> dict[str, list[float]]:
        """Returns {"reward": [...], "accuracy": [...], "format": [...], <function name>: [...]}, B values each.

        ``reward = correct_weight * accuracy + format_weight * format + sum_f weight_f * f
        (+ model_weight * reward_model)``; with a reward model its raw scores are under "reward_model".

        Raises:
            RewardFunctionError: a user function returned a different number of values than
                completions, or a value that is not a real number (the message names the function).
        """
        out = gsm8k_reward(completions, references, correct_weight=self.correct_weight, format_weight=self.format_weight)
        for spec, name, fn, weight in self.functions:
            values = fn(prompts=prompts, completions=completions, answer=references)
            values = _check_values(spec, values, len(completions))
            out[name] = values
            out["reward"] = [r + weight * v for r, v in zip(out["reward"], values)]
        if self.model is not None:
            out["reward_model"] = self.model.score(prompts, completions)
            out["reward"] = [r + self.model_weight * v for r, v in zip(out["reward"], out["reward_model"])]
        return out


def _check_values(spec: str, values: object, expected: int) -> list[float]:
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError) as err:
        raise RewardFunctionError(f"reward function '{spec}' returned non-numeric values: {err}") from err
    if len(values) != expected:
        raise RewardFunctionError(f"reward function '{spec}' returned {len(values)} values for {expected} completions")
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise RewardFunctionError(f"reward function '{spec}' returned a non-finite value for completion {bad[0]}")
    return values
