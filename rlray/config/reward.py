"""Config section reward: reward terms (built-in verifiers, user functions), judges, the Serve reward server and a reward model."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from rlray.config.base import _Section
from rlray.config.judge import RESERVED_TERMS, JudgeConfig


class RewardFunctionConfig(_Section):
    """One reward term: a built-in verifier or a user function (TRL's convention: fn(prompts, completions, **columns)).

    The term is logged as ``reward/<name>`` (its mean over the samples it applied to) and
    ``reward/<name>_skipped`` (samples it returned None for). Built-ins (``rlray.reward.verifiers``):
    math_equal, exact_match, regex_match, gsm8k_correct, gsm8k_format, reasoning_gym.
    """

    function: str = Field(
        ...,
        description=(
            "A built-in verifier (math_equal, exact_match, regex_match, gsm8k_correct, gsm8k_format, reasoning_gym: "
            "the generator's score of rows of a reasoning-gym data source), or a user "
            "function as 'package.module:function' or 'path/to/file.py:function'."
        ),
    )
    name: str | None = Field(
        None,
        description="Name of the term in metrics (reward/<name>); default: the built-in's or the function's own name.",
    )
    weight: float = Field(1.0, description="Weight of this term in the summed reward.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments bound to the function, e.g. {pattern: '#### \\d+$'} or {column: solution}.",
    )
    timeout_s: float = Field(
        10.0,
        gt=0.0,
        description=(
            "Seconds one call of a user function may take (it runs in its own process); past it the process's "
            "stacks are taken and reported (a hang: watchdog.on_hang), the process is killed and restarted, and that "
            "call's samples count as failed (reward/failed, left out of the step), or under on_hang=stop the run stops."
        ),
    )
    untrusted: bool = Field(
        False,
        description=(
            "Treat the function as untrusted code (code-execution rewards): its process also gets an "
            "address-space cap of memory_gib, an emptied environment (no credentials) and a private temp folder."
        ),
    )
    memory_gib: float = Field(
        2.0, gt=0.0, description="Address-space cap (RLIMIT_AS) of an untrusted function's process, in GiB."
    )

    @model_validator(mode="before")
    @classmethod
    def _retired_path(cls, data: Any) -> Any:
        if isinstance(data, dict) and "path" in data:
            raise ValueError(
                f"reward.functions[].path was renamed to 'function' (path={data['path']!r}); write "
                "function: 'module:fn' or 'file.py:fn', or a built-in verifier name"
            )
        return data

    @property
    def term_name(self) -> str:
        """Returns the metric name of this term: ``name``, else the text after the last ':' of ``function``."""
        return self.name or self.function.rsplit(":", 1)[-1]


class RewardServerConfig(_Section):
    """The Ray Serve application that scores completions (rules, user functions, reward model)."""

    enabled: bool = Field(
        False,
        description=(
            "Score through the Serve application (DeploymentHandle from the run, HTTP POST /score for other "
            "tools); False scores in the learner's rank-0 process."
        ),
    )
    app_name: str = Field("rlray-reward", description="Serve application name (one per cluster and reward).")
    host: str = Field("127.0.0.1", description="HTTP bind address of Serve's proxy; 0.0.0.0 exposes it.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port of Serve's proxy (cluster-wide, set once).")
    max_batch_size: int = Field(
        32, ge=1, description="Requests merged into one scorer call by @serve.batch (per replica)."
    )
    batch_wait_timeout_s: float = Field(
        0.01, ge=0.0, description="Seconds a partial batch waits for more requests before it is scored."
    )
    timeout_s: float = Field(
        60.0,
        gt=0.0,
        description=(
            "Seconds one scorer call (rules, user functions, reward model) may take; past it the sandbox "
            "process's stacks are taken and reported (a hang: watchdog.on_hang), it is killed and restarted, and the "
            "requests of that batch fail with a timeout error."
        ),
    )
    client_attempts: int = Field(
        5,
        ge=1,
        description=(
            "Tries of one scoring request from the run while no replica answers (a restarting replica), with "
            "exponential back-off from 1 s (at most 30 s between tries); then the step fails with a clear error."
        ),
    )
    client_timeout_s: float = Field(
        300.0,
        gt=0.0,
        description="Seconds the run waits for one try of a scoring request, queueing for a replica included.",
    )


class RewardConfig(_Section):
    """Reward: weighted terms (built-in verifiers and user functions) plus an optional reward model.

    Example (the GSM8K configs): ``functions: [{function: gsm8k_correct, weight: 1.0}, {function:
    gsm8k_format, weight: 0.2}]``. An online run needs at least one term or a reward model.
    """

    functions: list[RewardFunctionConfig] = Field(
        default_factory=list,
        description=(
            "Reward terms summed with their weights: built-in verifiers and user functions side by side, each "
            "logged as reward/<name>."
        ),
    )
    version: int = Field(
        1,
        ge=0,
        description=(
            "Version number of the reward definition (rules, functions and any reward model); logged per "
            "step as reward/version. Bump it when hot-swapping a reward model into a running server."
        ),
    )
    judges: list[JudgeConfig] = Field(
        default_factory=list,
        description=(
            "Judges (generative reward models): LLMs on their own Serve applications whose verdicts are weighted "
            "terms beside the functions, each logged as reward/<name>; hot-swapped by deploying a new reward.version."
        ),
    )
    server: RewardServerConfig = Field(default_factory=RewardServerConfig)
    model_path: str | None = Field(
        None,
        description=(
            "Reward model: a folder written by algo.name=reward_model (its snapshot or the snapshot's model/), "
            "or any Hugging Face sequence-classification checkpoint with one label (a folder or a Hub id, "
            "org/name); None disables the term."
        ),
    )
    model_revision: str | None = Field(
        None,
        description="The Hub revision (branch, tag or commit hash) of a Hub id in reward.model_path; null: the repository's "
        "default branch. Ignored for folders, .gguf files and aliases.",
    )
    model_weight: float = Field(1.0, description="Weight of the reward-model score (raw head output) in the summed reward.")

    @model_validator(mode="before")
    @classmethod
    def _retired_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, term in (("correct_weight", "gsm8k_correct"), ("format_weight", "gsm8k_format")):
                if key in data:
                    raise ValueError(
                        f"reward.{key} was removed; GSM8K's terms are reward functions now: reward.functions: "
                        f"[{{function: {term}, weight: {data[key]}}}] (see configs/grpo_gsm8k_smollm2.yaml)"
                    )
        return data

    @model_validator(mode="after")
    def _unique_names(self) -> RewardConfig:
        seen: dict[str, str] = {}
        entries = [(f"reward.functions[{i}]", f.term_name) for i, f in enumerate(self.functions)]
        entries += [(f"reward.judges[{i}]", j.name) for i, j in enumerate(self.judges)]
        for key, name in entries:
            if name in ("reward", "reward_model") or (key.startswith("reward.judges") and name in RESERVED_TERMS):
                raise ValueError(f"{key} is named '{name}', a reserved name; set its name")
            if name in seen:
                raise ValueError(
                    f"{seen[name]} and {key} are both named '{name}' (metric reward/<name>); give one of them a "
                    "distinct name"
                )
            seen[name] = key
        return self

    @property
    def term_names(self) -> list[str]:
        """Returns the names of the configured terms: the functions', then the judges' (metrics reward/<name>)."""
        return [f.term_name for f in self.functions] + [j.name for j in self.judges]
