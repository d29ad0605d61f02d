"""What one layer, the device's layers, and one 1F1B-family pipeline chunk keep for backward,
per microbatch, in bytes (the `saved activations` and `working` terms of tools/estimate.py),
and the experts' zero-padded copies under XLA's ragged_dot. Letters as in tools/shape.py.

Per layer and token, in elements (c bytes each unless fp32 is said):
  remat none  4·D (block inputs, norm outputs) + (N+2K)·H/t (q, k, v)
              + N·H/t (output) + 3·F/t (gate, up, hidden: silu(gate) is recomputed
              in the backward, model.mlp.swiglu); a fused core (pallas, cudnn) adds its
              fp32 logsumexp, 4·N/t bytes; the xla core adds 2·N·H/t (K, V
              repeated to N heads) and 2·N/t·L fp32 (two copies of the scores
              and probabilities: XLA CPU holds about two, tiny on dp=8, fp32, on
              jax 0.10.2 to 0.12.1 alike since model.layers.softmax asks for the
              custom JVP, three on jax <= 0.11 before; model.attention=auto is
              resolved as on the GPU: `core`).
              Measured on XLA GPU's own compile for an H100 (tools.plan
              --compile-for-gpu, 1b at 2 and 4 layers x 4 and 8 sequences of
              2048): 75,920 bytes per token and layer under cudnn and pallas,
              the terms' 75,904; d_ff 4096 and n_kv_heads 32 move it by the
              terms' 3·F and 2·K·H exactly. Its xla core: 434,448 bytes
              against these terms' 608,256 (1.3 fp32 score copies where
              they count 2: an upper bound there; 870,400 with 3 copies).
  context parallel (ring, allgather): q, k, v, out and the fp32 lse only,
              (2N+2K)·H/t + 4·N/t bytes: its custom_vjp saves no scores
  MoE layer   the dense layer's terms with 3·n_shared·F_e/t for the MLP's,
              plus 2·E fp32 (router logits, probabilities) per token, plus per
              routed row (R of them, not per token) D + 3·F_e/t (the rows the
              experts received, sorted; gate, up, hidden) and a 1-byte D-wide
              mask, plus per routed copy (k per token) D and its mask (the
              outputs picked back for the gates' gradient). Measured on
              mixtral-8x7b's scanned layers compiled for H100s (ep=8, 2048
              tokens a device): 1,886.5 MB a layer, these terms with the
              scan's 1,887.7, dropless (ragged_dot or mosaic) and capacity
              alike; the dispatch buffers sent and returned are not kept (4·D
              a row counted them until 2026-12-07: 0.73-0.87x). Unrolled, XLA's
              peak reads 0.80-0.86x the estimate, not for the rows: it falls at
              the backward's start, before any layer's gradient exists, which
              tools.estimate.memory counts whole (README, under the record
              bench/results/scan-moe-memory-h100-compiled.json)
  remat full  D (the layer input)
  remat dots  (N+2K)·H/t + 2·D + 2·F/t: the projections' outputs (q, k, v,
              the attention's and the MLP's output projections, under TP
              their sums over tensor, gate, up)
  remat attn  D + (2N+2K)·H/t: the layer input, q, k, v, the core's output
              (MoE layers under dots and attn: none's, an upper bound)
  1F1B-family slot (`chunk_residuals`: model.remat.stash_policy keeps no
              elementwise intermediates, B recomputes them) under none:
              ((N+2K)·H/t + N·H/t + 2·D + 2·F/t)·c (q, k, v before rotary,
              the core's output, the two D-wide projections, gate, up), plus
              the fp32 logsumexp 4·N/t (a fused core; context parallel) or
              the xla core's fp32 scores 4·N/t·L; a MoE layer the attention's,
              the router's 4·E + 8·k, per expert row D + 2·F_e/t and per
              routed copy (k per token) D (twice under ep) and its positions;
              dots and attn as above (attn without each layer's input); the
              chunk input once where the layers are scanned. Equal to the
              traced slot (pipeline.one_f_one_b.stash_bytes) for dense layers,
              within 1% for MoE and context parallel (tests/test_pipeline.py)
  the layer scan under none: the layers' terms, and on XLA GPU wider D-wide
              streams (`scan_streams`): each layer's four block inputs and norm
              outputs stacked in fp32, not c, and two more D-wide per token in
              c (a MoE layer: one in c, the router's fp32 input): 4·D·(4-c) +
              2·D·c. 1b compiled for one H100 at 4 and 8 scanned layers holds
              2.44 GiB a layer (8 x 2048 tokens: about 99,500 bytes a token,
              the terms' 100,480). Before model.mlp.swiglu's checkpoint it held
              3.19 GiB a layer, 148,276 bytes a token against 75,920 unrolled:
              the stacks twice, as the estimate then counted. XLA CPU holds the
              terms alone (`memory(cpu=)`); under dots, attn and full the
              terms exactly (47,104, 14,336 and 4,096 bytes; 1b's compiles of
              bench/results/memory-terms-1b-h100-compiled.json)
  unrolled layers (model.scan_layers=false): the policy's terms, as for the
              scan but for none's wider streams (1b compiled for one H100, 8 x 2048
              tokens: XLA 22.69 GiB under full, 33.19 under dots, 40.16 under
              none; estimate 1.09x, 1.06x, 1.05x; model/remat.py)
"""

from __future__ import annotations

from configs.base import RunConfig
from sharding.checks import expert_d_ff, explicit_context
from tools.pipeline_figures import virtual
from tools.shape import DTYPE_BYTES, core, dispatch_rows, shape


def dense_expert_copies(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """Bytes of XLA's dense lowering of the dropless experts' ragged_dot (model.expert_matmul =
    ragged_dot; tools.roofline.expert_padding): zero-padded operands and outputs, one
    [E/ep, R, D] and one [E/ep, R, F_e/t] pair of each of two ragged matmuls live at once
    (gate and up forward; dx and dw backward), R = ep·S the rows received: (E/ep)·R·2·(D +
    F_e/t)·c. 0 under capacity and under mosaic. Compiled for H100s (mixtral-8x7b, 2 layers,
    six meshes: bench/results/expert-matmul-mixtral-h100-compiled.json) XLA's peak under
    ragged_dot lies 0.49 to 5.40 GB above mosaic's, where this counts 1.21 to 2.42 GB (XLA's
    scheduler keeps the copies live unevenly: 4.36 GB against 2.42 on dp=2,ep=4, 0.49 against
    1.21 on ep=8); XLA's peak over the estimate went from 0.90-1.47x to 0.88-1.29x."""
    m = cfg.model
    if not m.n_experts or m.moe_dispatch == "capacity" or m.expert_matmul != "ragged_dot":
        return 0.0
    ep = sizes.get("expert", 1)
    rows = ep * dispatch_rows(cfg, sizes)
    return m.n_experts // ep * rows * 2 * (m.d_model + expert_d_ff(m) / sizes["tensor"]) * DTYPE_BYTES[m.compute_dtype]


def layer_activations(cfg: RunConfig, sizes: dict[str, int], remat: str, moe: bool = False) -> float:
    """Bytes one layer (a MoE layer when `moe`) keeps for backward for one microbatch (module
    docstring)."""
    m, tp, s = cfg.model, sizes["tensor"], shape(cfg, sizes)
    c = DTYPE_BYTES[m.compute_dtype]
    qkv, out = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim / tp, m.n_heads * m.head_dim / tp
    if remat == "full":
        return s.tokens * m.d_model * c
    if remat == "dots" and not moe:  # the projections' outputs: q, k, v, the two D-wide ones, gate, up
        return s.tokens * (qkv + 2 * m.d_model + 2 * m.d_ff / tp) * c
    if remat == "attn" and not moe:  # the layer input, q, k, v and the core's output
        return s.tokens * (m.d_model + qkv + out) * c
    mlp = 3 * m.d_ff / tp
    routed = 0.0
    if moe:  # shared experts per token; the routed rows and copies; fp32 router logits and probabilities
        fe = expert_d_ff(m)
        mlp = 3 * m.n_shared_experts * fe / tp
        rows = sizes.get("expert", 1) * dispatch_rows(cfg, sizes)
        copies = s.tokens * m.experts_per_token
        routed = (rows * ((m.d_model + 3 * fe / tp) * c + m.d_model) + copies * m.d_model * (c + 1)
                  + s.tokens * 2 * m.n_experts * 4)
    heads, scores = qkv + out, m.n_heads / tp * 4  # q, k, v, output; the fp32 logsumexp
    if core(cfg, sizes) == "xla" and not explicit_context(cfg, sizes["sequence"]):  # context
        # parallelism's custom_vjp keeps the above whatever the core; the xla core alone keeps K, V
        # repeated to N heads and two fp32 [N/t, L] copies of its scores instead of the logsumexp
        heads, scores = heads + 2 * out, 2 * m.n_heads / tp * cfg.train.seq_len * 4
    per_token = 4 * m.d_model + heads + mlp
    return s.tokens * (per_token * c + scores) + routed


def scan_streams(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """Bytes the layer scan under remat none keeps on XLA GPU beyond the device's layers' terms
    (module docstring): each layer's four D-wide block inputs and norm outputs in fp32, not c,
    and two more D-wide per token, in c (a MoE layer: one in c, the router's input in fp32)."""
    m, s = cfg.model, shape(cfg, sizes)
    c = DTYPE_BYTES[m.compute_dtype]
    dense, moe = 4 * (4 - c) + 2 * c, 4 * (4 - c) + c + 4
    return s.tokens * m.d_model * ((s.layers - s.moe) * dense + s.moe * moe)


def stack_activations(cfg: RunConfig, sizes: dict[str, int], remat: str) -> float:
    """Bytes the device's X/pp layers keep for backward for one microbatch: the dense layers'
    and the MoE layers' (`layer_activations`)."""
    s = shape(cfg, sizes)
    dense = (s.layers - s.moe) * layer_activations(cfg, sizes, remat)
    return dense + s.moe * layer_activations(cfg, sizes, remat, moe=True) if s.moe else dense


def chunk_residuals(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """Bytes of one chunk's residuals for one microbatch, one slot of the 1F1B family's stash and
    one tick's under gpipe and interleaved: what model.remat.stash_policy keeps of X/(pp·V)
    layers (module docstring, saved)."""
    m, s, tp = cfg.model, shape(cfg, sizes), sizes["tensor"]
    c, n = DTYPE_BYTES[m.compute_dtype], s.tokens
    layers, moe = s.layers / virtual(cfg), s.moe / virtual(cfg)  # the chunk's layers, of which MoE
    qkv, out = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim / tp, m.n_heads * m.head_dim / tp
    if m.remat == "full":  # each layer's input (model.remat.stash_policy)
        return layers * n * m.d_model * c
    if m.remat == "attn":  # the chunk input; q, k, v and the core's output of every layer
        return n * m.d_model * c + layers * n * (qkv + out) * c
    # the chunk input, kept apart from the layers' residuals where the layers are scanned (unrolled,
    # it takes the place of the last layer's MLP output, which the backward does not need)
    x = n * m.d_model * c if m.scan_layers else 0.0
    if m.remat == "dots":  # a MoE layer: its attention's projections and the router's logits
        return x + (layers - moe) * layer_activations(cfg, sizes, "dots") + moe * n * ((qkv + m.d_model) * c
                                                                                       + 4 * m.n_experts)
    fused = core(cfg, sizes) != "xla" or explicit_context(cfg, sizes["sequence"]) is not None
    attention = n * ((qkv + out + m.d_model) * c + 4 * m.n_heads / tp * (1 if fused else cfg.train.seq_len))
    dense = attention + n * (m.d_model + 2 * m.d_ff / tp) * c
    if not moe:
        return x + layers * dense
    fe, k, ep = expert_d_ff(m), m.experts_per_token, sizes.get("expert", 1)
    rows = ep * dispatch_rows(cfg, sizes)  # the rows the device's experts compute
    shared = n * (m.d_model + 2 * m.n_shared_experts * fe / tp) * c if m.n_shared_experts else 0.0
    bookkeeping = 4 * m.n_experts if m.moe_dispatch == "capacity" else 12  # positions per routed row
    expert_layer = (attention + shared + n * (4 * m.n_experts + 8 * k) + rows * (m.d_model + 2 * fe / tp) * c
                    + n * k * ((1 + (ep > 1)) * m.d_model * c + bookkeeping))
    return x + (layers - moe) * dense + moe * expert_layer


# zb-h1's stash per layer by remat policy: (extra N·H/t of query cotangents, D-wide and F-wide
# bf16 arrays, fp32 [T, 1] norm statistics, fp32 copies of the norms' scales)
_ZB_TERMS = {"none": (0, 2, 2, 2, 2), "dots": (1, 2, 2, 2, 2), "attn": (0, 3, 4, 1, 1), "full": (1, 4, 4, 0, 0)}


def zb_stash(cfg: RunConfig, sizes: dict[str, int]) -> float:
    """Bytes zb-h1's (zbv's) B leaves for its W per microbatch and chunk (pipeline/split_backward.py),
    the chunk's X/(pp·V) layers (V = 2 under zbv, else 1), per layer:
    the output cotangents of its q, k, v projections and of its MLP, the matmul inputs W reads
    that B recomputed (the norms' outputs: under none too, the chunk's checkpoint keeping no
    elementwise result; the MLP hidden under attn and full, where B recomputes gate and up;
    under none and dots W recomputes it from the gate and up its slot keeps, model.mlp.swiglu's
    checkpoint being its own: one [T, F/t] a layer less than B stashing it), and each norm's
    fp32 normalised input for its scale's gradient, 4·D·4 bytes a token (`_ZB_TERMS` by
    policy; dense layers, equal to the traced stash: tests/test_pipeline.py)."""
    m, s, tp = cfg.model, shape(cfg, sizes), sizes["tensor"]
    queries, d, f, stats, scales = _ZB_TERMS[m.remat]
    heads = (m.n_heads * (1 + queries) + 2 * m.n_kv_heads) * m.head_dim / tp
    per_token = (heads + d * m.d_model + f * m.d_ff / tp) * DTYPE_BYTES[m.compute_dtype] + 4 * (4 * m.d_model + stats)
    if m.remat == "dots" and core(cfg, sizes) == "xla" and not explicit_context(cfg, sizes["sequence"]):
        per_token += DTYPE_BYTES[m.compute_dtype] * m.n_heads / tp * cfg.train.seq_len  # the recomputed probabilities
    return s.layers / virtual(cfg) * (s.tokens * per_token + scales * m.d_model * 4)
