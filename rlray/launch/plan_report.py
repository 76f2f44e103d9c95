"""The planner's report: the layout it assumes, every role's memory against its budget, and the changes that make a
role fit (each evaluated by planning the changed config again)."""

from __future__ import annotations

from dataclasses import dataclass

from rlray.launch.plan import Plan, gpu_problems, plan_roles
from rlray.launch.plan_roles import RoleMemory, microbatch
from rlray.plan import ConfigError, RunPlan, replan

_WIDTH = 78  # the GiB column


@dataclass(frozen=True)
class Change:
    """A config change and the role's peak with it.

    Attributes:
        overrides: dotted ``key=value`` overrides.
        total_gib: the role's predicted peak with them (GiB).
        fits: the role fits its budget with them.
        note: a remark (e.g. more GPUs than the cluster has), or "".
    """

    overrides: tuple[str, ...]
    total_gib: float
    fits: bool
    note: str = ""


def replan_role(plan: Plan, role: str, overrides: list[str]) -> tuple[RoleMemory, tuple[str, ...]] | None:
    """Returns ``role``'s memory and the GPU problems of ``plan``'s run with ``overrides`` (its config edited and
    planned again, ``rlray.plan.replan``), or None when the changed config is not valid (e.g. LoRA with FSDP)."""
    try:
        run = replan(plan.run, overrides)[0]
    except ConfigError:
        return None
    roles = plan_roles(run, plan.models, plan.hardware, plan.dtype)
    return next(r for r in roles if r.role == role), gpu_problems(run, plan.hardware)


def learner_candidates(plan: Plan) -> list[str]:
    """Returns the single changes that lower a learner rank's memory, in the order the report tries them:
    checkpointing, FSDP, 8-bit AdamW, LoRA, the reference or teacher as their own actor."""
    gpu, run = plan.hardware is not None, plan.run
    cfg = run.settings
    out = [] if cfg.model.gradient_checkpointing else ["model.gradient_checkpointing=true"]
    if gpu and run.parallelism.strategy == "ddp":
        out.append("resources.learner.strategy=fsdp")
    if gpu and cfg.learner.optimizer == "adamw":
        out.append("learner.optimizer=adamw_8bit")
    if not cfg.model.lora.rank and cfg.model.adapter_path is None:
        out.append("model.lora.rank=16")
    if run.roles.reference_on_learner:
        out.append("resources.reference.placement=actor")
    if run.roles.teacher == "learner" and cfg.teacher.divergence == "reverse_kl":
        out.append("resources.teacher.placement=actor")
    return out


def rollout_candidates(plan: Plan) -> list[str]:
    """Returns the single changes that make a rollout engine fit: more tensor parallelism (up to 8), more engines (a
    smaller share of each step's sequences), a larger ``rollout.gpu_memory_utilization``."""
    cfg = plan.run.settings
    tp, engines = cfg.resources.rollout.tensor_parallel_size, plan.run.roles.rollout.count
    out = [f"resources.rollout.tensor_parallel_size={n}" for n in (2 * tp, 4 * tp, 8 * tp) if n <= 8]
    out.append(f"resources.rollout.num_workers={2 * engines}")
    if cfg.rollout.gpu_memory_utilization < 0.9 and not cfg.resources.colocate:
        out.append("rollout.gpu_memory_utilization=0.9")
    return out


def _microbatch_change(plan: Plan, role: str) -> list[str]:
    """Returns the largest halving of learner.sequences_per_microbatch (the micro-batch's tokens) that fits, or the
    smallest one, or [] at one sequence."""
    n = plan.run.parallelism.micro_batching.sequences
    tried: list[str] = []
    while n > 1 and plan.run.roles.online:
        n //= 2
        tried = [f"learner.sequences_per_microbatch={n}"]
        got = replan_role(plan, role, tried)
        if got is not None and got[0].fits:
            break
    return tried


def _over(role: RoleMemory) -> float:
    """Returns how far a role's peak is over its budget (GiB; negative when under; -inf without a budget)."""
    return role.total_gib - (role.budget_gib if role.budget_gib is not None else float("inf"))


def changes(plan: Plan, role: RoleMemory) -> list[Change]:
    """Returns each candidate change that brings a role closer to its budget (a lower peak or a larger budget), with
    its peak; then, when it takes more than one, the candidates together: each added in order (two passes) when the
    config stays valid and it brings the role closer, until it fits."""
    learner = role.role == "learner rank"
    candidates = (learner_candidates(plan) + _microbatch_change(plan, role.role)) if learner else rollout_candidates(plan)
    note = lambda problems: "needs more GPUs" if problems else ""  # noqa: E731
    out = []
    for override in candidates:
        got = replan_role(plan, role.role, [override])
        if got is not None and _over(got[0]) < _over(role):
            out.append(Change((override,), got[0].total_gib, got[0].fits, note(got[1])))
    combined: list[str] = []
    best, problems = role, ()
    for override in candidates * 2:  # twice: checkpointing helps only once FSDP has shrunk the optimizer step
        # a key already changed takes the new value instead (tensor parallel 2, then 4)
        trial = [o for o in combined if o.split("=")[0] != override.split("=")[0]] + [override]
        got = None if best.fits else replan_role(plan, role.role, trial)
        if got is not None and _over(got[0]) < _over(best):
            combined = trial
            best, problems = got
    if len(combined) > 1:
        out.append(Change(tuple(combined), best.total_gib, best.fits, note(problems)))
    return out


# --------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------
def format_plan(plan: Plan) -> str:
    """Returns the plan as text: model, hardware, layout and micro-batch, each role's terms against its budget, and
    for a role that does not fit the changes that lower it."""
    lines = [*_header(plan), ""]
    for role in plan.roles:
        lines += [*_role_lines(role), ""]
        if not role.fits and role.role in ("learner rank", "rollout engine"):
            lines += [*_change_lines(role, changes(plan, role)), ""]
    lines += [f"problem: {p}" for p in plan.problems]
    lines.append("fits" if plan.fits else "DOES NOT FIT")
    return "\n".join(lines)


def _header(plan: Plan) -> list[str]:
    """Returns the model, hardware, layout and micro-batch lines."""
    s, cfg = plan.models.policy, plan.run.settings
    tied = "tied" if s.tied_embeddings else "untied"
    lines = [f"model: {s.architecture} ({plan.models.policy_path}), {s.parameters / 1e9:.2f} B parameters: {s.num_layers} "
             f"layers, hidden {s.hidden_size}, MLP {s.intermediate_size}, {s.num_heads} heads ({s.num_kv_heads} KV) x "
             f"{s.head_dim}, vocabulary {s.vocab_size:,}, {tied} embeddings"]
    hw = plan.hardware
    if hw is None:
        lines.append(f"hardware: this machine's CPU; compute dtype {plan.dtype} (model.dtype={cfg.model.dtype})")
    else:
        count = "GPUs as the config asks" if hw.total_gpus is None else f"{hw.nodes} node(s) x {hw.gpus_per_node} GPUs"
        lines.append(f"hardware: {count} x {hw.gpu_memory_gib:g} GiB; compute dtype {plan.dtype} "
                     f"(model.dtype={cfg.model.dtype})")
    if plan.assumed:
        lines.append("layout assumed (the config asks for no GPUs); to run it, add: " + " ".join(plan.assumed))
    lines += [f"  {line}" for line in _layout(plan.run, plan.hardware is not None)]
    mb = microbatch(plan.run)
    lines.append(f"micro-batch per learner rank: {mb.sequences} sequences x ({mb.prompt_tokens} + {mb.response_tokens} "
                 f"tokens) = {mb.tokens:,} tokens ({mb.source}), every sequence padded to the longest: the worst case")
    if plan.run.roles.online:
        lines.append(f"context length: {plan.run.lengths.context_tokens:,} tokens (the rollout engines' max_model_len)")
    return lines


def _layout(run: RunPlan, gpu: bool) -> list[str]:
    """Returns one line per role: how many, where, which parallelism and what it holds."""
    cfg, par, roles = run.settings, run.parallelism, run.roles
    plan_gpu, gpu = gpu, gpu and par.gpu
    how = {"fsdp": "FSDP: parameters, gradients and optimizer state sharded over the ranks",
           "ddp": "DDP: every rank holds the whole model state"}.get(par.strategy, "one rank, no data parallelism")
    lora = f", LoRA rank {cfg.model.lora.rank}" if cfg.model.lora.rank else ""
    where = f"{roles.learner.gpus:g} GPU" if gpu else "CPU"
    lines = [f"learner: {par.world_size} rank(s) x {where}, {how}; {cfg.learner.optimizer}{lora}"]
    if roles.online:
        tp = cfg.resources.rollout.tensor_parallel_size
        gpus = (f"{tp} GPU(s), tensor parallel {tp}, gpu_memory_utilization "
                f"{cfg.rollout.gpu_memory_utilization:g}") if roles.rollout.gpus > 0 and plan_gpu else "CPU"
        lines.append(f"rollout: {roles.rollout.count} vLLM engine(s) x {gpus}"
                     + (", colocated" if cfg.resources.colocate else ""))
        if roles.reference != "off":
            frozen = (f"a frozen copy sharded over the {par.world_size} learner ranks" if par.sharded
                      else "a frozen copy on every learner rank")
            ref = {"learner": frozen, "lora_base": "the base model with the adapters off"}.get(roles.reference,
                                                                                              "its own actor")
            lines.append(f"reference: {ref} (algo.kl_coef={cfg.algo.kl_coef:g})")
        if roles.teacher != "off":
            held = "sharded over the learner ranks" if par.sharded else "on every learner rank"
            lines.append(f"teacher: {held if roles.teacher == 'learner' else 'its own actor'}")
        if roles.critic:
            lines.append("critic: a value model on every learner rank, with its own AdamW")
    return lines


def _role_lines(role: RoleMemory) -> list[str]:
    """Returns a role's heading, its terms with GiB, and its peak against the budget."""
    row = lambda name, value: f"  {name:<{_WIDTH - 2}}{value:>9}"  # noqa: E731
    lines = [f"{role.role}: {role.placement}".ljust(_WIDTH) + f"{'GiB':>9}"]
    lines += [row(t.name, f"{t.gib:.2f}") for t in role.terms]
    verdict = "" if role.budget_gib is None else (
        f"  of {role.budget_gib:.2f} ({role.budget_source}): " + ("fits" if role.fits else "DOES NOT FIT"))
    lines.append(row("= peak", f"{role.total_gib:.2f}") + verdict)
    return lines + [f"  {note}" for note in role.notes]


def _change_lines(role: RoleMemory, found: list[Change]) -> list[str]:
    """Returns the lines of the changes that lower a role's peak."""
    if not found:
        return [f"nothing the planner knows makes the {role.role} smaller; use larger GPUs or a smaller model"]
    lines = [f"to make the {role.role} fit: each change alone, then the changes together"]
    for c in found:
        tail = f"{'fits' if c.fits else 'over'}" + (f", {c.note}" if c.note else "")
        text = " ".join(c.overrides)
        if len(text) > _WIDTH - 3:  # a long combination on its own line, the figure under it
            lines.append(f"  {text}")
            text = ""
        lines.append(f"  {text:<{_WIDTH - 2}}{c.total_gib:>9.2f}  {tail}")
    return lines
