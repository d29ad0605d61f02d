"""Hugging Face Llama and Mixtral <-> meshtrain: the config fields and the tensor names and layouts.

Names and layouts (HF tensors are torch Linear weights, [out, in]; meshtrain's are [in, out]
with the heads split out, and every block parameter stacked over X layers):

  meshtrain                      HF (layer i)                                   layout
  embed.table      [V, D]        model.embed_tokens.weight         [V, D]       as is
  blocks.attn_norm.scale [X, D]  model.layers.i.input_layernorm.weight [D]      as is
  blocks.attn.wq   [X, D, N, H]  model.layers.i.self_attn.q_proj.weight [N*H, D]  W.T, split N*H
  blocks.attn.wk/wv [X, D, K, H] ...self_attn.k_proj/v_proj.weight [K*H, D]     W.T, split K*H
  blocks.attn.wo   [X, N, H, D]  ...self_attn.o_proj.weight        [D, N*H]     W.T, split N*H
  blocks.mlp_norm.scale [X, D]   ...post_attention_layernorm.weight [D]         as is
  blocks.mlp.w_gate/w_up [X, D, F] ...mlp.gate_proj/up_proj.weight [F, D]       W.T
  blocks.mlp.w_down [X, F, D]    ...mlp.down_proj.weight           [D, F]       W.T
  final_norm.scale [D]           model.norm.weight                 [D]          as is
  head             [D, V]        lm_head.weight [V, D] (model.embed_tokens.weight when tied)  W.T

Mixtral (MixtralForCausalLM: meshtrain's MoE model with every layer a mixture of experts, none
shared; MOE_TENSORS) replaces each layer's mlp.* by its block_sparse_moe.*:

  blocks.mlp.router [X, D, E]    model.layers.i.block_sparse_moe.gate.weight [E, D]   W.T
  blocks.mlp.w_gate/w_up [X, E, D, F]  ...block_sparse_moe.experts.e.w1/w3.weight [F, D]  W.T per expert
  blocks.mlp.w_down [X, E, F, D] ...block_sparse_moe.experts.e.w2.weight [D, F]       W.T per expert

one HF tensor per layer and expert, as transformers (4 and 5) saves and loads them. Its router is
meshtrain's: softmax over the E logits in fp32, top k, the k weights renormalised to sum 1; a
converted run routes dropless (every token reaches its k experts, as in transformers) and takes
router_aux_loss_coef as model.router_aux_loss, with no z-loss (Mixtral has none).

Fused layouts (read, LlamaForCausalLM only; FUSED): a layer may carry self_attn.qkv_proj.weight
[(N+2K)*H, D] (rows: q_proj's, then k_proj's, then v_proj's) instead of q/k/v_proj, and
mlp.gate_up_proj.weight [2F, D] (gate_proj's rows, then up_proj's) instead of gate/up_proj; each
part is a row range of the fused tensor. `--to-hf` writes the split tensors, which
transformers' LlamaForCausalLM loads.

Rotary: meshtrain rotates the halves (x[:H/2], x[H/2:]) of each head (model/layers.py
apply_rotary), which is HF's rotate_half convention with the same frequencies
theta^(-2j/H), so q_proj and k_proj need no permutation (tests/test_convert.py checks the logits
against transformers). Meshtrain has no tied head: a tied checkpoint gets head = embed.T, and
`--to-hf` writes both tensors (tie_word_embeddings false).

Refused (meshtrain cannot represent them): another architecture than LlamaForCausalLM or
MixtralForCausalLM, rope scaling (Llama 3.1's `llama3` type included), a sliding window,
attention or MLP biases, an activation other than silu, a Llama with experts; and on the way out
a MoE run with dense layers between (moe_every > 1) or shared experts, which Mixtral lacks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from configs.base import ConfigError, ModelConfig

ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "mixtral": ("MixtralForCausalLM", "mixtral")}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
SIZES = (*REQUIRED, "num_key_value_heads", "head_dim")  # positive integers where given (the last two may be null)
NUMBERS = ("rope_theta", "rms_norm_eps", "initializer_range", "router_aux_loss_coef")  # numbers >= 0 where given
POSITIVE = ("rope_theta", "rms_norm_eps", "initializer_range")  # of them, those that must be above 0
MIXTRAL_SIZES = ("num_local_experts", "num_experts_per_tok")  # required, positive integers


@dataclass(frozen=True)
class Tensor:
    """How one meshtrain parameter (per layer) comes from one HF tensor W [R, C]: the per-layer
    array is (W.T if transposed else W) reshaped to meshtrain's shape, whose first `row_dims`
    dimensions make up that 2-D view's rows."""

    hf: str  # the HF name; {i} is the layer
    transposed: bool
    row_dims: int = 1


# meshtrain parameter path (below `params`, without nnx's 'value') -> its HF tensor
TENSORS: dict[tuple[str, ...], Tensor] = {
    ("embed", "table"): Tensor("model.embed_tokens.weight", False),
    ("blocks", "attn_norm", "scale"): Tensor("model.layers.{i}.input_layernorm.weight", False),
    ("blocks", "attn", "wq"): Tensor("model.layers.{i}.self_attn.q_proj.weight", True),
    ("blocks", "attn", "wk"): Tensor("model.layers.{i}.self_attn.k_proj.weight", True),
    ("blocks", "attn", "wv"): Tensor("model.layers.{i}.self_attn.v_proj.weight", True),
    ("blocks", "attn", "wo"): Tensor("model.layers.{i}.self_attn.o_proj.weight", True, row_dims=2),
    ("blocks", "mlp_norm", "scale"): Tensor("model.layers.{i}.post_attention_layernorm.weight", False),
    ("blocks", "mlp", "w_gate"): Tensor("model.layers.{i}.mlp.gate_proj.weight", True),
    ("blocks", "mlp", "w_up"): Tensor("model.layers.{i}.mlp.up_proj.weight", True),
    ("blocks", "mlp", "w_down"): Tensor("model.layers.{i}.mlp.down_proj.weight", True),
    ("final_norm", "scale"): Tensor("model.norm.weight", False),
    ("head",): Tensor("lm_head.weight", True),
}
TIED_HEAD = Tensor("model.embed_tokens.weight", True)
# a Mixtral layer's mixture of experts in place of the dense MLP; {e} is the expert
MOE = "model.layers.{i}.block_sparse_moe"
MOE_TENSORS: dict[tuple[str, ...], Tensor] = {
    ("blocks", "mlp", "router"): Tensor(f"{MOE}.gate.weight", True),
    ("blocks", "mlp", "w_gate"): Tensor(f"{MOE}.experts.{{e}}.w1.weight", True),
    ("blocks", "mlp", "w_up"): Tensor(f"{MOE}.experts.{{e}}.w3.weight", True),
    ("blocks", "mlp", "w_down"): Tensor(f"{MOE}.experts.{{e}}.w2.weight", True),
}
# fused HF tensor -> the parameters whose HF tensors are its row blocks, in row order
FUSED: dict[str, tuple[tuple[str, ...], ...]] = {
    "model.layers.{i}.self_attn.qkv_proj.weight":
        (("blocks", "attn", "wq"), ("blocks", "attn", "wk"), ("blocks", "attn", "wv")),
    "model.layers.{i}.mlp.gate_up_proj.weight": (("blocks", "mlp", "w_gate"), ("blocks", "mlp", "w_up")),
}


def tensors(m: ModelConfig) -> dict[tuple[str, ...], Tensor]:
    """Every meshtrain parameter of model `m` -> its HF tensor: Llama's, or for a MoE model
    Mixtral's (its MLP a mixture of experts in every layer)."""
    if not m.n_experts:
        return TENSORS
    return {path: t for path, t in TENSORS.items() if path[:2] != ("blocks", "mlp")} | MOE_TENSORS


def tensor_of(path: tuple[str, ...], m: ModelConfig, tied: bool) -> Tensor:
    return TIED_HEAD if tied and path == ("head",) else tensors(m)[path]


def per_expert(t: Tensor) -> bool:
    """Whether `t` is one HF tensor per expert (Mixtral's experts.{e}): the meshtrain parameter
    is then [X, E, ...], each [X, e] one HF tensor."""
    return "{e}" in t.hf


def hf_names(path: tuple[str, ...], m: ModelConfig, tied: bool = False) -> list[str]:
    """The HF tensors of one meshtrain parameter: in layer order, and in expert order within a
    layer for a per-expert tensor (the order of the stacked array's [X(, E)] units)."""
    t = tensor_of(path, m, tied)
    if "{i}" not in t.hf:
        return [t.hf]
    experts = range(m.n_experts) if per_expert(t) else [0]
    return [t.hf.format(i=i, e=e) for i in range(m.n_layers) for e in experts]


def fused_names(m: ModelConfig) -> dict[str, list[str]]:
    """Each layer's fused HF tensor names -> the split names of its row blocks, in row order
    (q/k/v, and for a dense model gate/up)."""
    known = tensors(m)
    return {fused.format(i=i): [TENSORS[p].hf.format(i=i) for p in parts]
            for fused, parts in FUSED.items() if all(known.get(p) == TENSORS[p] for p in parts)
            for i in range(m.n_layers)}


def hf_shape(t: Tensor, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor's shape for a per-layer meshtrain `shape`."""
    if len(shape) == 1:
        return shape
    rows, cols = math.prod(shape[:t.row_dims]), math.prod(shape[t.row_dims:])
    return (cols, rows) if t.transposed else (rows, cols)


def _rope_theta(hf: dict) -> float:
    """rope_theta (transformers 4) or rope_parameters.rope_theta (transformers 5); refuses scaling."""
    params = hf.get("rope_parameters") or {}
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(hf.get(key) or {}, dict):
            raise ConfigError(f"config.json: {key}={hf[key]!r} is not an object {{rope_type: ...}}; fix config.json")
    scaling = hf.get("rope_scaling") or ({} if params.get("rope_type", "default") == "default" else params)
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        raise ConfigError(f"config.json: rope scaling {kind!r} is not supported (meshtrain's rotary has "
                          "none); supported: Llama checkpoints without rope_scaling (e.g. Llama 2, Llama 3)")
    return float(hf.get("rope_theta", params.get("rope_theta", 10_000.0)))


def _number(value: object, positive: bool) -> bool:
    """A JSON number (not a bool) above 0 (`positive`) or at least 0; NaN is neither."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value > 0 if positive else value >= 0


def _check_fields(hf: dict, architecture: str, required: tuple[str, ...] = ()) -> None:
    """Refuse a config.json that lacks a required size (REQUIRED and `required`), or whose sizes
    are not positive integers or whose float fields are not numbers: one error naming every
    such field."""
    missing = [k for k in (*REQUIRED, *required) if hf.get(k) is None]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}: a {architecture} config.json (as transformers "
                          "saves it) gives them; re-download it or add them")
    bad = [f"{k}={hf[k]!r}" for k in (*SIZES, *required) if hf.get(k) is not None
           and (isinstance(hf[k], bool) or not isinstance(hf[k], int) or hf[k] < 1)]
    bad += [f"{k}={hf[k]!r}" for k in NUMBERS if k in hf and not _number(hf[k], positive=k in POSITIVE)]
    if bad:
        raise ConfigError(f"config.json: {', '.join(bad)}: expected positive integers for the sizes, positive "
                          f"numbers for {', '.join(POSITIVE)} and a number >= 0 for router_aux_loss_coef; "
                          "fix config.json")


def model_config(hf: dict, base: ModelConfig) -> ModelConfig:
    """meshtrain's model for a HF config.json (dict); `base` gives the compute-only fields
    (attention, remat, compute_dtype); parameters in float32. Refuses what meshtrain cannot run."""
    arch = hf.get("architectures") or [hf.get("model_type", "?")]
    kind = next((k for k, (a, t) in ARCHITECTURES.items() if arch == [a] and hf.get("model_type", k) == t), None)
    if kind is None:
        supported = ", ".join(f"{a} (model_type {t!r})" for a, t in ARCHITECTURES.values())
        raise ConfigError(f"config.json: architecture {', '.join(map(str, arch))} (model_type "
                          f"{hf.get('model_type')!r}) is not supported; supported: {supported}")
    refused = {"attention_bias": True, "mlp_bias": True}
    for key, bad in refused.items():
        if hf.get(key) == bad:
            raise ConfigError(f"config.json: {key}={bad} is not supported (meshtrain's projections have no bias)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: hidden_act={hf['hidden_act']!r} is not supported; meshtrain's MLP is SwiGLU (silu)")
    if kind == "llama" and any(hf.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        raise ConfigError("config.json: a mixture-of-experts Llama is not supported; convert dense Llama or Mixtral")
    if hf.get("sliding_window") is not None:
        raise ConfigError(f"config.json: sliding_window={hf['sliding_window']!r} is not supported (meshtrain's "
                          "attention sees every earlier position); supported: sliding_window null")
    _check_fields(hf, ARCHITECTURES[kind][0], MIXTRAL_SIZES if kind == "mixtral" else ())
    n_heads = hf["num_attention_heads"]
    experts = {}
    if kind == "mixtral":
        if hf["num_experts_per_tok"] > hf["num_local_experts"]:
            raise ConfigError(f"config.json: num_experts_per_tok={hf['num_experts_per_tok']} is above "
                              f"num_local_experts={hf['num_local_experts']}; fix config.json")
        experts = {"n_experts": hf["num_local_experts"], "experts_per_token": hf["num_experts_per_tok"],
                   "expert_d_ff": hf["intermediate_size"], "moe_every": 1, "moe_dispatch": "dropless",
                   "router_aux_loss": float(hf.get("router_aux_loss_coef", 0.0)), "router_z_loss": 0.0}
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads, d_ff=hf["intermediate_size"],
        rope_theta=_rope_theta(hf), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        init_std=float(hf.get("initializer_range", base.init_std)), attention=base.attention,
        param_dtype="float32", compute_dtype=base.compute_dtype, remat=base.remat, **experts,
    )


def hf_config(m: ModelConfig, max_positions: int) -> dict:
    """The config.json transformers loads for meshtrain's model `m` (untied head): Llama's, or
    Mixtral's for a MoE model; `max_positions`: the run's train.seq_len (meshtrain's rotary has
    no limit of its own)."""
    kind = "mixtral" if m.n_experts else "llama"
    config = {
        "architectures": [ARCHITECTURES[kind][0]], "model_type": kind, "vocab_size": m.vocab_size,
        "hidden_size": m.d_model, "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim, "intermediate_size": m.d_ff,
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "initializer_range": m.init_std, "max_position_embeddings": max_positions, "torch_dtype": m.param_dtype,
    }
    if m.n_experts:
        config |= {"intermediate_size": m.expert_d_ff or m.d_ff, "num_local_experts": m.n_experts,
                   "num_experts_per_tok": m.experts_per_token, "router_aux_loss_coef": m.router_aux_loss,
                   "output_router_logits": False, "sliding_window": None}
    return config
