"""Config section teacher: on-policy distillation from a frozen teacher model, with any online algorithm."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlray.config.base import _Section


class TeacherConfig(_Section):
    """On-policy distillation: the student (the policy) samples, a frozen teacher scores the student's own tokens.

    The distillation term adds to whatever online algorithm ``algo.name`` runs, so it combines with a task
    reward; with no task reward (``reward.functions`` empty, no reward model) every sample's task reward is 0.0
    and the run is pure distillation (configs/distill_tiny.yaml). Where the teacher runs: ``resources.teacher``.
    The teacher's vocabulary must be the student's (checked at start).

    - reverse_kl: weight * -(log pi_student - log pi_teacher) of each sampled token is added to its advantage
      after stage 5 (``algos.reverse_kl_advantages``; Thinking Machines' on-policy distillation). Needs only the
      teacher's logprob of the sampled tokens, so the teacher may be its own actor.
    - jsd: weight * the generalized JSD over the full vocabulary is added to the per-token loss
      (``algos.generalized_jsd``; TRL's DistillationTrainer / GKD). Needs the teacher's full logits in the same
      micro-batch, so only with resources.teacher.placement=learner.
    """

    path: str | None = Field(
        None,
        description=(
            "The teacher: a local Hugging Face folder, a Hugging Face Hub id (org/name), a .gguf file or an alias "
            "(tiny-random@1, smollm2-135m-instruct), like model.path; None: no distillation."
        ),
    )
    revision: str | None = Field(
        None,
        description="The Hub revision (branch, tag or commit hash) of a Hub id in teacher.path; null: the repository's "
        "default branch. Ignored for folders, .gguf files and aliases.",
    )
    weight: float = Field(
        1.0,
        gt=0.0,
        description=(
            "Weight of the distillation term: advantage units per nat of per-token reverse KL (reverse_kl), or "
            "loss units per nat of per-token JSD (jsd)."
        ),
    )
    divergence: Literal["reverse_kl", "jsd"] = Field(
        "reverse_kl",
        description=(
            "reverse_kl: per-token reverse KL on the sampled tokens, added to the advantages (the teacher may run "
            "anywhere); jsd: generalized JSD with beta over the full vocabulary, added to the loss (teacher on the "
            "learner only)."
        ),
    )
    beta: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description=(
            "jsd only: interpolation beta in [0, 1] of the generalized JSD (0 forward KL(teacher||student), 1 "
            "reverse KL(student||teacher); TRL DistillationConfig.beta, default 0.5)."
        ),
    )

    @property
    def enabled(self) -> bool:
        """Returns True when a teacher is set (``path`` is not None)."""
        return self.path is not None

    @property
    def reverse_kl_weight(self) -> float:
        """Returns the reverse-KL advantage weight: ``weight`` with a reverse_kl teacher, else 0.0 (off)."""
        return self.weight if self.enabled and self.divergence == "reverse_kl" else 0.0

    @property
    def jsd_weight(self) -> float:
        """Returns the JSD loss weight: ``weight`` with a jsd teacher, else 0.0 (off)."""
        return self.weight if self.enabled and self.divergence == "jsd" else 0.0
