"""The ONNX loader's private names (batchjac._loaders.onnx_compat), each removed in turn: the
loader still finds every tensor of a model and still loads what onnx2torch converts itself,
with the Jacobians of the closed form (y = x @ W: W^T in every row)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchjac

from .helpers import run_in_fresh_process

onnx = pytest.importorskip("onnx")
pytest.importorskip("torch")
from batchjac._loaders import onnx_compat  # noqa: E402  (after the skips)

helper, numpy_helper = onnx.helper, onnx.numpy_helper


def _with_subgraphs(rng: np.random.Generator) -> Any:
    """Initializers, a Constant node's tensor attribute and an If whose branches hold their
    own Constant tensors: every place a tensor can be."""
    def branch(name: str) -> Any:
        const = helper.make_node("Constant", [], [f"{name}_out"],
                                 value=numpy_helper.from_array(rng.normal(size=(2,)).astype(np.float32),
                                                               f"{name}_value"))
        out = helper.make_tensor_value_info(f"{name}_out", onnx.TensorProto.FLOAT, [2])
        return helper.make_graph([const], name, [], [out])

    cond = helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])
    nodes = [helper.make_node("Constant", [], ["k"],
                              value=numpy_helper.from_array(np.ones(2, np.float32), "k_value")),
             helper.make_node("If", ["c"], ["b"], then_branch=branch("then"),
                              else_branch=branch("else")),
             helper.make_node("Add", ["b", "W"], ["t"]), helper.make_node("Add", ["t", "k"], ["y"])]
    graph = helper.make_graph(nodes, "g", [cond], [y],
                              initializer=[numpy_helper.from_array(np.zeros(2, np.float32), "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_all_tensors_without_the_private_walker_finds_the_same_tensors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _with_subgraphs(np.random.default_rng(41))
    with_private = sorted(t.name for t in onnx_compat.all_tensors(model))
    assert with_private == ["W", "else_value", "k_value", "then_value"]
    monkeypatch.setattr(onnx_compat, "WALKER", "_no_such_walker")  # removed
    assert sorted(t.name for t in onnx_compat.all_tensors(model)) == with_private
    monkeypatch.setattr(onnx.external_data_helper, "_changed_walker",
                        lambda model, extra: [], raising=False)  # a changed signature
    monkeypatch.setattr(onnx_compat, "WALKER", "_changed_walker")
    assert sorted(t.name for t in onnx_compat.all_tensors(model)) == with_private


def test_external_data_is_found_without_the_private_walker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The external data files are part of a model's identity: found by the walk as well."""
    rng = np.random.default_rng(42)
    w = rng.normal(size=(3, 2)).astype(np.float32)
    x = rng.normal(size=(5, 3)).astype(np.float32)
    xv = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 3])
    yv = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 2])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "linear", [xv], [yv],
                              initializer=[numpy_helper.from_array(w, "W")])
    path = tmp_path / "m.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
                    save_as_external_data=True, location="m.data", size_threshold=0)
    monkeypatch.setattr(onnx_compat, "WALKER", "_no_such_walker")
    from batchjac._loaders import onnx as onnx_loader

    files = onnx_loader._external_files(onnx.load(str(path), load_external_data=False), str(tmp_path))
    assert files == (str((tmp_path / "m.data").resolve()),)
    jac = batchjac.jacobian(str(path), x)
    np.testing.assert_allclose(jac, np.broadcast_to(w.T, (5, 2, 3)), rtol=1e-5, atol=1e-6)


def test_without_the_converter_registry_onnx2torch_still_converts_its_own_operators(
        tmp_path: Path) -> None:
    """A fresh process (the registry is extended once per process) where onnx2torch has no
    registry under that name: a MatMul/Tanh model, which onnx2torch converts itself, still
    gives its closed-form Jacobians, diag(1 - tanh^2) W^T."""
    rng = np.random.default_rng(43)
    w = rng.normal(size=(4, 3)).astype(np.float32)
    x = rng.normal(size=(6, 4)).astype(np.float32)
    xv = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 4])
    yv = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 3])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["t"]), helper.make_node("Tanh", ["t"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [xv], [yv], initializer=[numpy_helper.from_array(w, "W")])
    path = tmp_path / "m.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    np.save(tmp_path / "x.npy", x)
    out = run_in_fresh_process(f"""
        import numpy as np, batchjac
        from batchjac._loaders import onnx_compat
        onnx_compat.converter_registry = lambda: None
        jac = batchjac.jacobian({str(path)!r}, np.load({str(tmp_path / 'x.npy')!r}))
        np.save({str(tmp_path / 'jac.npy')!r}, jac)
        print("DONE")
    """)
    assert "DONE" in out
    t = np.tanh(x.astype(np.float64) @ w.astype(np.float64))
    ref = (1 - t ** 2)[:, :, None] * w.T.astype(np.float64)[None]
    np.testing.assert_allclose(np.load(tmp_path / "jac.npy"), ref, rtol=1e-5, atol=1e-6)
