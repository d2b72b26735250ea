"""The seed's distributed test, ported: the packaged Muon must match it bit for bit.

bf16 matmuls are slow on CPUs without bf16 units (a single Newton-Schulz of the seed's
676 x 876 matrix takes ~4 s on an AVX2 core), so the default run uses the seed's test logic on
smaller shapes with the same TP split pattern and odd sizes; the seed's exact shapes run under
``-m slow``.
"""

import pytest

from muonckpt.distributed.launch import run_distributed

from .seed_port import SEED_SHAPES, run_seed_test

pytestmark = pytest.mark.dist

SMALL_SHAPES = [(20, 20), (24, 36), (52, 28), (44, 52), (32, 32)]


@pytest.mark.parametrize("dp,tp", [(4, 2), (2, 4)])
def test_seed_test_small_shapes_bitwise(dp, tp):
    checked = run_distributed(run_seed_test, 8, [(dp, tp)], SMALL_SHAPES, 10, timeout=120)
    assert all(c > 0 for c in checked)


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp", [(4, 2), (2, 4)])
def test_seed_test_seed_shapes_bitwise(dp, tp):
    checked = run_distributed(run_seed_test, 8, [(dp, tp)], SEED_SHAPES, 10, timeout=1800)
    assert all(c > 0 for c in checked)
