"""The planner's roles: the predicted peak memory of one process of each role of a run (``RoleMemory``).

``rlray.launch.plan`` puts them together for a config and a cluster; ``rlray.launch.plan_report`` prints them and
the changes that make a role fit. The arithmetic and its sources are in ``rlray.models.memory``.

What it assumes, role by role:

- learner rank: float32 master weights, float32 gradients and the optimizer state on every rank (DDP), or a 1/N
  shard of each (FSDP2, per decoder layer, ``MixedPrecisionPolicy(param_dtype=compute dtype)``: the gathered
  root unit and two layers in the compute dtype, and their float32 gradients before the reduce-scatter; no
  autocast copies); DDP's all-reduce buckets (a second copy of the gradients: ``gradient_as_bucket_view`` is off in
  ``ray.train.torch.prepare_model``); under bf16 autocast a bf16 copy of every linear weight for backward; the
  activations of one micro-batch and its response logits; the reference, teacher and PPO critic held on the rank
  (under FSDP2 the reference and teacher as 1/N shards in the compute dtype; their gathers run outside the update).
  The peak is the static memory plus the larger of the update (activations) and the optimizer step (CUDA's foreach
  AdamW keeps one float32 temporary per parameter).
- rollout engine (vLLM): per GPU of an engine, weights / tensor parallelism, vLLM's profiling peak, and the KV
  cache of the engine's share of a step's sequences, inside ``rollout.gpu_memory_utilization`` of the GPU.
- reference, teacher (own actors) and reward model: a frozen copy and, for the actors, one no-grad micro-batch.
- every process adds a runtime overhead: ``CUDA_RUNTIME_GIB`` on a GPU, ``CPU_RUNTIME_GIB`` on the CPU.
- no-grad passes (reference and old logprobs before the update) need less than the update and are not counted.

The micro-batch is counted in tokens (``MicroBatch``): the micro-batching in force on a rank (``rlray.plan``: an FSDP
learner cuts by learner.sequences_per_microbatch, its token budget unused) x (prompt + response tokens), every
sequence padded to the longest (the worst case; the shared-prompt forward only lowers it). The roles' placements,
the context length and the parallelism are the run's own (``rlray.plan.resolve_plan``), never decided here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from rlray.models import memory as mem
from rlray.models import resolve_model_path
from rlray.models.memory import GIB, ModelShape
from rlray.plan import RunPlan

CUDA_RUNTIME_GIB = 1.5
"""Per GPU process beyond its tensors: CUDA context and kernels (~0.5 GiB), NCCL buffers and the caching allocator's
fragmentation. An estimate, not measured here (benchmarks/gpu_check.py prints the measured tensors' peak)."""
CPU_PROCESS_GIB = 0.55
"""Per CPU process, resident before any model: torch, transformers, ray and rlray's learner imported (0.56 GiB
measured on this project's CPU machine; tests/launch/measure_peak.py's baseline)."""
CPU_ALLOCATOR_GIB = 0.15
"""Per CPU process, beyond its live tensors in the steady state: glibc's heap keeps freed blocks (gradients freed
at each step, activations of other sizes) and autograd's buffers; 0.03-0.15 GiB measured with one micro-batch,
more with several (the planner is then ~13% under for SmolLM2-135M, tests/launch/test_plan.py)."""
CPU_RUNTIME_GIB = CPU_PROCESS_GIB + CPU_ALLOCATOR_GIB
CPU_FSDP_ALLOCATOR_GIB = 0.03
"""``CPU_ALLOCATOR_GIB`` of an FSDP2 rank: ``rlray.learner.parallel.FSDP2`` fixes glibc's mmap threshold at 1 MiB, so
freed blocks from 1 MiB up go back to the OS (tiny-random, 2 ranks: 0.25 GiB measured over the baseline)."""
VLLM_PROFILE_TOKENS = 8192
"""Tokens of vLLM's profiling forward (max_num_batched_tokens) that sets its activation peak; an assumption."""
VLLM_PROFILE_SEQUENCES = 256
"""Sequences whose float32 logits and probabilities vLLM's profiling sampler holds (max_num_seqs); an assumption."""


@dataclass(frozen=True)
class Hardware:
    """The GPUs to plan for: ``nodes`` x ``gpus_per_node`` GPUs of ``gpu_memory_gib`` each (None: not given)."""

    gpus_per_node: int | None
    nodes: int
    gpu_memory_gib: float

    @property
    def total_gpus(self) -> int | None:
        """Returns the GPUs of the cluster, or None when their number was not given."""
        return None if self.gpus_per_node is None else self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Term:
    """One line of a role's memory: ``gib`` GiB; ``phase`` "static" (always held), "cache" (held, but the process
    runs with less, slower: vLLM's KV cache), "update" (forward/backward), "step" (optimizer step), or "shown" (an
    alternative, not counted: the activations with checkpointing toggled)."""

    name: str
    gib: float
    phase: str = "static"


@dataclass(frozen=True)
class RoleMemory:
    """The predicted peak memory of one process of a role, against its budget.

    Attributes:
        role: "learner rank", "rollout engine", "reference actor", "teacher actor" or "reward model".
        placement: where and how many, e.g. "4 ranks x 1 GPU, DDP".
        terms: the memory lines.
        budget_gib: what the process may use (GiB), or None when unknown (host memory without a cap).
        budget_source: where the budget comes from (config keys, GPU size).
        notes: remarks printed under the role.
    """

    role: str
    placement: str
    terms: tuple[Term, ...]
    budget_gib: float | None = None
    budget_source: str = ""
    notes: tuple[str, ...] = ()

    @property
    def total_gib(self) -> float:
        """Returns the peak: static terms plus the larger of the update and the optimizer-step terms (GiB)."""
        phase = lambda p: sum(t.gib for t in self.terms if t.phase == p)  # noqa: E731
        return phase("static") + phase("cache") + max(phase("update"), phase("step"))

    @property
    def minimum_gib(self) -> float:
        """Returns the peak without the "cache" terms: below the budget the process starts, if slower (GiB)."""
        return self.total_gib - sum(t.gib for t in self.terms if t.phase == "cache")

    @property
    def fits(self) -> bool:
        """Returns True when the peak is within the budget (or no budget is known)."""
        return self.budget_gib is None or self.total_gib <= self.budget_gib


@dataclass(frozen=True)
class MicroBatch:
    """One learner micro-batch per rank, in tokens: ``sequences`` x (``prompt_tokens`` + ``response_tokens``),
    padded. ``source`` says which config fields give it."""

    sequences: int
    prompt_tokens: int
    response_tokens: int
    source: str

    @property
    def tokens(self) -> int:
        """Returns the tokens of the micro-batch (padding included)."""
        return self.sequences * (self.prompt_tokens + self.response_tokens)

    @property
    def logit_positions(self) -> int:
        """Returns the positions whose full-vocabulary logits the learner computes: sequences x (response + 1)."""
        return self.sequences * (self.response_tokens + 1)


@dataclass(frozen=True)
class Models:
    """The shapes of the run's models (None: the role is off), and where the policy's came from."""

    policy: ModelShape
    policy_path: str
    critic: ModelShape | None = None
    teacher: ModelShape | None = None
    reward: ModelShape | None = None


def gib(nbytes: float) -> float:
    """Returns ``nbytes`` in GiB."""
    return nbytes / GIB


def read_models(plan: RunPlan) -> Models:
    """Returns the shapes of the policy, PPO's critic, the teacher and the reward model, from their config.json.

    Aliases resolve as for a run (``resolve_model_path``); a folder with config.json alone is enough. A reward model
    that is not a local folder (an s3:// snapshot) is left out.

    Raises:
        rlray.models.ModelError: a model path cannot be resolved or its config.json read.
    """
    cfg = plan.settings
    policy = mem.read_model_shape(resolve_model_path(cfg.model.path, revision=cfg.model.revision))
    critic = None
    if plan.roles.critic:
        critic = (mem.read_model_shape(resolve_model_path(cfg.critic.model_path, revision=cfg.critic.model_revision))
                  if cfg.critic.model_path else policy)  # fmt: skip
    teacher = mem.read_model_shape(resolve_model_path(cfg.teacher.path, revision=cfg.teacher.revision)) if plan.roles.teacher != "off" else None
    reward = None
    if cfg.reward.model_path is not None:
        folder = next((p for p in (Path(cfg.reward.model_path), Path(cfg.reward.model_path) / "model")
                       if (p / "config.json").is_file()), None)
        reward = mem.read_model_shape(folder) if folder else None
    return Models(policy, cfg.model.path, critic, teacher, reward)


def microbatch(plan: RunPlan) -> MicroBatch:
    """Returns one learner rank's micro-batch: its sequences and their padded prompt and response tokens.

    The one place that turns batch fields into tokens: a token budget per micro-batch gives ``tokens`` directly
    (the activations take tokens; the logits take positions, sequences x (response + 1))."""
    if not plan.roles.online:
        off = plan.settings.offline
        return MicroBatch(2 * off.pairs_per_microbatch, off.max_prompt_tokens, off.max_response_tokens,
                          "2 x offline.pairs_per_microbatch x (offline.max_prompt_tokens + offline.max_response_tokens)")
    lengths, batching = plan.lengths, plan.parallelism.micro_batching
    prompt, response = lengths.prompt_tokens, lengths.response_tokens
    longest = "the longest episode (env.max_episode_tokens)" if lengths.episode_tokens is not None else \
        "(data.max_prompt_tokens + rollout.max_new_tokens)"
    budget = batching.tokens
    if budget is not None:  # rows binned to fill the budget: as many longest rows as reach it (at least one)
        return MicroBatch(max(1, math.ceil(budget / (prompt + response))), prompt, response,
                          f"learner.tokens_per_microbatch={budget:,} in whole sequences of {longest}")
    configured = plan.parallelism.frozen_micro_batching.tokens  # the configured budget, dropped under FSDP
    unused = " (FSDP cuts by sequences: learner.tokens_per_microbatch unused)" if configured else ""
    return MicroBatch(batching.sequences, prompt, response, f"learner.sequences_per_microbatch x {longest}{unused}")


def context_tokens(plan: RunPlan) -> int:
    """Returns a rollout engine's context length in tokens: the run plan's ``lengths.context_tokens``, which the
    driver gives the engines as max_model_len."""
    return plan.lengths.context_tokens


def _critic_parameters(shape: ModelShape) -> tuple[int, int]:
    """Returns (parameters, linear parameters) of a value model on ``shape``'s trunk (``rlray.models.load_value_model``):
    no lm_head, a [h, 1] score head with a bias."""
    head = shape.hidden_size + 1
    linear = shape.num_layers * (shape.attention_parameters + shape.mlp_parameters) + head
    return shape.parameters - shape.head_parameters + head, linear


def _lora(plan: RunPlan) -> tuple[int, list[str] | str] | None:
    """Returns (rank, target modules) of the policy's LoRA (model.lora, or model.adapter_path's adapter_config.json),
    or None when every weight trains."""
    cfg = plan.settings
    if cfg.model.lora.rank:
        return cfg.model.lora.rank, cfg.model.lora.target_modules
    if cfg.model.adapter_path is None:
        return None
    conf = json.loads((Path(cfg.model.adapter_path) / "adapter_config.json").read_text())
    return int(conf["r"]), conf.get("target_modules") or "all-linear"


# --------------------------------------------------------------------------------------------
# Roles
# --------------------------------------------------------------------------------------------
def learner_rank(plan: RunPlan, models: Models, *, dtype: str, gpu: bool, budget: tuple[float | None, str]) -> RoleMemory:
    """Returns the peak memory of one learner rank (the policy's model state, one micro-batch's update, the models
    it holds and the runtime), against ``budget`` (GiB, source)."""
    par = plan.parallelism
    terms = [*_state_terms(plan, models.policy, dtype, gpu), *_update_terms(plan, models.policy, dtype),
             *_held_terms(plan, models, dtype)]
    slack = CPU_FSDP_ALLOCATOR_GIB if par.sharded else CPU_ALLOCATOR_GIB
    runtime = ("CUDA context, NCCL, allocator", CUDA_RUNTIME_GIB) if gpu else ("torch, transformers, ray; allocator slack",
                                                                              CPU_PROCESS_GIB + slack)
    terms.append(Term(f"runtime: {runtime[0]}", runtime[1]))
    where = f"{plan.roles.learner.gpus:g} GPU" if gpu else "CPU"
    placement = f"{par.world_size} ranks x {where}, {par.strategy.upper()}" if par.world_size > 1 else f"1 rank x {where}"
    notes = ("PPO's critic updates after the policy: its activations are not at the peak",) if models.critic else ()
    return RoleMemory("learner rank", placement, tuple(terms), budget[0], budget[1], notes)


def _state_terms(plan: RunPlan, shape: ModelShape, dtype: str, gpu: bool) -> list[Term]:
    """Returns the policy's weights, gradients and optimizer state on one rank (sharded under FSDP), DDP's buckets or
    FSDP's gathered units, and the optimizer step's temporaries."""
    par, optimizer = plan.parallelism, plan.settings.learner.optimizer
    world, fsdp = par.world_size, par.sharded
    shard = world if fsdp else 1
    of = f", 1/{world} shard" if fsdp else ""
    lora = _lora(plan)
    trainable = shape.lora_parameters(*lora) if lora else shape.parameters
    terms = [Term(f"weights: float32 masters{of}", gib(4 * shape.parameters / shard))]
    if lora:
        terms = [Term("weights: frozen float32 base", gib(4 * shape.parameters)),
                 Term(f"LoRA adapters: rank {lora[0]}, {trainable / 1e6:,.1f} M parameters, float32", gib(4 * trainable))]
    state = mem.OPTIMIZER_STATE_BYTES[optimizer]
    terms += [Term(f"gradients: float32{of}", gib(4 * trainable / shard)),
              Term(f"optimizer state: {optimizer}, {state} bytes per trained parameter{of}",
                   gib(state * trainable / shard))]
    if not fsdp and world > 1:
        terms.append(Term("DDP all-reduce buckets: a second copy of the gradients", gib(4 * trainable)))
    if fsdp:
        c = mem.DTYPE_BYTES[dtype]
        gathered = (shape.root_parameters + 2 * shape.layer_parameters) * c
        grads = (shape.root_parameters + shape.layer_parameters) * 4
        terms.append(Term("FSDP gathered: root unit and 2 layers, and their gradients", gib(gathered + grads), "update"))
    if gpu and optimizer == "adamw":
        terms.append(Term(f"AdamW step: foreach float32 temporaries{of}", gib(4 * trainable / shard), "step"))
    return terms


def _update_terms(plan: RunPlan, shape: ModelShape, dtype: str) -> list[Term]:
    """Returns the terms of one micro-batch's forward/backward: autocast's bf16 weight copies (not under FSDP's
    mixed precision), the activations with checkpointing as configured (and, shown only, toggled), the logits."""
    mb, c, cfg = microbatch(plan), mem.DTYPE_BYTES[dtype], plan.settings
    terms = []
    if dtype == "bfloat16" and not plan.parallelism.sharded:
        terms.append(Term("bf16 copies of the linear weights (autocast, kept for backward)",
                          gib(2 * shape.linear_parameters), "update"))
    on = cfg.model.gradient_checkpointing
    for ckpt in (on, not on):
        name = f"activations: {mb.tokens:,} tokens, checkpointing {'on' if ckpt else 'off'}"
        size = gib(mem.activation_bytes(shape, mb.tokens, c, checkpointing=ckpt))
        terms.append(Term(name if ckpt == on else f"  ({name}: not counted)", size, "update" if ckpt == on else "shown"))
    if cfg.algo.name != "reward_model":  # a reward model scores sequences: no vocabulary logits
        entropy = plan.roles.online and cfg.algo.entropy_coef > 0
        size = mem.logits_bytes(mb.logit_positions, shape.vocab_size, entropy=entropy, jsd=cfg.teacher.jsd_weight > 0)
        terms.append(Term(f"logits: {mb.logit_positions:,} positions x {shape.vocab_size:,} vocabulary", gib(size), "update"))
    return terms


def _held_terms(plan: RunPlan, models: Models, dtype: str) -> list[Term]:
    """Returns the models a learner rank holds besides the policy: the reference and teacher copies (1/N shards under
    FSDP2, in the compute dtype: ``rlray.learner.parallel.FSDP2.frozen``), PPO's critic."""
    terms = []
    world, fsdp = plan.parallelism.world_size, plan.parallelism.sharded
    for role, shape in (("reference", models.policy if plan.roles.reference_on_learner else None),
                        ("teacher", models.teacher if plan.roles.teacher == "learner" else None)):
        if shape is None:
            continue
        if fsdp:
            terms.append(Term(f"{role}: frozen copy, {dtype}, 1/{world} shard",
                              gib(mem.DTYPE_BYTES[dtype] * shape.parameters / world)))
        else:
            frozen = "bf16 linear weights" if dtype == "bfloat16" else "float32"
            terms.append(Term(f"{role}: frozen copy, {frozen}", gib(mem.frozen_copy_bytes(shape, dtype))))
    if models.critic is not None:
        params, _ = _critic_parameters(models.critic)
        per = (16 / world) if fsdp else 16 + (4 if world > 1 else 0)
        terms.append(Term("PPO critic: weights, gradients, AdamW state" + ("" if fsdp or world == 1 else ", DDP buckets"),
                          gib(per * params)))
    return terms


def rollout_engine(plan: RunPlan, shape: ModelShape, *, dtype: str, hardware: Hardware | None) -> RoleMemory:
    """Returns the memory of one rollout engine per GPU (weights / tensor parallelism, vLLM's profiling peak, the KV
    cache of its share of a step), against ``rollout.gpu_memory_utilization`` of the GPU; on the CPU (``hardware``
    None), one actor's weights and KV cache (``rollout.kv_cache_gib``, or the size that
    ``rlray.launch.actors.auto_kv_cache_gib`` picks)."""
    cfg, c, engines = plan.settings, mem.DTYPE_BYTES[dtype], plan.roles.rollout.count
    tp = cfg.resources.rollout.tensor_parallel_size if hardware else 1
    sequences = max(math.ceil(cfg.sequences_per_step / engines), math.ceil(cfg.eval.num_problems / engines), 1)
    tokens = plan.lengths.context_tokens  # the driver's max_model_len
    per_token = 2 * shape.num_layers * math.ceil(shape.num_kv_heads / tp) * shape.head_dim * c
    kv = mem.kv_cache_bytes(sequences, tokens, per_token)
    weights = Term(f"weights: {dtype}" + (f", 1/{tp} (tensor parallel)" if tp > 1 else ""), gib(c * shape.parameters / tp))
    if hardware is None:
        kv_gib = cfg.rollout.kv_cache_gib or math.ceil(gib(kv * 1.25) * 64) / 64
        terms = (weights, Term(f"KV cache: {sequences} sequences x {tokens} tokens (+25%)", kv_gib),
                 Term("runtime: a CPU process (the learner's figure; an estimate)", CPU_RUNTIME_GIB))
        return RoleMemory("rollout engine", f"{engines} actor(s) on the CPU", terms)
    h, f, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    profile = VLLM_PROFILE_TOKENS * c * (3 * f + (shape.num_heads + 2 * shape.num_kv_heads) * d + 2 * h) / tp
    sampler = VLLM_PROFILE_SEQUENCES * shape.vocab_size * 8
    fixed = (weights, Term("activations: vLLM's profiling peak (estimate)", gib(profile + sampler)),
             Term("runtime: CUDA context, NCCL, allocator", CUDA_RUNTIME_GIB))
    util = cfg.rollout.gpu_memory_utilization
    budget = util * hardware.gpu_memory_gib
    room = budget - sum(t.gib for t in fixed)
    holds = max(0, math.floor(room * GIB / mem.kv_cache_bytes(1, tokens, per_token)))
    name = f"KV cache: {sequences} sequences x {tokens:,} tokens x {per_token / 1024:,.0f} KiB"
    notes = (f"vLLM fills the rest of its {budget:.1f} GiB with KV cache: {room:.1f} GiB, {holds:,} sequences of "
             f"{tokens:,} tokens at once" + ("" if holds >= sequences else "; vLLM queues or preempts the rest"),)
    if room <= 0:
        notes = (f"vLLM cannot start: weights, activations and runtime alone exceed its {budget:.1f} GiB",)
    placement = f"{engines} engine(s) x {tp} GPU(s) (tensor parallel {tp}), per GPU"
    return RoleMemory("rollout engine", placement, (*fixed, Term(name, gib(kv), "cache")), budget,
                      f"rollout.gpu_memory_utilization {util:g} x {hardware.gpu_memory_gib:g} GiB", notes)


def frozen_actor(role: str, shape: ModelShape, plan: RunPlan, *, dtype: str, gpus: float,
                 hardware: Hardware | None) -> RoleMemory:
    """Returns the memory of a reference or teacher actor: the frozen copy and one no-grad micro-batch (what one layer
    keeps for backward, as a bound of a no-grad layer's temporaries, and the float32 logits with their chunked
    log-sum-exp, 8 bytes per logit)."""
    mb, c = microbatch(plan), mem.DTYPE_BYTES[dtype]
    forward = mb.tokens * mem.layer_activation_bytes(shape, c) + mb.logit_positions * shape.vocab_size * 8
    on_gpu = hardware is not None and gpus > 0
    terms = (Term(f"weights: frozen copy, {'bf16 linear weights' if dtype == 'bfloat16' else 'float32'}",
                  gib(mem.frozen_copy_bytes(shape, dtype))),
             Term(f"no-grad forward: {mb.tokens:,} tokens", gib(forward), "update"),
             Term("runtime", CUDA_RUNTIME_GIB if on_gpu else CPU_RUNTIME_GIB))
    budget = (hardware.gpu_memory_gib, f"{hardware.gpu_memory_gib:g} GiB GPU") if on_gpu else (None, "")
    return RoleMemory(role, f"1 actor, {gpus:g} GPU" if on_gpu else "1 actor on the CPU", terms, *budget)


def reward_model(plan: RunPlan, shape: ModelShape) -> RoleMemory:
    """Returns the reward model's memory (float32 weights, ``rlray.models.heads.load_reward_model``) in its process."""
    roles = plan.roles
    where = f"{roles.reward.count} Serve replica(s)" if roles.reward_server else "in learner rank 0's process (host memory)"
    params = shape.parameters - shape.head_parameters + shape.hidden_size
    return RoleMemory("reward model", where, (Term("weights: float32", gib(4 * params)),))
