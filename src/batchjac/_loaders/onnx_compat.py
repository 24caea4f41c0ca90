"""The private names of onnx and onnx2torch that the ONNX loader uses, each guarded.

Only this module reaches into them (tests/test_architecture.py checks). Where one is missing
or renamed in another release, the loader still loads what it can, never a wrong model:

- ``onnx.external_data_helper._get_all_tensors``: the tensors of a model whose external data
  files are hashed into the module's identity. Without it, the initializers and the tensor
  attributes of every node are walked here, subgraphs included (the same set).
- ``onnx2torch.node_converters.registry._CONVERTER_REGISTRY``: where batchjac adds its
  converters (later operator versions, ``Reshape`` with ``allowzero``, ``Gelu``). Without it,
  onnx2torch converts with its own converters only, and a model that needs batchjac's gets
  onnx2torch's error naming the operator.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from onnx import AttributeProto, external_data_helper

#: the private walker's name in ``onnx.external_data_helper`` (tests name a missing one)
WALKER = "_get_all_tensors"


def all_tensors(model: Any) -> list[Any]:
    """Every TensorProto of ``model`` (initializers and node attributes, in subgraphs too)."""
    private = getattr(external_data_helper, WALKER, None)
    if private is not None:
        try:
            return list(private(model))
        except Exception:  # a changed signature: the walk below
            pass
    return list(_walk(model.graph))


def _walk(graph: Any) -> Iterator[Any]:
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == AttributeProto.TENSOR:
                yield attribute.t
            elif attribute.type == AttributeProto.TENSORS:
                yield from attribute.tensors
            elif attribute.type == AttributeProto.GRAPH:
                yield from _walk(attribute.g)
            elif attribute.type == AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    yield from _walk(sub)


def converter_registry() -> tuple[dict[Any, Any], Any] | None:
    """onnx2torch's converter registry and its key class, or None where this onnx2torch has
    neither under those names (its own converters are then all there is)."""
    try:
        from onnx2torch.node_converters import registry
    except ImportError:
        return None
    table = getattr(registry, "_CONVERTER_REGISTRY", None)
    key = getattr(registry, "OperationDescription", None)
    if not isinstance(table, dict) or key is None:
        return None
    return table, key
