"""Mixed-mode accumulation in TensorFlow: the chain of a Keras model read from its layers, and
its Jacobians accumulated along a bracketing of it (:mod:`batchjac._chain`).

A Keras model built from inputs (a ``Sequential`` with an ``Input``, or a functional model) is a
graph of layers, listed in the order they run. A *cut* is a place in that list where one tensor
alone carries everything the later layers read (every path from the inputs to the output
crosses it: a bottleneck layer's output); where it is narrower than both the unknowns and the
outputs, the Jacobian can be accumulated through it. Each piece between two cuts is a Keras
model of its own, from the first cut's tensor to the second's (the first piece from the model's
inputs, as the bound model assembles them), and its Jacobians are computed as a whole model's
are, by the backend's forward- or reverse-mode function (:func:`.builds.jac_forward`,
:func:`.builds.jac_reverse`) on a view of the piece as a bound model; the products are batched
matrix products. The kernel traces this like its other paths, as XLA and as a plain graph.

This reader is narrower than the JAX and PyTorch ones: Keras models of one input only (the
unknowns, or the unknowns with the known inputs concatenated), cuts of one tensor, layers
called once. A model outside that (a plain ``tf.function``, a subclassed model, shared layers)
has no chain, never an error: the kernel computes in a pure mode.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from ..._chain import MIN_BASIS, Accumulation, Chain, Piece, choose
from . import compat

if TYPE_CHECKING:
    from . import TFBound


@dataclass
class KerasChain:
    """A Keras model's chain: ``pieces[(i, j)]`` the callable from cut ``i``'s values to cut
    ``j``'s (made as the bracketing needs them): a ``Sequential``'s layers between the two, in
    turn, or a functional model's sub-model from cut ``i``'s Keras tensor to cut ``j``'s;
    ``places[i]`` the layers before cut ``i``, ``tensors[i]`` its Keras tensor (functional
    models), ``shapes[i]`` its shape without the batch axis (the first: the unknowns')."""

    model: Any
    layers: list[Any]
    places: list[int]
    tensors: list[Any] | None
    shapes: list[tuple[int, ...]]
    chain: Chain
    pieces: dict[tuple[int, int], Any]

    def piece(self, i: int, j: int) -> Any:
        if (i, j) not in self.pieces:
            if self.tensors is None:  # a Sequential: its layers in turn
                layers = self.layers[self.places[i]:self.places[j]]

                def run(z: Any, training: bool = False) -> Any:
                    for layer in layers:
                        z = layer(z, training=training)
                    return z

                self.pieces[i, j] = run
            else:
                keras: Any = compat.keras_module()
                inputs = _flat(self.model.inputs)[0] if i == 0 else self.tensors[i]
                self.pieces[i, j] = keras.Model(inputs=inputs, outputs=self.tensors[j])
        return self.pieces[i, j]


def _shape(t: Any) -> tuple[int, ...] | None:
    shape = tuple(t.shape[1:])
    return None if any(d is None for d in shape) else tuple(int(d) for d in shape)


def _flat(x: Any) -> list[Any]:
    if isinstance(x, dict):
        return list(x.values())
    return list(x) if isinstance(x, (list, tuple)) else [x]


def read(bound: TFBound) -> tuple[KerasChain, Accumulation] | None:
    """The chain of ``bound``'s Keras model and its bracketing where mixed mode is offered;
    None where the model is outside this reader or no cut pays."""
    sig = bound.signature
    if not bound.is_keras or bound.output_shape is None or sig.layout.kind not in ("single", "concat") \
            or min(math.prod(sig.unknown_shape), math.prod(bound.output_shape)) < MIN_BASIS:
        return None
    try:
        found = _read(bound.model)
    except Exception:  # (a subclassed model, a layer called twice: no chain, a pure mode)
        return None
    if found is None:
        return None
    layers, places, tensors, shapes, work, labels = found
    k, m = math.prod(sig.unknown_shape), math.prod(bound.output_shape)
    narrow = [i for i in range(1, len(places) - 1) if math.prod(shapes[i]) < min(k, m)]
    if not narrow:
        return None
    keep = [0, *narrow, len(places) - 1]  # (the cuts narrower than both ends, as JAX's reader)
    places = [places[i] for i in keep]
    tensors = None if tensors is None else [tensors[i] for i in keep]
    labels = tuple(labels[i] for i in keep)
    shapes = [shapes[i] for i in keep]
    work = tuple(float(sum(work[a:b])) for a, b in itertools.pairwise(keep))
    chain = Chain((k, *(math.prod(s) for s in shapes[1:-1]), m), work, labels)
    plan = choose(chain, bound.forward_bias)
    if plan is None:
        return None
    return KerasChain(bound.model, layers, places, tensors, shapes, chain, {}), plan


def _read(model: Any) -> Any:
    keras: Any = compat.keras_module()
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    work = [2.0 * layer.count_params() + sum(math.prod(_shape(t) or (1,)) for t in _flat(layer.output))
            for layer in layers]
    if isinstance(model, keras.Sequential):  # a chain already: every layer's output a cut
        shapes = [_shape(layer.output) for layer in layers[:-1]]
        if any(shape is None for shape in shapes):
            return None
        return _chain_of(layers, [(p + 1, None, math.prod(shape or ()))
                                  for p, shape in enumerate(shapes)], work, None, shapes)
    inputs, outputs = _flat(model.inputs), _flat(model.outputs)
    if len(inputs) != 1 or len(outputs) != 1:
        return None
    made = {id(inputs[0]): 0}
    last = {id(outputs[0]): len(layers)}
    for i, layer in enumerate(layers):
        for t in _flat(layer.input):
            last[id(t)] = i
        outs = _flat(layer.output)
        for t in outs:
            made[id(t)] = i + 1
    cuts: list[tuple[int, Any, int]] = []
    by_id = {id(t): t for layer in layers for t in _flat(layer.output)}
    for p in range(1, len(layers)):
        live = [key for key, at in made.items() if at <= p and last.get(key, -1) >= p]
        if len(live) != 1 or live[0] not in by_id:
            continue
        shape = _shape(by_id[live[0]])
        if shape is None:
            return None
        cuts.append((p, by_id[live[0]], math.prod(shape)))
    return _chain_of(layers, cuts, work, [None, *(t for _, t, _ in cuts), outputs[0]],
                     [_shape(t) for _, t, _ in cuts])


def _chain_of(layers: list[Any], cuts: list[tuple[int, Any, int]], work: list[float],
              tensors: list[Any] | None, shapes: list[Any]) -> Any:
    """The reading of :func:`_read`, its cuts ``(place, tensor, width)`` given."""
    places = [0, *(p for p, _, _ in cuts), len(layers)]
    costs = tuple(float(sum(work[a:b])) for a, b in itertools.pairwise(places))
    labels = ("the unknowns",
              *(f"the {w} values after {layers[p - 1].name}" for p, _, w in cuts), "the outputs")
    return layers, places, tensors, [(), *shapes, ()], costs, labels


class _PieceModel:
    """A piece of the chain as the first-order functions see a bound model: ``apply`` runs it,
    ``signature.unknown_shape`` is the shape it is differentiated in."""

    def __init__(self, bound: TFBound, kc: KerasChain, i: int, j: int) -> None:
        self._bound, self._model, self._first = bound, kc.piece(i, j), i == 0
        shape = tuple(bound.signature.unknown_shape) if i == 0 else kc.shapes[i]
        self.signature = _Shape(shape)
        self.tf_dtype = bound.tf_dtype

    def apply(self, z: tf.Tensor, ctx: tuple[tf.Tensor, ...]) -> tf.Tensor:
        if self._first:  # the model's inputs, assembled as the bound model does
            return self._bound.apply(z, ctx, model=self._model)
        return tf.cast(self._model(z, training=False), self.tf_dtype)


@dataclass(frozen=True)
class _Shape:
    unknown_shape: tuple[int, ...]


def jacobians(bound: TFBound, u: tf.Tensor, ctx: tuple[tf.Tensor, ...], *,
              forward: Callable[..., Any], reverse: Callable[..., Any]
              ) -> tuple[tf.Tensor, tf.Tensor]:
    """``(y, J)`` of a chunk accumulated along the model's bracketing
    (:meth:`~batchjac._backends.tensorflow.TFBound.accumulation`), each piece's Jacobians by
    ``forward`` or ``reverse`` (:func:`.builds.jac_forward`, :func:`.builds.jac_reverse`)."""
    found = bound.accumulation()
    assert found is not None
    kc, plan = found
    rows = tf.shape(u)[0]
    values: dict[int, tf.Tensor] = {0: u}

    def value(i: int) -> tf.Tensor:  # the forward evaluation, cut after cut
        if i not in values:
            values[i] = _PieceModel(bound, kc, i - 1, i).apply(value(i - 1), ctx)
        return values[i]

    def piece(p: Piece) -> tf.Tensor:
        if not p.leaf:
            assert p.left is not None
            assert p.right is not None
            return tf.matmul(piece(p.right), piece(p.left))
        jac = forward if p.mode == "forward" else reverse
        y, j = jac(_PieceModel(bound, kc, p.start, p.stop), value(p.start), ctx)  # type: ignore[arg-type]
        values.setdefault(p.stop, y)
        w = kc.chain.widths
        return tf.reshape(j, (rows, w[p.stop], w[p.start]))

    jac = piece(plan.root)
    y = value(len(kc.chain.widths) - 1)
    return y, tf.reshape(jac, tf.concat([tf.shape(y), list(bound.signature.unknown_shape)], axis=0))
