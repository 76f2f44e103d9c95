"""The whole config (``Config``): every section and the checks that span sections."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml
from pydantic import Field, SecretStr, model_validator

from rlray.config.algo import AlgoConfig, CriticConfig, LearnerConfig, OfflineConfig
from rlray.config.base import _CORE_LIST, _Section, flatten
from rlray.config.env import EnvConfig
from rlray.config.operations import CheckpointConfig, GuardConfig, MonitorConfig, WatchdogConfig
from rlray.config.resources import ResourcesConfig
from rlray.config.reward import RewardConfig
from rlray.config.run import DataConfig, EvalConfig, ModelConfig, RolloutConfig, RunConfig, TrackingConfig
from rlray.config.teacher import TeacherConfig


def _check_core_lists(key: str, value: str | list[str] | None, count_key: str, count: int, unit: str, *,
                      words: tuple[str, ...], example: str) -> None:
    """Checks a core-list option: one core list for all, a list of one per ``unit``, or None.

    Raises:
        ValueError: a list whose length is not ``count``, or an entry that is neither a core list
            ("0-1", "1", "0,2-3") nor one of ``words``; the message names ``key``.
    """
    if isinstance(value, list) and len(value) != count:
        raise ValueError(f"{key}={value!r} has {len(value)} entries for {count_key}={count}; give one core list per {unit}")
    for item in value if isinstance(value, list) else [value] if value else []:
        if item not in words and not _CORE_LIST.match(item):
            raise ValueError(f"{key}={item!r} is not a core list; use e.g. {example}")


class Config(_Section):
    """A whole rlray experiment."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    offline: OfflineConfig = Field(default_factory=OfflineConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)

    @model_validator(mode="after")
    def _check_sizes(self) -> Config:
        ln = self.learner
        world = self.resources.learner.num_workers
        self._check_resources()
        self._check_learner_options()
        self._check_ops()
        self._check_teacher()
        self._check_exact()
        self._check_partial()
        if self.algo.family == "offline":
            return self._check_offline_sizes(world)
        sequences = self.sequences_per_step
        if self.algo.algorithm.needs_groups and self.rollout.samples_per_prompt < 2:
            raise ValueError(
                f"rollout.samples_per_prompt={self.rollout.samples_per_prompt}: the group estimator "
                f"'{self.algo.name}' needs at least 2 samples per prompt; set rollout.samples_per_prompt>=2"
            )
        self._check_reward_terms()
        self._check_env()
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
        if ln.tokens_per_microbatch is None and ln.sequences_per_minibatch % (ln.sequences_per_microbatch * world):
            raise ValueError(
                f"learner.sequences_per_microbatch={ln.sequences_per_microbatch} x {world} learner worker(s) "
                f"does not divide learner.sequences_per_minibatch={ln.sequences_per_minibatch}; pick a divisor"
            )
        return self

    def _check_teacher(self) -> None:
        teacher = self.teacher
        if not teacher.enabled:
            return
        if self.algo.family == "offline":
            raise ValueError(
                f"teacher.path='{teacher.path}' with the offline method algo.name='{self.algo.name}': on-policy "
                "distillation needs an online algorithm (the student samples); pick one (e.g. grpo) or unset teacher.path"
            )
        if teacher.divergence == "jsd" and self.resources.teacher.placement != "learner":
            raise ValueError(
                "teacher.divergence='jsd' with resources.teacher.placement='actor': the JSD needs the teacher's "
                "full-vocabulary logits in the learner's micro-batch (never sent across the object store); set "
                "resources.teacher.placement=learner, or teacher.divergence=reverse_kl"
            )

    def _check_exact(self) -> None:
        """rollout.backend=exact: refuses what would make the sampler's forward differ from the learner's."""
        if self.rollout.backend != "exact":
            return
        r, res = self.rollout, self.resources
        refused = {
            "rollout.top_p < 1": r.top_p < 1.0, "rollout.top_k > 0": r.top_k > 0, "rollout.min_p > 0": r.min_p > 0.0,
            "rollout.stop": bool(r.stop), "model.lora.rank > 0 or model.adapter_path": self.trains_lora,
            "resources.learner.gpus or resources.rollout.gpus > 0": res.learner.gpus > 0 or res.rollout.gpus > 0,
            "resources.learner.strategy=fsdp": res.learner.strategy == "fsdp" and res.learner.num_workers > 1,
            "learner.sequence_packing=on": self.learner.sequence_packing == "on",
            "env.environments or env.agents": self.env.enabled,
            "teacher.divergence=jsd": self.teacher.enabled and self.teacher.divergence == "jsd",
        }
        if bad := [name for name, on in refused.items() if on]:
            raise ValueError(f"rollout.backend=exact (the learner's forward, CPU) cannot be exact with {', '.join(bad)}; "
                             "unset them, or use rollout.backend=vllm or hf (docs/algorithms.md, exact on-policy mode)")

    def _check_partial(self) -> None:
        """rollout.partial: an async run whose engines can continue a generation under new weights."""
        r = self.rollout
        if not r.partial:
            return
        if r.max_staleness == 0:
            raise ValueError("rollout.partial=true needs an async run: a weight update interrupts the generations in "
                             "flight, and with rollout.max_staleness=0 none is in flight at an update; set "
                             "rollout.max_staleness>=1, or rollout.partial=false")
        refused = {
            "rollout.backend=exact (its logprobs are exact for one prompt layout only)": r.backend == "exact",
            "rollout.stop (a stop string split across two segments would be missed)": bool(r.stop),
            f"rollout.weight_sync={self.weight_sync_backend} (only object_store pushes run beside a generation)":
                self.weight_sync_backend != "object_store",
            "rollout.weight_payload=delta (a refused delta is sent again whole only after the rollout waiting for it)":
                r.weight_payload == "delta",
        }
        if bad := [name for name, on in refused.items() if on]:
            raise ValueError(f"rollout.partial=true cannot run with {'; '.join(bad)}: unset them, or set "
                             "rollout.partial=false")

    def _check_env(self) -> None:
        env = self.env
        if env.default is not None and env.default not in env.names:
            raise ValueError(f"env.default={env.default!r} is not in env.environments {sorted(env.environments)}"
                             + (f" or env.agents {sorted(env.agents)}" if env.agents else ""))
        if env.enabled and env.max_episode_tokens is not None and env.max_episode_tokens < (
                self.data.max_prompt_tokens + self.rollout.max_new_tokens):
            raise ValueError(
                f"env.max_episode_tokens={env.max_episode_tokens} leaves no room for one turn: it must be at least "
                f"data.max_prompt_tokens + rollout.max_new_tokens = {self.data.max_prompt_tokens + self.rollout.max_new_tokens}"
            )
        if env.enabled and self.rollout.stop and self.rollout.backend == "hf":
            raise ValueError("rollout.stop needs rollout.backend=vllm (the hf fallback stops on EOS only)")

    @property
    def episode_tokens(self) -> int:
        """Returns the longest episode in tokens (env.max_episode_tokens, or its default; see its description)."""
        env = self.env
        if env.max_episode_tokens is not None:
            return env.max_episode_tokens
        return (self.data.max_prompt_tokens + env.max_turns * self.rollout.max_new_tokens
                + (env.max_turns - 1) * env.max_observation_tokens)

    def _check_reward_terms(self) -> None:
        names = self.reward.term_names
        metric = self.algo.dynamic_sampling_metric
        if self.algo.algorithm.dynamic_sampling and metric != "reward" and metric not in names:
            if metric in ("accuracy", "format"):
                raise ValueError(
                    f"algo.dynamic_sampling_metric={metric!r} was renamed: GSM8K's terms are reward functions now; use "
                    f"{'gsm8k_correct' if metric == 'accuracy' else 'gsm8k_format'} (a reward.functions entry's name)"
                )
            raise ValueError(
                f"algo.dynamic_sampling_metric={metric!r} is not a reward term; use 'reward' or one of the "
                f"reward.functions and reward.judges names {names}"
            )

    def _check_resources(self) -> None:
        res = self.resources
        _check_core_lists("resources.rollout.cpu_threads", res.rollout.cpu_threads, "resources.rollout.num_workers",
                          res.rollout.num_workers, "actor", words=("auto", "nobind"), example="'0-1', '1' or '0,2-3'")
        _check_core_lists("learner.cpu_affinity", self.learner.cpu_affinity, "resources.learner.num_workers",
                          res.learner.num_workers, "worker", words=(), example="'0', '0-1' or '0,2-3'")
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
        if self.model.adapter_path is not None and self.model.lora.rank:
            raise ValueError(
                f"model.adapter_path='{self.model.adapter_path}' with model.lora.rank={self.model.lora.rank}: the "
                "adapter brings its own LoRA settings; set model.lora.rank=0, or unset model.adapter_path"
            )
        if self.rollout.lora_sync == "adapter" and not self.trains_lora:
            raise ValueError("rollout.lora_sync='adapter' ships a LoRA adapter, but the policy trains every weight; set "
                             "model.lora.rank>0 or model.adapter_path, or rollout.lora_sync=auto")
        if self.rollout.lora_sync == "adapter" and sync in ("nccl", "ipc"):
            raise ValueError(f"rollout.lora_sync='adapter' ships the adapter through the object store, not "
                             f"rollout.weight_sync='{sync}'; set rollout.weight_sync=auto, or rollout.lora_sync=merged")
        if self.rollout.weight_payload == "delta" and (self.weight_sync_backend != "object_store" or self.adapter_sync):
            raise ValueError(f"rollout.weight_payload='delta' goes through the object store with merged weights, not "
                             f"rollout.weight_sync='{self.weight_sync_backend}' with rollout.lora_sync="
                             f"'{self.rollout.lora_sync}'; set rollout.weight_sync=object_store and rollout.lora_sync="
                             "merged (or auto), or rollout.weight_payload=full")
        if self.rollout.lora_sync == "adapter" and res.learner.strategy == "fsdp":
            raise ValueError("rollout.lora_sync='adapter' with resources.learner.strategy='fsdp': a sharded learner "
                             "pushes merged weights gathered on rank 0; set rollout.lora_sync=merged or auto")

    @property
    def trains_lora(self) -> bool:
        """Returns True when the policy trains LoRA adapters (model.lora.rank > 0 or model.adapter_path)."""
        return self.model.lora.rank > 0 or self.model.adapter_path is not None

    @property
    def adapter_sync(self) -> bool:
        """Returns the resolved rollout.lora_sync: True when a weight sync ships the LoRA adapter alone (auto: a LoRA
        policy with rollout actors on GPUs, unless rollout.weight_sync is nccl or ipc, the learner is sharded or
        rollout.weight_payload is delta)."""
        if self.rollout.lora_sync == "auto":
            return (self.trains_lora and self.resources.rollout.gpus > 0 and self.resources.learner.strategy != "fsdp"
                    and self.rollout.weight_sync in ("auto", "object_store") and self.rollout.weight_payload == "full")
        return self.rollout.lora_sync == "adapter"

    @property
    def weight_sync_backend(self) -> str:
        """Returns the resolved rollout.weight_sync: object_store, nccl or ipc (object_store for an adapter-only or a
        delta sync)."""
        if self.rollout.weight_sync != "auto":
            return self.rollout.weight_sync
        if self.adapter_sync or self.rollout.weight_payload == "delta":
            return "object_store"
        if self.resources.rollout.gpus == 0 or self.resources.learner.gpus == 0:
            return "object_store"
        return "ipc" if self.resources.colocate else "nccl"

    def _check_offline_sizes(self, world: int) -> Config:
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
