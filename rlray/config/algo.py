"""Config sections algo, critic, offline and learner: what is optimised and how."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from rlray.algos.registry import ALGORITHMS, Algorithm, algorithm_names, get_algorithm, load_algorithms
from rlray.config.base import CoreList, _Section


def _name_description() -> str:
    """Returns algo.name's description: the registered algorithms of each family (``rlray config --describe``)."""
    return (f"Online (rollouts on prompt data): {', '.join(algorithm_names('online'))}. Offline (preference pairs in "
            f"offline.pairs_files): {', '.join(algorithm_names('offline'))}.")


class RolloutCorrectionConfig(_Section):
    """Online: importance weights w = f(pi_old / pi_rollout) on the policy loss (``algos.rollout_correction_weights``).

    The rollout engine's probabilities differ from the learner's (kernels, precision, and in async mode a policy
    up to rollout.max_staleness versions older). The ratio is per token, or the product over the response
    (sequence modes); *_truncate clips it to [ratio_min, ratio_max], *_mask zeroes the token or sequence outside.

    The default, token_truncate with ratio_max 2.0 (Yao et al. 2025's TIS), keeps every sample and never
    depends on response length. TRL 1.16 defaults to sequence_mask with ratio_max 3.0; a sequence ratio is a
    product of hundreds of token ratios, so on long responses or stale async samples it leaves [C_min, C_max]
    often and masking then drops whole responses (watch algo/rollout_corrected_sequence_fraction). Set
    mode=sequence_mask, ratio_max=3.0 for TRL's behaviour.
    """

    mode: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field(
        "token_truncate",
        description=(
            "none (no correction), token_truncate (w_t = clip(r_t, min, max)), token_mask (w_t = r_t inside "
            "[min, max], else 0), sequence_truncate / sequence_mask (the same on r = prod_t r_t, on every token of "
            "the response); r_t = pi_old / pi_rollout of a sampled token (TRL vllm_importance_sampling_mode)."
        ),
    )
    ratio_min: float | None = Field(
        None, gt=0.0, le=1.0,
        description=(
            "Lower bound C_min on the ratio pi_old / pi_rollout (unitless, in (0, 1]); None: no lower bound "
            "(TRL vllm_importance_sampling_clip_min, default None)."
        ),
    )
    ratio_max: float | None = Field(
        2.0, ge=1.0,
        description=(
            "Upper bound C_max on the ratio pi_old / pi_rollout (unitless, >= 1; Yao et al. 2.0, TRL "
            "vllm_importance_sampling_clip_max 3.0); None: no upper bound."
        ),
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _none_word(cls, value: Any) -> Any:
        """The command line reads ``mode=none`` as null (``rlray.config.loading._parse_value``); it means "none"."""
        return "none" if value is None else value

    @model_validator(mode="after")
    def _check_bounds(self) -> RolloutCorrectionConfig:
        lo, hi = self.ratio_min, self.ratio_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(
                f"algo.rollout_correction.ratio_min={lo} must be below ratio_max={hi}; 1.0 (no mismatch) must lie inside"
            )
        if self.mode != "none" and lo is None and hi is None:
            raise ValueError(
                f"algo.rollout_correction.mode={self.mode!r} with ratio_min and ratio_max both null corrects nothing; "
                "set a bound (e.g. ratio_max: 2.0) or mode: none"
            )
        return self


class AlgoConfig(_Section):
    """The algorithm: online RL (advantage estimator, policy loss, KL, aggregation) or an offline method.

    One schema for every algorithm of the registry (``rlray.algos.registry``); each field says which algorithms
    read it. configs/algos/<name>.yaml holds each algorithm's recommended values (from its paper, TRL or verl).
    """

    name: str = Field("grpo", description=_name_description())
    user_algorithms: list[str] = Field(
        default_factory=list,
        description=(
            "Algorithms of your own code, each 'package.module:NAME' or 'path/to/file.py:NAME' naming an "
            "rlray.algos.Algorithm (a file path is made absolute here, so workers in another folder find it; the "
            "module or file must exist on every node, as environments' do). Every process that validates the config "
            "(the driver, each Ray Train worker, a sweep's trials) registers them before it reads algo.name "
            "(docs/adding_an_algorithm.md). [] = the built-in algorithms only."
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
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=lambda: RolloutCorrectionConfig(),
        description="Online: importance correction of the rollout engine's mismatch with the learner (TRL 1.16's four modes).",
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
            "dapo: rollout rounds per step to fill learner.prompts_per_step groups whose dynamic_sampling_metric varies "
            "(verl max_num_gen_batches); past it the step fails with a clear error."
        ),
    )
    dynamic_sampling_metric: str = Field(
        "reward",
        description=(
            "dapo: the reward term whose spread within a group keeps the group: 'reward' (the summed reward) or "
            "a reward.functions entry's name, e.g. 'gsm8k_correct' for raw correctness as in DAPO (verl "
            "filter_groups.metric)."
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
    mask_truncated: bool = Field(
        False,
        description=(
            "Online: leave responses that hit rollout.max_new_tokens (finish_reason 'length') out of the loss and "
            "its token normaliser (DAPO's overlong filtering; TRL mask_truncated_completions), counted per step in "
            "rollout/truncated_masked. Unlike TRL they also leave the group baseline (mean and std), as samples "
            "whose reward failed do; their rewards still count in reward/mean."
        ),
    )
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
    def algorithm(self) -> Algorithm:
        """Returns the registry entry of ``name`` (``rlray.algos.registry``): family, estimator, loss, extras."""
        return get_algorithm(self.name)

    @property
    def family(self) -> Literal["online", "offline"]:
        """Returns "online" (rollouts, rewards, advantages) or "offline" (preference pairs)."""
        return self.algorithm.family

    @field_validator("adv_std_scale", mode="before")
    @classmethod
    def _none_word(cls, value: Any) -> Any:
        """The command line reads ``adv_std_scale=none`` as null (``rlray.config.loading._parse_value``); it means
        "none"."""
        return "none" if value is None else value

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        if name not in ALGORITHMS:
            names = [repr(n) for n in ALGORITHMS]
            expected = f"{', '.join(names[:-1])} or {names[-1]}"
            raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
        return name

    @model_validator(mode="before")
    @classmethod
    def _load_user_algorithms(cls, data: Any) -> Any:
        """Registers ``user_algorithms`` (``rlray.algos.load_algorithms``) before ``name`` is validated, with each
        relative file path made absolute (the dumped config travels to workers that run in another folder)."""
        if not isinstance(data, dict) or not data.get("user_algorithms"):
            return data
        specs = data["user_algorithms"]
        if not isinstance(specs, list) or not all(isinstance(s, str) for s in specs):
            return data  # the field's own validation says what is wrong
        absolute = []
        for spec in specs:
            target, sep, name = spec.rpartition(":")
            if sep and (target.endswith(".py") or "/" in target) and Path(target).expanduser().is_file():
                spec = f"{Path(target).expanduser().resolve()}:{name}"
            absolute.append(spec)
        for i, spec in enumerate(absolute):
            try:
                load_algorithms([spec])
            except ValueError as err:
                raise ValueError(f"algo.user_algorithms[{i}]={specs[i]!r}: {str(err).removeprefix(repr(spec) + ': ')}") from err
        return {**data, "user_algorithms": absolute}

    @model_validator(mode="before")
    @classmethod
    def _retired_tis(cls, data: Any) -> Any:
        if isinstance(data, dict) and ("tis_cap" in data or "tis_level" in data):
            cap, level = data.get("tis_cap", 2.0), data.get("tis_level", "token")  # the retired keys' own defaults
            fix = (
                "algo.rollout_correction.mode=none" if cap is None
                else f"algo.rollout_correction.mode={level}_truncate and algo.rollout_correction.ratio_max={cap}"
            )  # fmt: skip
            raise ValueError(
                f"algo.tis_cap / algo.tis_level (tis_cap={cap!r}, tis_level={level!r}) were replaced by "
                f"algo.rollout_correction; write {fix}"
            )
        return data

    @model_validator(mode="after")
    def _check_algo(self) -> AlgoConfig:
        policy_loss = self.algorithm.policy_loss  # None for offline methods, which ignore the online fields
        if self.dual_clip is not None and policy_loss not in (None, "ppo_clip"):
            raise ValueError(
                f"algo.dual_clip={self.dual_clip}: dual-clip bounds the token-level PPO-clip loss, which "
                f"algo.name='{self.name}' does not use; set algo.dual_clip=null"
            )
        if policy_loss == "gspo" and max(self.clip_eps_low, self.clip_eps_high) > 0.01:
            warnings.warn(
                f"algo.name='{self.name}' with clip_eps_low={self.clip_eps_low}, clip_eps_high={self.clip_eps_high}: GSPO "
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
            "Checkpoint of the critic's trunk (folder, Hub id or alias, like model.path); None copies the policy "
            "checkpoint. A fresh value head (one output per token) is put on top."
        ),
    )
    model_revision: str | None = Field(
        None,
        description="The Hub revision (branch, tag or commit hash) of a Hub id in critic.model_path; null: the repository's "
        "default branch. Ignored for folders, .gguf files and aliases.",
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
            "JSONL files (.gz fine; local paths or fsspec URIs such as s3://) of rows in TRL's dataset forms: "
            "preference rows {prompt, chosen, rejected} (standard or conversational, explicit or implicit prompt; "
            "hh-rlhf dialogues too) for every offline method, unpaired {prompt, completion, label} rows for kto, "
            "{messages}, {prompt, completion} and {text} rows for sft (docs/data.md)."
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
        8, ge=1,
        description=(
            "Sequences per forward/backward on one rank (gradient accumulation unit), when tokens_per_microbatch "
            "is null."
        ),
    )
    tokens_per_microbatch: int | None = Field(
        None, ge=16,
        description=(
            "Token budget of one forward/backward on one rank, in the tokens it computes (packed: prompt + response, "
            "a shared prompt once; padded: rows x the longest row); sequences are binned by length to fill it, so "
            "micro-batches hold about the same work. null: cut by sequences_per_microbatch. Losses never depend on "
            "the cut (every aggregation divides by mini-batch counts). FSDP learners cut by sequences."
        ),
    )
    sequence_packing: Literal["auto", "on", "off"] = Field(
        "auto",
        description=(
            "Padding-free forwards: a micro-batch's sequences packed into one row, attention kept inside each "
            "sequence (torch SDPA per segment). auto: packed where the model can (a transformers model on sdpa "
            "attention without sliding-window layers), padded elsewhere; on: packed or an error; off: padded rows "
            "(the reference layout). Same logprobs and gradients up to float rounding."
        ),
    )
    share_prefixes: bool = Field(
        True,
        description=(
            "Rows with the same prompt (a GRPO group's samples, an episode group's) compute it once per "
            "micro-batch, and the tokens all of them share after it when packed; every continuation reads its "
            "keys and values, and its gradient is the sum over them. False: every row computes its own prompt."
        ),
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description=(
            "torch.set_num_threads in each learner worker (and the reference/teacher actor). None: rlray picks "
            "(rlray.run.build.core_plan): a synchronous run gives every stage all of the machine's cores "
            "(cores // learner workers); an async run on CPU splits them between rollout and learner."
        ),
    )
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

    @field_validator("sequence_packing", mode="before")
    @classmethod
    def _packing_words(cls, value: Any) -> Any:
        """YAML 1.1 reads the words on and off as booleans; they mean the modes "on" and "off" here."""
        if isinstance(value, bool):
            return "on" if value else "off"
        return value
