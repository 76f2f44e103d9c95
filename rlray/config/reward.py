"""Config section reward: the GSM8K rule terms, user reward functions, the Serve reward server and a reward model."""

from __future__ import annotations

from pydantic import Field

from rlray.config.base import _Section


class RewardFunctionConfig(_Section):
    """A user reward function (TRL's convention: fn(prompts, completions, **columns) -> list[float])."""

    path: str = Field(..., description="'package.module:function' or 'path/to/file.py:function'.")
    weight: float = Field(1.0, description="Weight of this term in the summed reward.")
    timeout_s: float = Field(
        10.0,
        gt=0.0,
        description=(
            "Seconds one call of this function may take (it runs in its own process); past it the process is "
            "killed and restarted, and that call's samples count as failed (reward/failed, left out of the step)."
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


class RewardServerConfig(_Section):
    """The Ray Serve application that scores completions (rules, user functions, reward model)."""

    enabled: bool = Field(
        False,
        description=(
            "Score through the Serve application (DeploymentHandle from the loop, HTTP POST /score for other "
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
            "process is killed and restarted and the requests of that batch fail with a timeout error."
        ),
    )
    client_attempts: int = Field(
        5,
        ge=1,
        description=(
            "Tries of one scoring request from the loop while no replica answers (a restarting replica), with "
            "exponential back-off from 1 s (at most 30 s between tries); then the step fails with a clear error."
        ),
    )
    client_timeout_s: float = Field(
        300.0,
        gt=0.0,
        description="Seconds the loop waits for one try of a scoring request, queueing for a replica included.",
    )


class RewardConfig(_Section):
    """Reward: GSM8K correctness (math-verify) plus a small format term, plus optional user functions."""

    correct_weight: float = Field(1.0, description="Reward for a final answer equal to the reference.")
    format_weight: float = Field(
        0.2, description="Reward for ending with a '#### <number>' line, whether right or wrong."
    )
    functions: list[RewardFunctionConfig] = Field(
        default_factory=list, description="User reward functions added to the reward with their weights."
    )
    version: int = Field(
        1,
        ge=0,
        description=(
            "Version number of the reward definition (rules, functions and any reward model); logged per "
            "step as reward/version. Bump it when hot-swapping a reward model into a running server."
        ),
    )
    server: RewardServerConfig = Field(default_factory=RewardServerConfig)
    model_path: str | None = Field(
        None,
        description=(
            "Reward model: a folder written by algo.name=reward_model (its snapshot or the snapshot's model/), "
            "or any Hugging Face sequence-classification checkpoint with one label; None disables the term."
        ),
    )
    model_weight: float = Field(1.0, description="Weight of the reward-model score (raw head output) in the summed reward.")
