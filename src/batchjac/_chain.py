"""Mixed-mode accumulation: a per-instance Jacobian through the model's narrow cuts.

A pure mode pushes ``k`` tangents through the whole model (forward) or pulls ``m`` cotangents
back through it (reverse). A model whose values pass through a narrow layer (an autoencoder's
code, a surrogate's bottleneck) is a chain ``x = z_0 -> z_1 -> ... -> z_L = y`` of *cuts*,
sets of values every path from the unknowns to the outputs crosses, ``w_i`` wide. Its Jacobian
is the product of the pieces' Jacobians, ``J = J_L ... J_1``, and each piece between two cuts
can be computed in the mode that suits its ends: a piece from a 512-wide input to a 16-wide
cut takes 16 backward passes, not 512 (Naumann, "Optimal Jacobian accumulation is
NP-complete", 2008: on a chain it is a matrix-chain bracketing, solved exactly by dynamic
programming; Griewank and Walther, "Evaluating Derivatives", ch. 9).

This module is the framework-free part: the chain as numbers (:class:`Chain`, which a backend
reads from its model's IR: :mod:`batchjac._backends.jax.chain`), the optimal bracketing of it
(:func:`bracket`) and the decision whether it is worth offering against the pure modes
(:func:`choose`). The backend computes the pieces and the products per instance.

Costs are floating-point operations per instance, as the backends count them from their IR:
a piece ``i -> j`` computed directly costs ``w_i`` tangent passes or ``w_j`` backward passes
through it (a backward pass weighing ``reverse_weight`` tangent passes, the backend's
``forward_bias``), each pass the piece's own work; joining ``i -> s`` and ``s -> j`` costs
the product of a ``w_j x w_s`` by a ``w_s x w_i`` matrix, ``2 w_i w_s w_j``. Each Jacobian
made, a piece's or a product's, costs ``write`` operations an entry besides: where the passes
are few, writing the ``m x k`` result is most of the time, and a count of operations alone
overstated the gain severalfold (docs/thresholds.md, ``WRITE_FLOPS``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

PieceMode = Literal["forward", "reverse"]

#: the bracketing is offered only where its estimated cost is at most the better pure mode's
#: divided by this: the count leaves out the writes of the Jacobian, the same for every
#: bracketing, and the products' memory traffic, and a smaller gain is not worth a build that
#: might lose
OFFER_GAIN = 2.0
#: ... and it runs without racing the pure modes where it is estimated this many times cheaper:
#: a race on the calls runs the slower contender on some of them, which costs more than a
#: bracketing that far ahead could lose (docs/thresholds.md, ``SURE_GAIN``)
SURE_GAIN = 3.0
#: what writing one entry of a Jacobian weighs, in operations: a fresh array's entries are
#: written at memory speed, hundreds of times slower than a matrix product's operations
WRITE_FLOPS = 200.0
#: the narrowest cuts a chain keeps (the dynamic program is cubic in them)
MAX_CUTS = 24
#: the basis (``min(k, m)``) below which no chain is read: a cut would have to be narrower than
#: half of it to pass :data:`OFFER_GAIN`, and reading the chain costs a trace of the model
MIN_BASIS = 16


@dataclass(frozen=True)
class Chain:
    """A model's chain of cuts: ``widths[0]`` the unknowns (``k``), ``widths[-1]`` the outputs
    (``m``), the cuts between in the order the values are computed; ``costs[i]`` the work of one
    tangent pass through the piece from cut ``i`` to cut ``i + 1``; ``labels[i]`` what cut
    ``i`` is, for the explanation."""

    widths: tuple[int, ...]
    costs: tuple[float, ...]
    labels: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.widths) < 2 or len(self.costs) != len(self.widths) - 1 or \
                len(self.labels) != len(self.widths):
            raise ValueError(f"a chain of {len(self.widths)} cuts needs {len(self.widths) - 1} "
                             f"costs and {len(self.widths)} labels; got {len(self.costs)} and "
                             f"{len(self.labels)}")

    def work(self, i: int, j: int) -> float:
        """One tangent pass from cut ``i`` to cut ``j``."""
        return float(sum(self.costs[i:j]))


@dataclass(frozen=True)
class Piece:
    """A node of a bracketing: the Jacobian from cut ``start`` to cut ``stop``, computed
    directly in ``mode`` (a leaf), or the product of ``left`` (``start -> split``) and ``right``
    (``split -> stop``); ``cost`` its estimated work, the parts' included."""

    start: int
    stop: int
    cost: float
    mode: PieceMode | None = None
    left: Piece | None = None
    right: Piece | None = None

    @property
    def leaf(self) -> bool:
        return self.mode is not None

    def leaves(self) -> list[Piece]:
        if self.leaf:
            return [self]
        assert self.left is not None
        assert self.right is not None
        return [*self.left.leaves(), *self.right.leaves()]

    def describe(self, chain: Chain) -> str:
        """The bracketing in words: each leaf's mode and ends, the products as brackets."""
        if self.leaf:
            passes = chain.widths[self.start] if self.mode == "forward" else chain.widths[self.stop]
            return (f"{self.mode} from {chain.labels[self.start]} to {chain.labels[self.stop]} "
                    f"({passes} {'tangents' if self.mode == 'forward' else 'backward passes'})")
        assert self.left is not None
        assert self.right is not None
        inner = f"{self.left.describe(chain)}, then {self.right.describe(chain)}"
        return inner if self.start == 0 and self.stop == len(chain.widths) - 1 else f"[{inner}]"


def direct(chain: Chain, i: int, j: int, reverse_weight: float = 1.0,
           write: float = WRITE_FLOPS) -> Piece:
    """The piece ``i -> j`` computed in one pure mode, the cheaper by the count (forward on a
    tie: no stored values for the backward passes)."""
    work, written = chain.work(i, j), write * chain.widths[i] * chain.widths[j]
    forward = chain.widths[i] * work + written
    reverse = reverse_weight * chain.widths[j] * work + written
    if forward <= reverse:
        return Piece(i, j, forward, "forward")
    return Piece(i, j, reverse, "reverse")


def bracket(chain: Chain, reverse_weight: float = 1.0, write: float = WRITE_FLOPS) -> Piece:
    """The cheapest way to accumulate the chain's Jacobian, by the count: over every piece
    ``i -> j``, the cheaper of computing it directly and of the best split ``s`` between,
    ``best(i, s) + best(s, j) + 2 w_i w_s w_j + write w_i w_j`` (the matrix-chain
    recurrence, ``O(L^3)``)."""
    w = chain.widths
    last = len(w) - 1

    @functools.cache
    def best(i: int, j: int) -> Piece:
        piece = direct(chain, i, j, reverse_weight, write)
        for s in range(i + 1, j):
            left, right = best(i, s), best(s, j)
            cost = left.cost + right.cost + (2.0 * w[s] + write) * w[i] * w[j]
            if cost < piece.cost:
                piece = Piece(i, j, cost, None, left, right)
        return piece

    return best(0, last)


@dataclass(frozen=True)
class Accumulation:
    """The bracketing a model's Jacobian is offered in, with what it was weighed against:
    ``pure`` the cost of each pure mode, ``sure`` whether it is so far ahead that the pure modes
    are not raced against it."""

    chain: Chain
    root: Piece
    pure: dict[str, float]

    @property
    def gain(self) -> float:
        return min(self.pure.values()) / self.root.cost

    @property
    def passes(self) -> int:
        """The most passes one piece holds at once (a row's memory scales with it)."""
        w = self.chain.widths
        return max(w[p.start] if p.mode == "forward" else w[p.stop] for p in self.root.leaves())

    @property
    def sure(self) -> bool:
        return self.gain >= SURE_GAIN

    def describe(self) -> str:
        pure = ", ".join(f"{mode} {cost:.3g}" for mode, cost in self.pure.items())
        return (f"mixed mode: {self.root.describe(self.chain)}; counted {self.root.cost:.3g} "
                f"operations a row against {pure} ({self.gain:.1f}x fewer)")


def choose(chain: Chain | None, reverse_weight: float = 1.0, write: float = WRITE_FLOPS
           ) -> Accumulation | None:
    """The chain's best bracketing where it beats both pure modes by :data:`OFFER_GAIN`, else
    None (the pure modes, as the shapes choose them)."""
    if chain is None:
        return None
    last = len(chain.widths) - 1
    work, written = chain.work(0, last), write * chain.widths[0] * chain.widths[last]
    pure = {"forward": chain.widths[0] * work + written,
            "reverse": reverse_weight * chain.widths[last] * work + written}
    root = bracket(chain, reverse_weight, write)
    if root.leaf or root.cost <= 0 or min(pure.values()) < OFFER_GAIN * root.cost:
        return None
    return Accumulation(chain, root, pure)
