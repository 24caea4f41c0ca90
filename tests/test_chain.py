"""The bracketing of a chain of cuts (batchjac._chain): the dynamic program against an
exhaustive search of every bracketing, hand-computed costs, and when mixed mode is offered."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from batchjac._chain import OFFER_GAIN, SURE_GAIN, Chain, bracket, choose, direct


def every_bracketing_cost(chain: Chain, reverse_weight: float, write: float) -> float:
    """The cheapest of all bracketings, enumerated (no dynamic program): each piece either
    computed directly in the cheaper pure mode or split at every cut between, recursively."""
    w = chain.widths

    def costs(i: int, j: int) -> list[float]:
        work = sum(chain.costs[i:j])
        found = [min(w[i] * work, reverse_weight * w[j] * work) + write * w[i] * w[j]]
        for s in range(i + 1, j):
            found += [a + b + 2.0 * w[i] * w[s] * w[j] + write * w[i] * w[j]
                      for a, b in itertools.product(costs(i, s), costs(s, j))]
        return found

    return min(costs(0, len(w) - 1))


def chain_of(widths: tuple[int, ...], costs: tuple[float, ...]) -> Chain:
    return Chain(widths, costs, tuple(f"cut {i}" for i in range(len(widths))))


@pytest.mark.parametrize("seed", range(12))
def test_the_dynamic_program_finds_the_cheapest_of_every_bracketing(seed: int) -> None:
    rng = np.random.default_rng(seed)
    cuts = int(rng.integers(1, 6))
    widths = tuple(int(v) for v in rng.integers(1, 300, cuts + 2))
    costs = tuple(float(v) for v in rng.uniform(1e2, 1e6, cuts + 1))
    reverse_weight = float(rng.uniform(1.0, 2.0))
    write = float(rng.choice([0.0, 200.0]))
    chain = chain_of(widths, costs)
    root = bracket(chain, reverse_weight, write)
    assert root.cost == pytest.approx(every_bracketing_cost(chain, reverse_weight, write), rel=1e-12)
    # the tree's cost is what its leaves and products add up to
    assert root.cost == pytest.approx(_recount(root, chain, reverse_weight, write), rel=1e-12)


def _recount(piece: Any, chain: Chain, reverse_weight: float, write: float) -> float:
    w = chain.widths
    if piece.leaf:
        work = chain.work(piece.start, piece.stop)
        passes = w[piece.start] if piece.mode == "forward" else reverse_weight * w[piece.stop]
        return passes * work + write * w[piece.start] * w[piece.stop]
    left, right = piece.left, piece.right
    return (_recount(left, chain, reverse_weight, write) + _recount(right, chain, reverse_weight, write)
            + 2.0 * w[left.start] * w[left.stop] * w[right.stop] + write * w[left.start] * w[right.stop])


def test_a_bottleneck_is_split_reverse_before_it_and_forward_after_it() -> None:
    # by hand, writes left out: pure modes 8 passes x 2,000 = 16,000 each; split at the
    # 2-wide cut: 2 backward passes through the first piece (2 x 1,000), 2 tangents through the
    # second (2 x 1,000), and the 8x2 by 2x8 product (2 * 8 * 2 * 8 = 256): 4,256
    chain = chain_of((8, 2, 8), (1000.0, 1000.0))
    found = choose(chain, write=0.0)
    assert found is not None
    assert found.root.cost == 4256.0
    assert found.pure == {"forward": 16000.0, "reverse": 16000.0}
    left, right = found.root.left, found.root.right
    assert (left.start, left.stop, left.mode) == (0, 1, "reverse")
    assert (right.start, right.stop, right.mode) == (1, 2, "forward")
    assert found.gain == pytest.approx(16000 / 4256)
    assert found.gain >= SURE_GAIN
    assert found.sure  # the pure modes are not raced
    assert found.passes == 2
    text = found.describe()
    assert "reverse from cut 0 to cut 1 (2 backward passes), then forward from cut 1 to cut 2" in text


def test_a_smaller_gain_is_offered_and_raced() -> None:
    # by hand, writes left out: split at the 3-wide cut: 3,000 + 3,000 + 2 * 8 * 3 * 8 = 6,384
    # against 16,000: 2.5x, offered, not sure enough to skip the race with the pure modes
    found = choose(chain_of((8, 3, 8), (1000.0, 1000.0)), write=0.0)
    assert found is not None
    assert found.root.cost == 6384.0
    assert OFFER_GAIN <= found.gain < SURE_GAIN
    assert not found.sure


def test_the_product_can_outweigh_the_passes_saved() -> None:
    # the same widths, a hundred times cheaper passes: the split costs 40 + 256 against 160
    chain = chain_of((8, 2, 8), (10.0, 10.0))
    assert bracket(chain, write=0.0).leaf
    assert choose(chain, write=0.0) is None


def test_the_writes_of_the_jacobians_count() -> None:
    # writes at 100 an entry: pure 16,000 + 64 x 100 = 22,400; split 4,256 + (16 + 16 + 64) x 100
    # = 13,856: 1.6x, short of OFFER_GAIN; the passes alone said 3.8x
    chain = chain_of((8, 2, 8), (1000.0, 1000.0))
    assert bracket(chain, write=100.0).cost == 13856.0
    assert choose(chain, write=100.0) is None


def test_a_chain_with_no_narrow_cut_keeps_its_pure_mode() -> None:
    chain = chain_of((8, 64, 64, 8), (1e4, 1e4, 1e4))
    assert choose(chain) is None
    assert direct(chain, 0, 3, write=0.0).cost == 8 * 3e4


def test_the_backward_weight_moves_a_piece_to_forward_mode() -> None:
    chain = chain_of((10, 12), (100.0,))
    assert direct(chain, 0, 1, reverse_weight=1.0).mode == "forward"  # 10 < 12
    assert direct(chain, 0, 1, reverse_weight=0.5).mode == "reverse"  # 6 < 10


def test_a_wide_gap_is_sure_enough_to_skip_the_pure_builds() -> None:
    # W9's shape: 512 -> 256 -> 16 -> 256 -> 512
    chain = chain_of((512, 256, 16, 256, 512), (262656.0, 8224.0, 8704.0, 262656.0))
    found = choose(chain, 1.5)
    assert found is not None
    assert found.sure
    assert [(p.start, p.stop, p.mode) for p in found.root.leaves()] == [
        (0, 2, "reverse"), (2, 4, "forward")]


def test_a_malformed_chain_is_refused() -> None:
    with pytest.raises(ValueError, match="needs 2 costs and 3 labels"):
        Chain((4, 2, 4), (1.0,), ("a", "b", "c"))
