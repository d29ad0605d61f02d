"""Context parallelism's block schedule (sharding/context_schedule.py), no devices: at every
(device, step) the piece holds every visible (query, key) pair, only visible pairs when
unmasked, and the diagonal piece the same positions on both sides. L = 32."""

import numpy as np
import pytest

from sharding.context_layout import positions
from sharding.context_schedule import Setup, piece

L = 32
SPS = (2, 4, 8)


@pytest.mark.parametrize("zigzag", [True, False])
@pytest.mark.parametrize("sp", SPS)
def test_schedule_computes_every_visible_pair_and_skips_masked_blocks(sp, zigzag):
    """For every device d and step s, against the block of device j = (d - s) mod sp: the piece
    the schedule picks holds every visible (query, key) pair; an unmasked piece holds only
    visible pairs; the masked (diagonal) piece has the same positions on both sides. Under
    zigzag every device then computes the same number of pairs, without it not."""
    setup, l = Setup("ring", "sequence", True, zigzag, "xla"), L // sp
    pos = positions(L, sp, zigzag)
    computed = np.zeros(sp, int)
    for d in range(sp):
        for s in range(sp):
            j = (d - s) % sp
            visible = pos[j][None, :] <= pos[d][:, None]  # [query row of d, key row of j]
            chosen = piece(setup, "own" if j == d else "earlier" if j < d else "later", l)
            if chosen is None:
                assert not visible.any(), (d, s)
                continue
            first, end, diagonal = chosen
            assert visible[first:, :end].sum() == visible.sum(), (d, s)
            computed[d] += (l - first) * end
            if diagonal:
                np.testing.assert_array_equal(pos[d][first:], pos[j][:end])
            else:
                assert visible[first:, :end].all(), (d, s)
    assert (computed == computed[0]).all() == zigzag, computed


def test_full_attention_takes_every_block_whole():
    setup = Setup("ring", "sequence", False, True, "xla")
    assert {piece(setup, case, 8) for case in ("own", "earlier", "later")} == {(0, 8, False)}
