"""Where a stage's chunks of layers are stored, where they run, and how they get there each step.

Stored: the model's X layers are one stack [X, ...] split contiguously over `stage`, whatever
the schedule (the checkpoint's layout): device d holds the model's chunks d·V ... d·V + V - 1,
Lc = X/(p·V) layers each (p stages, V chunks per stage). Run: device s runs, as its chunk v, the
model's chunk `model_chunk(v, s)`: v·p + s in the looping layout (gpipe, interleaved,
interleaved-1f1b), s then 2p-1-s in zbv's V. At V = 1 every device runs what it stores.

`lay_out` moves each chunk once, straight from the device that stores it to the one that runs
it: for each (slot it runs in, slot it is stored in) one collective-permute of Lc layers from
the devices that hold such a chunk to those that run it (at most V² permutes; a pair of one
device is a local copy); `back` moves the gradients the opposite way. A device receives from
one permute per slot and zeros from the others, hence the sums. Bytes per device: its stored
chunks that run elsewhere (`leaving`), forward in the dtype laid
out (the compute dtype: the cast copy moves), and back in the gradients' (fp32: every schedule's
gradients leave pipeline/engine.py's schedule in fp32). tools.traffic counts it (`layout`).

Why by hand: handed the stack under a new sharding ([V, p·Lc, ...], p·Lc over stage), XLA
re-lays it with all-to-alls and permutes of its own choosing, which no contract could state: on
CPU (tiny, p = 4, V = 2) 1.75x a device's layer weights each way where one chunk of two leaves
it; compiled for H100s under the 1F1B engine, the fp32 weights (125m pp=4,tp=2: 141.6 MB a step
against 85.0 MB laid out here; bench/results/pipeline-layout-h100-compiled.json).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax

SCOPE = "pipeline_layout"  # the permutes' named scope, kept in their HLO op_name (tools.hlo's census)
Route = tuple[int, int, list[tuple[int, int]]]  # (slot run, slot stored, [(storing device, running device)])


def model_chunk(v: int, s: int, p: int, vee: bool) -> int:
    """The model's chunk (counted from the embedding) that stage s runs as its chunk v; `vee`:
    zbv's V shape."""
    if vee:
        return s if v == 0 else 2 * p - 1 - s
    return v * p + s


def routes(p: int, v_count: int, vee: bool) -> list[Route]:
    """The permutes that lay the stored chunks out: for each (slot a it runs in, slot b it is
    stored in) the (storing, running) device pairs of the chunks that go from b to a. Within one
    route the storing devices differ (chunks with one residue mod V on distinct devices)."""
    out = []
    for a in range(v_count):
        chunks = [model_chunk(a, s, p, vee) for s in range(p)]
        for b in range(v_count):
            pairs = [(c // v_count, s) for s, c in enumerate(chunks) if c % v_count == b]
            if pairs:
                out.append((a, b, pairs))
    return out


def leaving(p: int, v_count: int, vee: bool) -> list[int]:
    """Per device, its stored chunks that run on another stage: the chunks it sends forward, and
    as many gradients it sends back (it runs V chunks and stores V, the same ones staying)."""
    sent = Counter(src for _, _, pairs in routes(p, v_count, vee) for src, dst in pairs if src != dst)
    return [sent[d] for d in range(p)]


def lay_out(chunks: jax.Array, p: int, vee: bool, back: bool = False) -> jax.Array:
    """Inside a shard_map manual over stage: the device's stored chunks [V, Lc, ...] -> the
    chunks it runs [V, Lc, ...] (the model's `model_chunk(v, s)` at v); `back`, the inverse (the
    run chunks' gradients -> the stored chunks'). Unchanged where nothing leaves (V = 1). (jax is
    imported here: the planner reads `leaving` without it.)"""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from pipeline.stages import AXIS

    v_count = chunks.shape[0]
    if not any(leaving(p, v_count, vee)):
        return chunks
    out: list = [None] * v_count
    with jax.named_scope(SCOPE):
        for a, b, pairs in routes(p, v_count, vee):
            source, target = (a, b) if back else (b, a)
            moved = lax.ppermute(chunks[source], AXIS, [(d, s) for s, d in pairs] if back else pairs)
            out[target] = moved if out[target] is None else out[target] + moved
        return jnp.stack(out)
