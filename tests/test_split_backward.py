"""pipeline/split_backward.py: B (dx) and W (dparams) from split_vjp equal jax.vjp's; B + W do the
pullback's matmuls, each once (dot_general count and compiled FLOPs); W holds only weight-gradient
dots; the stash is the per-layer dy's (and the recomputed activations W reads)."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipeline.jaxpr_eval import count_prims, equations
from pipeline.split_backward import split_vjp, stash_bytes

L, B, D, H = 3, 4, 8, 16  # layers, batch, width, hidden
POLICIES = {"none": None, "nothing": jax.checkpoint_policies.nothing_saveable,
            "dots": jax.checkpoint_policies.dots_saveable}


def mlp_stack(policy):
    """f(params, x): L residual MLP layers x + relu(x w1) w2, one lax.scan over the stacked weights."""

    def layer(x, w):
        return x + jax.nn.relu(x @ w["w1"]) @ w["w2"], None

    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)

    def f(params, x):
        return jax.lax.scan(layer, x, params)[0]

    return f


def mlp_params(key=0):
    k = jax.random.split(jax.random.key(key), 3)
    params = {"w1": jax.random.normal(k[0], (L, D, H)) / 4, "w2": jax.random.normal(k[1], (L, H, D)) / 4}
    return params, jax.random.normal(k[2], (B, D))


def full_pullback(f, params, x):
    """jax.vjp's pullback as a function of its residuals (for counting its dots)."""
    _, vjp = jax.vjp(f, params, x)
    tree = jax.tree.structure(vjp)
    return (lambda res, g: jax.tree.unflatten(tree, res)(g)), jax.tree.leaves(vjp), vjp


def dots_in(fn, *args):
    return count_prims(jax.make_jaxpr(fn)(*args))


def dot_shapes(fn, *args):
    """Output shapes of every dot_general in fn's jaxpr, through sub-jaxprs."""
    return [tuple(e.outvars[0].aval.shape) for e in equations(jax.make_jaxpr(fn)(*args)) if e.primitive.name == "dot_general"]


def check_split(f, params, x, g_key=7, **kw):
    """dx, dparams of B/W against jax.vjp; returns (split, g, dx, stash, dparams)."""
    split = split_vjp(f, params, x, **kw)
    g = jax.random.normal(jax.random.key(g_key), split.y.shape)
    dx, stash = jax.jit(split.b_fn)(split.residuals, g)
    dp = jax.jit(split.w_fn)(split.residuals, stash)
    y0, vjp = jax.vjp(f, params, x)
    dp0, dx0 = jax.jit(lambda vjp, g: vjp(g))(vjp, g)  # jitted too: XLA's fp32 rounding on both sides
    np.testing.assert_allclose(split.y, y0, rtol=1e-6)
    np.testing.assert_allclose(dx, dx0, rtol=1e-5, atol=1e-5)
    assert jax.tree.structure(dp) == jax.tree.structure(dp0)
    for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(dp0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    return split, g, dx, stash, dp


# The stash of the MLP stack, per layer: dy of both matmuls ([B, D] of w2, [B, H] of w1), and,
# where the layer is recomputed (nothing_saveable), its hidden activation relu(x w1) [B, H] that
# dw2 = h^T dy reads; with dots_saveable the pre-activation x w1 is a residual and W applies relu.
STASH_ELEMENTS = {"none": L * B * (D + H), "nothing": L * B * (D + 2 * H), "dots": L * B * (D + H)}
# The residuals W reads besides: the layer inputs x [B, D] (dw1 = x^T dy1), and without remat the
# hidden h [B, H], with dots_saveable the pre-activation x w1 [B, H]. B may drop the rest.
W_READS = {"none": L * B * (D + H), "nothing": L * B * D, "dots": L * B * (D + H)}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_mlp_stack_b_and_w_equal_vjp_with_the_pullbacks_dots(policy):
    f = mlp_stack(POLICIES[policy])
    params, x = mlp_params()
    split, g, dx, stash, dp = check_split(f, params, x)
    full, res0, _ = full_pullback(f, params, x)
    n_b, n_w = dots_in(split.b_fn, split.residuals, g), dots_in(split.w_fn, split.residuals, stash)
    assert n_b + n_w == dots_in(full, res0, g)
    # W: exactly the two weight-gradient matmuls of the layer body ([D, H] and [H, D], maybe
    # transposed); B: dx's two matmuls (+ the recomputed forward matmul with nothing_saveable)
    assert n_w == 2 and sorted(dot_shapes(split.w_fn, split.residuals, stash)) == sorted([(D, H), (H, D)])
    assert n_b == (3 if policy == "nothing" else 2)
    assert stash_bytes(stash) == 4 * STASH_ELEMENTS[policy]
    assert stash_bytes(jax.eval_shape(split.b_fn, split.residuals, g)[1]) == stash_bytes(stash)
    assert stash_bytes([r for r, u in zip(split.residuals, split.w_reads) if u]) == 4 * W_READS[policy]
    # w_fn reads nothing else: any other residual may be garbage
    junk = [r if u else jnp.full_like(r, jnp.nan) for r, u in zip(split.residuals, split.w_reads)]
    for a, b in zip(jax.tree.leaves(jax.jit(split.w_fn)(junk, stash)), jax.tree.leaves(dp)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_unrolled_layers_compiled_flops_of_b_plus_w_equal_the_pullbacks(policy):
    def layer(x, w1, w2):
        return x + jnp.tanh(x @ w1) @ w2

    if POLICIES[policy] is not None:
        layer = jax.checkpoint(layer, policy=POLICIES[policy])

    def f(params, x):
        for w1, w2 in params:
            x = layer(x, w1, w2)
        return x

    k = jax.random.split(jax.random.key(3), 7)
    b, d, h = 32, 64, 128
    params = [(jax.random.normal(k[2 * i], (d, h)) / 8, jax.random.normal(k[2 * i + 1], (h, d)) / 8) for i in range(3)]
    x = jax.random.normal(k[6], (b, d))
    split, g, dx, stash, dp = check_split(f, params, x)
    full, res0, _ = full_pullback(f, params, x)

    def flops(fn, *args):
        cost = jax.jit(fn).lower(*args).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    f_b, f_w = flops(split.b_fn, split.residuals, g), flops(split.w_fn, split.residuals, stash)
    assert f_b + f_w == flops(full, res0, g)
    # the six dW = x^T dy (+ W's elementwise work: tanh of the saved pre-activation under dots)
    assert 6 * 2 * b * d * h <= f_w <= 6 * 2 * b * d * h + 3 * 4 * b * h
    assert dots_in(split.w_fn, split.residuals, stash) == 6


def test_weights_shared_across_iterations_accumulate_in_ws_own_carry():
    """A weight closed over by the scan (not stacked): its gradient is a carry of the backward
    scan, summed over the iterations; it goes to the W scan, dx's carry to the B scan."""

    def f(params, x):
        def step(x, _):
            return jnp.tanh(x @ params["w"] * params["s"]) + params["b"], None

        return jax.lax.scan(step, x, None, length=4)[0]

    k = jax.random.split(jax.random.key(4), 2)
    # a scalar too: its gradient carry starts from a literal 0.0 in the pullback's scan
    params = {"w": jax.random.normal(k[0], (D, D)) / 3, "b": jnp.full((D,), 0.1), "s": jnp.float32(0.9)}
    x = jax.random.normal(k[1], (B, D))
    split, g, dx, stash, dp = check_split(f, params, x)
    full, res0, _ = full_pullback(f, params, x)
    assert dots_in(split.w_fn, split.residuals, stash) == 1
    assert dots_in(split.b_fn, split.residuals, g) + 1 == dots_in(full, res0, g)


def test_nested_scans_split_recursively():
    """A scan over groups of a remat'ed scan over layers: the inner stash becomes a per-group xs."""
    inner = mlp_stack(jax.checkpoint_policies.nothing_saveable)

    def f(params, x):
        return jax.lax.scan(lambda x, p: (inner(p, x), None), x, params)[0]

    params, x = mlp_params(5)
    params = jax.tree.map(lambda w: jnp.stack([w, w[::-1] * 0.5]), params)  # [2 groups, L, ...]
    split, g, dx, stash, dp = check_split(f, params, x)
    full, res0, _ = full_pullback(f, params, x)
    n_w = dots_in(split.w_fn, split.residuals, stash)
    assert n_w == 2 and n_w + dots_in(split.b_fn, split.residuals, g) == dots_in(full, res0, g)
    assert stash_bytes(stash) == 2 * 4 * STASH_ELEMENTS["nothing"]


def test_b_and_w_in_different_switch_branches_of_a_tick_scan():
    """The pipeline's use: M microbatches, B of each at one tick, W at a later one, in two
    lax.switch branches of one lax.scan over ticks, residuals and stash in preallocated buffers."""
    f = mlp_stack(jax.checkpoint_policies.nothing_saveable)
    params, _ = mlp_params()
    m = 3
    xs = jax.random.normal(jax.random.key(8), (m, B, D))
    gs = jax.random.normal(jax.random.key(9), (m, B, D))

    @jax.jit
    def run(params, xs, gs):
        split = split_vjp(f, params, xs[0])  # the static split; residuals per microbatch below
        b_fn, w_fn = split.b_fn, split.w_fn
        res = jax.vmap(lambda x: split_vjp(f, params, x).residuals)(xs)  # [M, ...] buffers
        stash_shape = jax.eval_shape(b_fn, split.residuals, gs[0])[1]
        buf = jax.tree.map(lambda s: jnp.zeros((m, *s.shape), s.dtype), stash_shape)
        grads = jax.tree.map(jnp.zeros_like, params)
        dxs = jnp.zeros_like(xs)

        def tick(carry, t):
            buf, grads, dxs = carry
            mb = t % m
            r = jax.tree.map(lambda a: a[mb], res)

            def do_b(buf, grads, dxs):
                dx, stash = b_fn(r, gs[mb])
                buf = jax.tree.map(lambda a, s: a.at[mb].set(s), buf, stash)
                return buf, grads, dxs.at[mb].set(dx)

            def do_w(buf, grads, dxs):
                dp = w_fn(r, jax.tree.map(lambda a: a[mb], buf))
                return buf, jax.tree.map(jnp.add, grads, dp), dxs

            return jax.lax.switch(t // m, [do_b, do_w], buf, grads, dxs), None

        (_, grads, dxs), _ = jax.lax.scan(tick, (buf, grads, dxs), jnp.arange(2 * m))
        return grads, dxs

    grads, dxs = run(params, xs, gs)
    for i in range(m):
        dp0, dx0 = jax.vjp(f, params, xs[i])[1](gs[i])
        np.testing.assert_allclose(dxs[i], dx0, rtol=1e-5, atol=1e-6)
    want = jax.tree.map(lambda *a: sum(a), *[jax.vjp(f, params, xs[i])[1](gs[i])[0] for i in range(m)])
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# The project's Transformer blocks (attention_impl xla, SwiGLU MLP), run as pipeline/one_f_one_b.py
# runs a stage: the block states through Transformer.run_layers (a lax.scan with the remat policy).
# W holds the 7 weight-gradient matmuls of a block (q, k, v, o, gate, up, down). Under the 'dots'
# policy the attention core's output p @ v (a batched dot the policy does not save) is recomputed
# in the backward for dW_o only: left in W (shrink_stash=False) it makes B stash the [b, h, L, L]
# probabilities; by default B computes it and stashes the [b, L, h, d] output.
TRANSFORMER = [("none", True, 7), ("full", True, 7), ("dots", True, 7), ("dots", False, 8)]


@pytest.mark.parametrize("remat, shrink, w_dots", TRANSFORMER)
def test_transformer_blocks_b_and_w_equal_vjp(remat, shrink, w_dots):
    from conftest import small_config
    from model.transformer import Transformer

    cfg = dataclasses.replace(small_config().model, remat=remat, attention="xla")
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

    def stage(blocks, x):
        return nnx.merge(graphdef, params).run_layers(x, blocks)[0]

    b, length = 2, 16
    x = jax.random.normal(jax.random.key(1), (b, length, cfg.d_model))
    split, g, dx, stash, dp = check_split(stage, params["blocks"], x, shrink_stash=shrink)
    full, res0, _ = full_pullback(stage, params["blocks"], x)
    n_b, n_w = dots_in(split.b_fn, split.residuals, g), dots_in(split.w_fn, split.residuals, stash)
    assert n_b + n_w == dots_in(full, res0, g)
    assert n_w == w_dots
    assert all(s.shape[0] == cfg.n_layers for s in stash)  # stacked per layer
    # per layer and token, at least the dy of the 7 matmuls (q, k, v, o, gate, up, down outputs)
    # and of the two norms' outputs (their scales' gradients); here exactly that except 'dots'
    # (where the rms statistics and normalised activations are not residuals either)
    per_token = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim + 2 * cfg.d_model + 2 * cfg.d_ff + 2 * cfg.d_model
    assert stash_bytes(stash) >= 4 * cfg.n_layers * b * length * per_token
    if remat == "none":
        assert stash_bytes(stash) == 4 * cfg.n_layers * b * length * per_token
    if remat == "full":  # B recomputes the layer; W reads the stash only
        assert not any(split.w_reads)
        # the model's named scopes survive the split (profiles of B and W show them)
        for fn, args in ((split.b_fn, (split.residuals, g)), (split.w_fn, (split.residuals, stash))):
            text = jax.jit(fn).lower(*args).as_text(debug_info=True)
            assert "attention" in text and "mlp" in text
    squares = [s.shape for s in stash if s.shape[-2:] == (length, length)]
    assert bool(squares) == (not shrink)  # the [L, L] probabilities only without shrink_stash


def test_one_f_one_b_stage_function_splits():
    """pipeline/one_f_one_b.py's own chunk function with has_aux (the stacked block states as the
    parameters; outputs (y, router share), cotangent (g, 1)) under remat 'full' (the whole chunk
    one checkpoint) and shrink_stash=False, as zb-h1 runs it: B and W equal its jax.vjp, W is the
    7 weight matmuls of the block."""
    from conftest import small_config
    from model.transformer import Transformer
    from pipeline.cells import Static, _chunk

    cfg = dataclasses.replace(small_config().model, remat="full", attention="xla")
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    st = Static(graphdef, cfg, jnp.float32, 0.0, 2, split_backward=True)
    chunk, params = partial(_chunk, st, nnx.merge(graphdef, params)), params["blocks"]
    x = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model))
    split = split_vjp(chunk, params, x, has_aux=True, shrink_stash=False)  # as its zb-h1 cells do
    g = (jax.random.normal(jax.random.key(2), x.shape), jnp.ones((), jnp.float32))
    dx, stash = jax.jit(split.b_fn)(split.residuals, g)
    dp = jax.jit(split.w_fn)(split.residuals, stash)
    (y0, share0), vjp, stats0 = jax.vjp(chunk, params, x, has_aux=True)
    (y, share), stats = split.y
    np.testing.assert_allclose(y, y0, rtol=1e-6)
    assert jax.tree.structure(stats) == jax.tree.structure(stats0)
    dp0, dx0 = jax.jit(lambda vjp, g: vjp(g))(vjp, g)
    np.testing.assert_allclose(dx, dx0, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(dp0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert dots_in(split.w_fn, split.residuals, stash) == 7


@pytest.mark.parametrize("dispatch, w_dots, w_ragged", [("dropless", 4, 3), ("capacity", 7, 0)])
def test_moe_blocks_split(dispatch, w_dots, w_ragged):
    """MoE layers (model/moe.py: routing, sorting, ragged or capacity dispatch) with the router
    statistics as a second output: B + W = the pullback's dots and ragged dots. W: the dW of q, k,
    v, o (dot_general) and of the 3 expert weights (ragged_dot_general when dropless). The router's
    dW = x^T dlogits [D, E] runs in B: shrink_stash moves it there, since the [T, D] normalised
    input that only it reads would otherwise be stashed (with shrink_stash=False it is in W)."""
    from conftest import small_config
    from model.transformer import Transformer

    cfg = dataclasses.replace(small_config().model, remat="full", n_experts=4, moe_dispatch=dispatch, moe_every=1)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))

    def stage(blocks, x):
        return nnx.merge(graphdef, params).run_layers(x, blocks)

    x = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model))
    split = split_vjp(stage, params["blocks"], x)
    g = jax.tree.map(jnp.ones_like, split.y)
    dx, stash = jax.jit(split.b_fn)(split.residuals, g)
    dp = jax.jit(split.w_fn)(split.residuals, stash)
    _, vjp = jax.vjp(stage, params["blocks"], x)
    dp0, dx0 = jax.jit(lambda vjp, g: vjp(g))(vjp, g)
    np.testing.assert_allclose(dx, dx0, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(dp0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    full, res0, _ = full_pullback(stage, params["blocks"], x)
    jb, jw = jax.make_jaxpr(split.b_fn)(split.residuals, g), jax.make_jaxpr(split.w_fn)(split.residuals, stash)
    jf = jax.make_jaxpr(full)(res0, g)
    for name, in_w in (("dot_general", w_dots), ("ragged_dot_general", w_ragged)):
        assert count_prims(jw, name) == in_w
        assert count_prims(jb, name) + in_w == count_prims(jf, name)


def test_inside_shard_map_with_tensor_parallel_collectives():
    """A stage as pipeline/ runs it, inside shard_map: a tensor-parallel MLP stack (w1 split by
    columns, w2 by rows, a psum of the partial outputs): the split traces the collectives into
    B (dx path) and W as they come, and both equal the local jax.vjp."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("t",))

    def layer(x, w):
        return x + jax.lax.psum(jax.nn.relu(x @ w["w1"]) @ w["w2"], "t"), None

    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)

    def f(params, x):
        return jax.lax.scan(layer, x, params)[0]

    params, x = mlp_params(6)
    g = jax.random.normal(jax.random.key(10), x.shape)
    w_specs = {"w1": P(None, None, "t"), "w2": P(None, "t", None)}
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), w_specs))
    x, g = jax.device_put((x, g), NamedSharding(mesh, P()))

    def split_run(params, x, g):
        split = split_vjp(f, params, x)
        dx, stash = split.b_fn(split.residuals, g)
        return dx, split.w_fn(split.residuals, stash)

    def vjp_run(params, x, g):
        dp, dx = jax.vjp(f, params, x)[1](g)
        return dx, dp

    def on_mesh(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(w_specs, P(), P()), out_specs=(P(), w_specs),
                                     check_vma=False))

    (dx, dp), (dx0, dp0) = on_mesh(split_run)(params, x, g), on_mesh(vjp_run)(params, x, g)
    np.testing.assert_allclose(dx, dx0, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(dp0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_regions_are_split_into_b_and_w(check_vma):
    """A tensor-parallel region as model/ writes it under explicit TP, one shard_map per layer
    (w1 split by columns, w2 by rows, a psum of the partial outputs): the region is split into a
    B and a W shard_map (pipeline/split_map.py), so W holds its two weight matmuls a layer and B
    only dx's, their sum the pullback's; dx and the weight gradients equal jax.vjp's (fp32, rtol
    1e-5), checked and unchecked; each stash value stays on its device."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("t",))
    w_specs = {"w1": P(None, None, "t"), "w2": P(None, "t", None)}

    def region(w1, w2, x):
        return jax.lax.psum(jax.nn.relu(x @ w1) @ w2, "t")

    tp = jax.shard_map(region, mesh=mesh, in_specs=(P(None, "t"), P("t", None), P()), out_specs=P(),
                       check_vma=check_vma)

    def f(params, x):
        for i in range(L):
            x = x + tp(params["w1"][i], params["w2"][i], x)
        return x

    params, x = mlp_params(11)
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), w_specs))
    g = jax.random.normal(jax.random.key(12), x.shape)
    split = split_vjp(f, params, x)
    dx, stash = jax.jit(split.b_fn)(split.residuals, g)
    dp = jax.jit(split.w_fn)(split.residuals, stash)
    dp0, dx0 = jax.vjp(f, params, x)[1](g)
    np.testing.assert_allclose(dx, dx0, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(dp0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    full, res0, _ = full_pullback(f, params, x)
    n_b, n_w = dots_in(split.b_fn, split.residuals, g), dots_in(split.w_fn, split.residuals, stash)
    assert (n_b, n_w) == (2 * L, 2 * L) and n_b + n_w == dots_in(full, res0, g)
    # per layer and device: the hidden cotangent [B, H/4] and the output cotangent [B, D] (the
    # psum's transpose makes it varying; an unchecked region's values are all taken as varying),
    # each a shard [1, ...] of an array split over t
    assert sorted(s.shape for s in stash) == sorted([(4, B, H // 4), (4, B, D)] * L)
    assert all(s.sharding.shard_shape(s.shape)[0] == 1 for s in stash)
