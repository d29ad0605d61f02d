"""Put a run together on a mesh: batch layout, sharded state, jitted step and eval step, data.

The state is initialised inside `jax.jit` with `out_shardings` from the logical rules, so each
device materialises only its own shard (a model larger than one device's memory never exists
whole anywhere). Random initial values depend only on the seed, not on the mesh
(threefry is partitionable), which is what lets a sharded run equal the single-device run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from configs.base import RunConfig
from model.transformer import Transformer, count_params
from sharding.checks import batch_ranks, microbatches
from sharding.context_layout import zigzag_permutation
from sharding.rules import data_sharding, param_shardings
from sharding.strategies import Strategies, parallelize
from training.data import Batches, Corpus, held_out, load_tokens
from training.optimizer import lr_schedule, make_optimizer
from training.step import TrainState, make_eval_step, make_train_step


def batch_layout(cfg: RunConfig, mesh: Mesh) -> tuple[int, int]:
    """(k microbatches, b sequences per microbatch) of one optimizer step, global over the
    batch axes (k = M with pp > 1); sharding/checks.py has already refused what does not divide."""
    t, sizes = cfg.train, dict(mesh.shape)
    ranks = batch_ranks(sizes)
    per_rank = t.global_batch_size // ranks
    k = microbatches(cfg, sizes["stage"]) if sizes["stage"] > 1 else per_rank // (t.micro_batch_size or per_rank)
    return k, per_rank // k * ranks


def state_shardings(state: TrainState, mesh: Mesh) -> TrainState:
    """Parameters and optimizer moments by their logical names; scalars replicated."""

    def one(leaf):
        if isinstance(leaf, nnx.Variable):
            return param_shardings(leaf, mesh)
        return NamedSharding(mesh, P())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


@dataclass
class Job:
    cfg: RunConfig
    mesh: Mesh
    strategies: Strategies
    graphdef: nnx.GraphDef
    state: TrainState
    step_fn: Callable  # jitted (state, batch) -> (state, metrics)
    batches: Batches
    eval_fn: Callable  # jitted (params, batch) -> mean cross-entropy
    eval_batches: Batches | None  # the held-out batches; None when train.eval_every = 0

    @property
    def n_params(self) -> int:
        return count_params(self.state.params)


@dataclass
class Program:
    """A run's program without its data: its strategies, shapes, shardings and the jitted step."""

    strategies: Strategies
    graphdef: nnx.GraphDef
    state: TrainState  # ShapeDtypeStructs: nothing allocated
    shardings: TrainState
    batch_sharding: NamedSharding
    batch_shape: tuple[int, int, int]  # (k, b, L)
    init_fn: Callable  # jitted () -> sharded TrainState
    step_fn: Callable  # jitted (state, batch) -> (state, metrics), state donated
    eval_fn: Callable  # jitted (params, batch) -> mean cross-entropy; compiled at its first call
    order: np.ndarray | None  # the permutation of each sequence's positions (context parallelism's zigzag)

    def batches(self, tokens: np.ndarray, seed: int) -> Batches:
        """The training batches of `tokens` drawn with `seed` (a corpus shorter than one window is
        a ConfigError)."""
        return Batches(tokens, seed, *self.batch_shape, self.batch_sharding, self.order)

    def held_out(self, tokens: np.ndarray) -> Batches:
        """The evaluation batches of the held-out `tokens` (training.data.held_out)."""
        return held_out(tokens, *self.batch_shape, self.batch_sharding, self.order)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        struct = jax.ShapeDtypeStruct(self.batch_shape, np.int32, sharding=self.batch_sharding)
        return {"inputs": struct, "targets": struct}


def make_program(cfg: RunConfig, mesh: Mesh) -> Program:
    """Shapes, shardings and jitted functions of a run; allocates nothing.

    Call outside `jax.set_mesh`: nnx.eval_shape would otherwise apply the logical names as
    mesh axes.
    """
    strategies = parallelize(cfg, dict(mesh.shape))
    k, b = batch_layout(cfg, mesh)
    tx = make_optimizer(cfg.train)

    def init() -> tuple[nnx.GraphDef, TrainState]:
        model = Transformer(cfg.model, strategies, rngs=nnx.Rngs(cfg.train.seed))
        graphdef, params = nnx.split(model)
        step, bad_steps, skipped = (jax.numpy.zeros((), jax.numpy.int32) for _ in range(3))
        return graphdef, TrainState(step, params, tx.init(params), bad_steps, skipped)

    graphdef, state = nnx.eval_shape(init)
    shardings = state_shardings(state, mesh)
    shape = (k, b, cfg.train.seq_len)
    batch_sharding = data_sharding(mesh, shape)
    batch_shardings = {"inputs": batch_sharding, "targets": batch_sharding}
    options = strategies.compiler_options or None
    step_fn = jax.jit(
        make_train_step(graphdef, tx, lr_schedule(cfg.train), cfg, strategies),
        in_shardings=(shardings, batch_shardings),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
        compiler_options=options,
    )
    eval_fn = jax.jit(make_eval_step(graphdef, cfg, strategies), in_shardings=(shardings.params, batch_shardings),
                      out_shardings=NamedSharding(mesh, P()), compiler_options=options)
    init_fn = jax.jit(lambda: init()[1], out_shardings=shardings)
    order = zigzag_permutation(cfg.train.seq_len, mesh.shape["sequence"])[0] if strategies.context else None
    return Program(strategies, graphdef, state, shardings, batch_sharding, shape, init_fn, step_fn, eval_fn, order)


def build(cfg: RunConfig, mesh: Mesh, corpus: Corpus | None = None,
          restore: Callable[[Program], TrainState | None] | None = None,
          program: Program | None = None) -> Job:
    """Everything a training loop needs. `corpus` overrides the configured data source; training
    reads only its train part, evaluation (train.eval_every > 0) only its held-out part.

    `restore` (e.g. `Checkpointer.restore_latest`) gets the abstract program and returns the
    state of a checkpoint, already in this mesh's shardings, or None: then the state is
    initialised from the seed. `program`: `make_program(cfg, mesh)` if the caller has it already.
    """
    program = program or make_program(cfg, mesh)
    state = restore(program) if restore else None
    if state is None:
        with jax.set_mesh(mesh):
            state = program.init_fn()
    if corpus is None:
        corpus = load_tokens(cfg.data, cfg.model.vocab_size)
    batches = program.batches(corpus.train, cfg.data.seed)
    eval_batches = program.held_out(corpus.eval) if cfg.train.eval_every else None
    return Job(cfg, mesh, program.strategies, program.graphdef, state, program.step_fn, batches,
               program.eval_fn, eval_batches)


def compile_step(step_fn: Callable, mesh: Mesh, state, batch, compiler_options: dict | None = None
                 ) -> tuple[jax.stages.Compiled, float, float]:
    """Lower and compile `step_fn` for (state, batch) on `mesh`: (compiled, lower s, compile s).
    With a program's abstract state and batch (`Program.state`, `abstract_batch()`) nothing is
    allocated, so any preset compiles for any mesh of fake devices. `compiler_options`: XLA
    debug options for this compile only, over XLA_FLAGS (e.g. {"xla_gpu_enable_dynamic_slice_fusion":
    False}; an unknown name is an error)."""
    with jax.set_mesh(mesh):
        start = time.perf_counter()
        lowered = step_fn.lower(state, batch)
        lowered_at = time.perf_counter()
        compiled = lowered.compile(compiler_options)
    return compiled, lowered_at - start, time.perf_counter() - lowered_at


def xla_memory(compiled: jax.stages.Compiled) -> dict[str, int] | None:
    """XLA's memory analysis of a compiled program, bytes per device: argument, output, alias,
    temp, ... and `static_peak` = argument + output - alias + temp (XLA CPU's own
    peak_memory reads about the arguments only, far below the temporaries). None where the
    backend reports nothing."""
    stats = compiled.memory_analysis()
    if isinstance(stats, (list, tuple)):
        stats = stats[0] if stats else None
    if stats is None:
        return None
    mem = {n.removesuffix("_in_bytes").removesuffix("_size"): getattr(stats, n)
           for n in dir(stats) if n.endswith("_in_bytes")}
    mem["static_peak"] = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
    return mem
