"""Context parallelism's layout (sharding/context_layout.py), no devices: the zigzag permutation
round-trips and gives device d chunks d and 2sp-1-d; the traced positions equal the host's;
visible causal pairs per device are equal under zigzag and increase without it; bad lengths
are clear errors. L = 32."""

import jax
import numpy as np
import pytest

from sharding.context_layout import causal_block_work, device_positions, positions, zigzag_permutation

L = 32
SPS = (2, 4, 8)


@pytest.mark.parametrize("sp", [1, *SPS])
def test_zigzag_permutation_round_trips_and_gives_device_d_chunks_d_and_mirror(sp):
    perm, inverse = zigzag_permutation(L, sp)
    x = np.arange(L) * 10
    np.testing.assert_array_equal(x[perm][inverse], x)
    assert sorted(perm) == list(range(L))
    c = L // (2 * sp)
    for d, rows in enumerate(positions(L, sp, zigzag=True)):  # device d's slice of the permuted order
        np.testing.assert_array_equal(rows, np.r_[d * c:(d + 1) * c, (2 * sp - 1 - d) * c:(2 * sp - d) * c])
    np.testing.assert_array_equal(positions(L, sp, zigzag=True).reshape(-1), perm)
    np.testing.assert_array_equal(positions(L, sp, zigzag=False).reshape(-1), np.arange(L))


@pytest.mark.parametrize("sp", SPS)
def test_zigzag_balances_the_causal_work(sp):
    zigzag, contiguous = causal_block_work(L, sp, True), causal_block_work(L, sp, False)
    assert zigzag.sum() == contiguous.sum() == L * (L + 1) // 2
    assert (zigzag == zigzag[0]).all(), zigzag
    assert (np.diff(contiguous) > 0).all(), contiguous  # the last device does the most
    assert contiguous[-1] / contiguous[0] > sp  # about 2sp-1 at L >> sp


@pytest.mark.parametrize("zigzag", [True, False])
@pytest.mark.parametrize("sp", SPS)
def test_traced_positions_are_the_hosts(sp, zigzag):
    """device_positions (traced, as inside the region) gives each device its row of `positions`."""
    rows = L // sp
    traced = jax.jit(jax.vmap(lambda d: device_positions(d, sp, rows, zigzag)))(np.arange(sp))
    np.testing.assert_array_equal(traced, positions(L, sp, zigzag))


def test_lengths_that_do_not_split_are_clear_errors():
    with pytest.raises(ValueError, match="not divisible by 2·sp = 8"):
        zigzag_permutation(36, 4)
    with pytest.raises(ValueError, match="length 30 is not divisible by sp = 4"):
        positions(30, 4, zigzag=False)
