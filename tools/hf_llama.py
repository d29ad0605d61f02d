"""Hugging Face Llama <-> meshtrain: the config fields and the tensor names and layouts.

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

Refused (meshtrain cannot represent them): another architecture than LlamaForCausalLM, rope
scaling (Llama 3.1's `llama3` type included), attention or MLP biases, an activation other
than silu, mixtures of experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from configs.base import ConfigError, ModelConfig

ARCHITECTURE = "LlamaForCausalLM"
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
SIZES = (*REQUIRED, "num_key_value_heads", "head_dim")  # positive integers where given (the last two may be null)
NUMBERS = ("rope_theta", "rms_norm_eps", "initializer_range")  # numbers where given


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
# fused HF tensor -> the parameters whose HF tensors are its row blocks, in row order
FUSED: dict[str, tuple[tuple[str, ...], ...]] = {
    "model.layers.{i}.self_attn.qkv_proj.weight":
        (("blocks", "attn", "wq"), ("blocks", "attn", "wk"), ("blocks", "attn", "wv")),
    "model.layers.{i}.mlp.gate_up_proj.weight": (("blocks", "mlp", "w_gate"), ("blocks", "mlp", "w_up")),
}


def tensor_of(path: tuple[str, ...], tied: bool) -> Tensor:
    return TIED_HEAD if tied and path == ("head",) else TENSORS[path]


def hf_names(path: tuple[str, ...], n_layers: int, tied: bool = False) -> list[str]:
    """The HF tensors of one meshtrain parameter, in layer order."""
    t = tensor_of(path, tied)
    return [t.hf.format(i=i) for i in range(n_layers)] if "{i}" in t.hf else [t.hf]


def fused_names(n_layers: int) -> dict[str, list[str]]:
    """Each layer's fused HF tensor names -> the split names of its row blocks, in row order."""
    return {fused.format(i=i): [TENSORS[p].hf.format(i=i) for p in parts]
            for fused, parts in FUSED.items() for i in range(n_layers)}


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


def _check_fields(hf: dict) -> None:
    """Refuse a config.json that lacks a required size, or whose sizes are not positive integers
    or whose float fields are not numbers: one error naming every such field."""
    missing = [k for k in REQUIRED if hf.get(k) is None]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}: a Llama config.json (as transformers "
                          "saves it) gives them; re-download it or add them")
    bad = [f"{k}={hf[k]!r}" for k in SIZES if hf.get(k) is not None
           and (isinstance(hf[k], bool) or not isinstance(hf[k], int) or hf[k] < 1)]
    bad += [f"{k}={hf[k]!r}" for k in NUMBERS
            if k in hf and (isinstance(hf[k], bool) or not isinstance(hf[k], (int, float)))]
    if bad:
        raise ConfigError(f"config.json: {', '.join(bad)}: expected positive integers for the sizes and numbers "
                          f"for {', '.join(NUMBERS)}; fix config.json")


def model_config(hf: dict, base: ModelConfig) -> ModelConfig:
    """meshtrain's model for a HF config.json (dict); `base` gives the compute-only fields
    (attention, remat, compute_dtype); parameters in float32. Refuses what meshtrain cannot run."""
    arch = hf.get("architectures") or [hf.get("model_type", "?")]
    if arch != [ARCHITECTURE] or hf.get("model_type", "llama") != "llama":
        raise ConfigError(f"config.json: architecture {', '.join(map(str, arch))} (model_type "
                          f"{hf.get('model_type')!r}) is not supported; supported: {ARCHITECTURE} (model_type 'llama')")
    refused = {"attention_bias": True, "mlp_bias": True}
    for key, bad in refused.items():
        if hf.get(key) == bad:
            raise ConfigError(f"config.json: {key}={bad} is not supported (meshtrain's projections have no bias)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: hidden_act={hf['hidden_act']!r} is not supported; meshtrain's MLP is SwiGLU (silu)")
    if any(hf.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        raise ConfigError("config.json: a mixture-of-experts Llama is not supported; convert dense Llama models")
    _check_fields(hf)
    n_heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads, d_ff=hf["intermediate_size"],
        rope_theta=_rope_theta(hf), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        init_std=float(hf.get("initializer_range", base.init_std)), attention=base.attention,
        param_dtype="float32", compute_dtype=base.compute_dtype, remat=base.remat,
    )


def hf_config(m: ModelConfig, max_positions: int) -> dict:
    """The config.json transformers loads for meshtrain's model `m` (untied head); `max_positions`:
    the run's train.seq_len (meshtrain's rotary has no limit of its own)."""
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "vocab_size": m.vocab_size,
        "hidden_size": m.d_model, "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim, "intermediate_size": m.d_ff,
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "initializer_range": m.init_std, "max_position_embeddings": max_positions, "torch_dtype": m.param_dtype,
    }
