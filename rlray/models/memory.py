"""Memory arithmetic of a decoder-only transformer from its config.json alone (no weights are read).

Parameter counts, and the bytes of weights, optimizer state, activations and KV cache, for the Llama family that
rlray trains (Llama, Qwen2, Mistral, SmolLM: RMSNorm, rotary positions, grouped-query attention, a gated SiLU MLP of
gate, up and down projections). ``rlray.launch.plan`` adds them up per role.

Legend: h hidden size, f MLP intermediate size, L decoder layers, a attention heads, k KV heads, d head dim,
V vocabulary, c bytes of the compute dtype (2 bfloat16, 4 float32). Sizes are in bytes unless a name says ``_gib``.

Sources: parameter and optimizer-state accounting after Rajbhandari et al. 2020 (ZeRO) Sec. 3.1; activations per
token and layer after Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models")
Sec. 4.1 eq. 1-2, recounted for a Llama layer as the tensors PyTorch saves for backward (see
``layer_activation_bytes``); the KV cache as vLLM sizes it (Kwon et al. 2023, PagedAttention): 2 x L x k x d x dtype
bytes per token.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from rlray.models.loading import ModelError

GIB = 2**30
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw_8bit": 2}
"""Optimizer state per trainable parameter, bytes: AdamW keeps two float32 moments (Loshchilov & Hutter 2019);
bitsandbytes' AdamW8bit one byte per moment (Dettmers et al. 2022; its block-wise float32 scales add ~1.6%,
not counted)."""
LOGITS_BYTES = 8
"""Bytes per logit of the learner's response logits at their peak (start of backward): the float32 logits that the
logprob's backward keeps, plus the float32 (float32 run) or two bfloat16 (bf16 autocast) gradients of the lm_head
output (``rlray.learner.logprobs``: the logprob gradient is built in the logits' own storage)."""
ENTROPY_EXTRA_BYTES = 12
"""Extra bytes per logit with an entropy bonus: its softmax and product (float32), and a logits gradient of its own."""
JSD_EXTRA_BYTES = 40
"""Extra bytes per logit with the JSD distillation loss: the teacher's float32 logits and ~9 float32 [B, T, V]
intermediates of ``algos.generalized_jsd`` (log-softmaxes, mixture, KL terms); an estimate."""
KV_BLOCK_TOKENS = 16
"""vLLM's KV-cache block: a sequence holds whole blocks."""
_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_QKV_BIAS_TYPES = ("qwen2",)  # their config.json has no attention_bias key; q, k and v carry a bias
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers of a decoder-only LM that memory depends on (read from its config.json).

    Attributes:
        hidden_size: h. intermediate_size: f. num_layers: L. num_heads: a. num_kv_heads: k. head_dim: d.
        vocab_size: V. tied_embeddings: the lm_head shares the input embedding's [V, h] weight.
        qkv_bias: q, k and v projections carry a bias (Qwen2; Llama's ``attention_bias``).
        architecture: the config's first architecture name (for the report).
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool = False
    architecture: str = ""

    @property
    def attention_parameters(self) -> int:
        """Returns one layer's attention parameters: q [h, a d], k and v [h, k d], o [a d, h], and the q/k/v biases."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return 2 * h * q + 2 * h * kv + ((q + 2 * kv) if self.qkv_bias else 0)

    @property
    def mlp_parameters(self) -> int:
        """Returns one layer's MLP parameters: gate and up [h, f], down [f, h]."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def layer_parameters(self) -> int:
        """Returns one decoder layer's parameters: attention, MLP and its two RMSNorm weights [h]."""
        return self.attention_parameters + self.mlp_parameters + 2 * self.hidden_size

    @property
    def embedding_parameters(self) -> int:
        """Returns the input embedding's parameters, V x h."""
        return self.vocab_size * self.hidden_size

    @property
    def head_parameters(self) -> int:
        """Returns the lm_head's own parameters: V x h, or 0 when it is tied to the embedding."""
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    @property
    def parameters(self) -> int:
        """Returns every parameter: L layers, the embedding, the lm_head (untied) and the final norm [h]."""
        return (self.num_layers * self.layer_parameters + self.embedding_parameters + self.head_parameters
                + self.hidden_size)

    @property
    def linear_parameters(self) -> int:
        """Returns the parameters of every ``nn.Linear`` call: the layers' projections and the lm_head (tied or not).

        These are what bf16 autocast casts to bf16 (one bf16 copy each, kept for backward)."""
        return self.num_layers * (self.attention_parameters + self.mlp_parameters) + self.vocab_size * self.hidden_size

    @property
    def root_parameters(self) -> int:
        """Returns the parameters outside the decoder layers: embedding, lm_head (untied) and final norm (FSDP's root
        unit)."""
        return self.embedding_parameters + self.head_parameters + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Returns the KV-cache bytes of one token: 2 (K and V) x L x k x d x ``dtype_bytes`` (vLLM's page size per
        token)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def lora_parameters(self, rank: int, target_modules: list[str] | str) -> int:
        """Returns the trainable LoRA parameters: rank x (fan-in + fan-out) of every adapted projection (Hu et al.
        2021: A [r, in], B [out, r]).

        Args:
            rank: the adapter rank r (0: no LoRA, returns 0).
            target_modules: peft's ``target_modules``: 'all-linear' (every projection but the lm_head) or module
                names (q_proj, ..., down_proj, lm_head); other names count nothing.
        """
        h, f, q, kv = self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        dims = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h,
                "gate_proj": h + f, "up_proj": h + f, "down_proj": f + h}  # fmt: skip
        names = _LINEAR_NAMES if target_modules == "all-linear" else list(target_modules)
        per_layer = sum(dims.get(name, 0) for name in names)
        head = h + self.vocab_size if "lm_head" in names else 0
        return rank * (self.num_layers * per_layer + head)


def read_model_shape(folder: str | Path) -> ModelShape:
    """Returns the ``ModelShape`` of the model whose config.json is in ``folder`` (weights are neither needed nor read).

    A multimodal config's ``text_config`` is used when present. Missing ``num_key_value_heads`` means multi-head
    attention (k = a); missing ``head_dim`` means h / a; missing ``tie_word_embeddings`` means untied (transformers'
    default).

    Raises:
        ModelError: no readable config.json, a required number missing (names it), or a mixture-of-experts config
            (the planner counts dense decoders only).
    """
    path = Path(folder) / "config.json"
    try:
        conf = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelError(f"{path}: cannot read the model's config.json: {err}") from err
    text = conf.get("text_config") or conf
    if any(text.get(key) for key in _MOE_KEYS):
        raise ModelError(f"{path}: a mixture-of-experts model; the memory planner counts dense decoders only")
    try:
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        shape = ModelShape(
            hidden_size=hidden,
            intermediate_size=int(text["intermediate_size"]),
            num_layers=int(text["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            vocab_size=int(text["vocab_size"]),
            tied_embeddings=bool(conf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            qkv_bias=bool(text.get("attention_bias", text.get("model_type") in _QKV_BIAS_TYPES)),
            architecture=(conf.get("architectures") or [text.get("model_type", "")])[0],
        )
    except KeyError as err:
        raise ModelError(f"{path}: config.json has no {err.args[0]!r}, which the memory planner needs") from err
    return shape


# --------------------------------------------------------------------------------------------
# Bytes of one learner micro-batch
# --------------------------------------------------------------------------------------------
def layer_activation_bytes(shape: ModelShape, compute_bytes: int) -> int:
    """Returns the bytes one decoder layer keeps for backward per token (no gradient checkpointing).

    Counted as the tensors autograd saves in a Hugging Face Llama layer under SDPA (flash or memory-efficient
    attention, so no a x s^2 score matrix), after Korthikanti et al. 2022 eq. 1 (their 34 h bytes for a GPT layer)
    recounted for RMSNorm, grouped-query attention and a gated MLP:

    - float32 (4 bytes): the residual stream twice (the layer's input and the sum after attention, 2h) and the
      normalized x of both RMSNorms (2h);
    - compute dtype (c bytes): both norms' outputs as the projections' inputs (2h); q, k and v at the attention, K
      and V repeated to the a query heads (3 a d); the attention output and its contiguous copy for o_proj (2 a d);
      the MLP's gate, SiLU, up and product tensors (4f);
    - float32: the attention's log-sum-exp (a).

    Approximations: the rotary cos/sin and the attention mask (shared by the layers), LoRA's rank-r intermediates
    and autocast's transient float32 copies are not counted. Measured on CPU in float32 (SmolLM2-135M): within 2%.
    """
    h, f, a, ad = shape.hidden_size, shape.intermediate_size, shape.num_heads, shape.num_heads * shape.head_dim
    return 4 * (4 * h) + compute_bytes * (2 * h + 5 * ad + 4 * f) + 4 * a


def activation_bytes(shape: ModelShape, tokens: int, compute_bytes: int, *, checkpointing: bool) -> int:
    """Returns the activation bytes of one micro-batch of ``tokens`` tokens at the start of its backward.

    Without checkpointing: every layer's saved tensors (``layer_activation_bytes``) plus the final RMSNorm (8h per
    token). With gradient checkpointing (one checkpoint per decoder layer, as transformers' non-reentrant one):
    each layer's float32 input (4h per token) plus one layer recomputed in backward (Korthikanti et al. 2022
    Sec. 4.2: full recomputation keeps 2sbh per layer in half precision).

    Args:
        shape: the model.
        tokens: tokens in the micro-batch (prompt and response, padding included).
        compute_bytes: c, 2 under bf16 autocast, 4 in float32.
        checkpointing: ``model.gradient_checkpointing``.
    """
    h = shape.hidden_size
    per_layer = layer_activation_bytes(shape, compute_bytes)
    if checkpointing:
        return tokens * (shape.num_layers * 4 * h + per_layer + 8 * h)
    return tokens * (shape.num_layers * per_layer + 8 * h)


def logits_bytes(positions: int, vocab_size: int, *, entropy: bool = False, jsd: bool = False) -> int:
    """Returns the bytes of the response logits at their peak: ``positions`` x V x ``LOGITS_BYTES``, plus
    ``ENTROPY_EXTRA_BYTES`` (entropy bonus) and ``JSD_EXTRA_BYTES`` (JSD distillation) per logit.

    Args:
        positions: logit positions of the micro-batch: sequences x (response tokens + 1) (the learner computes the
            T + 1 last positions, ``logits_to_keep``).
        vocab_size: V.
    """
    per_logit = LOGITS_BYTES + (ENTROPY_EXTRA_BYTES if entropy else 0) + (JSD_EXTRA_BYTES if jsd else 0)
    return positions * vocab_size * per_logit


def frozen_copy_bytes(shape: ModelShape, compute_dtype: str) -> int:
    """Returns the bytes of a frozen copy (reference or teacher): float32, except that under bf16 the untied
    ``nn.Linear`` weights are stored in bf16 (``rlray.learner.logprobs.store_frozen_for_autocast``; a tied lm_head
    stays float32 with its embedding)."""
    if compute_dtype != "bfloat16":
        return 4 * shape.parameters
    linear = shape.num_layers * (shape.attention_parameters + shape.mlp_parameters) + shape.head_parameters
    return 2 * linear + 4 * (shape.parameters - linear)


def kv_cache_bytes(sequences: int, tokens_per_sequence: int, bytes_per_token: int) -> int:
    """Returns the KV-cache bytes that hold ``sequences`` sequences of up to ``tokens_per_sequence`` tokens at once,
    each in whole ``KV_BLOCK_TOKENS``-token blocks (vLLM's paging)."""
    return sequences * math.ceil(tokens_per_sequence / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS * bytes_per_token
