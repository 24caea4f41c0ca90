"""ONNX models (batchjac._loaders.onnx): files exported by torch.onnx.export (both exporters),
tf2onnx and skl2onnx, differentiated through their PyTorch translation.

References are independent of that translation: the source model's own Jacobians
(``torch.func.jacrev`` of the torch module, ``GradientTape.batch_jacobian`` of the Keras model,
the closed form of a scikit-learn MLP from its coefficients), and onnxruntime's outputs.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import batchjac
from batchjac._loaders import load_model
from batchjac.cli import cli

onnx = pytest.importorskip("onnx")
torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

RTOL = 1e-5


def assert_rel_close(a: np.ndarray, ref: np.ndarray, rtol: float = RTOL) -> None:
    """Norm-wise: the largest difference relative to the largest reference entry."""
    assert a.shape == ref.shape, (a.shape, ref.shape)
    scale = float(np.abs(ref).max())
    assert scale > 0, "a reference of zeros cannot tell a wrong answer"
    assert float(np.abs(a - ref).max()) <= rtol * scale, float(np.abs(a - ref).max()) / scale


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def forward(self, x: Any) -> Any:
        return self.net(x)


class CNN(torch.nn.Module):
    """A row of 36 features is a 6x6 image: conv, ReLU-free smooth activation, dense."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 3, 3, padding=1)
        self.dense = torch.nn.Linear(3 * 6 * 6, 5)

    def forward(self, x: Any) -> Any:
        z = torch.nn.functional.softplus(self.conv(x.reshape(-1, 1, 6, 6)))
        return self.dense(z.flatten(1))


class Concat(torch.nn.Module):
    """The original question's layout inside the model: two inputs, concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))

    def forward(self, u: Any, h: Any) -> Any:
        return self.net(torch.cat([u, h], dim=-1))


def _export(module: Any, args: tuple[Any, ...], path: Path, *, dynamo: bool) -> Path:
    names = ["u", "h"][: len(args)] if len(args) > 1 else ["x"]
    with warnings.catch_warnings():  # the exporters' own deprecation notes
        warnings.simplefilter("ignore")
        if dynamo:
            n = torch.export.Dim("n")
            torch.onnx.export(module, args, str(path), dynamo=True, input_names=names,
                              dynamic_shapes=tuple({0: n} for _ in args), verbose=False)
        else:
            torch.onnx.export(module, args, str(path), dynamo=False, input_names=names,
                              dynamic_axes={name: {0: "n"} for name in names})
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("onnx")
    torch.manual_seed(0)
    models: dict[str, Any] = {"mlp": MLP().eval(), "cnn": CNN().eval(), "concat": Concat().eval()}
    example = {"mlp": (torch.randn(4, 6),), "cnn": (torch.randn(4, 36),),
               "concat": (torch.randn(4, 5), torch.randn(4, 3))}
    files = {}
    for name, module in models.items():
        for dynamo in (False, True):
            files[(name, dynamo)] = _export(module, example[name], folder / f"{name}-{dynamo}.onnx",
                                            dynamo=dynamo)
    return {"dir": folder, "models": models, "files": files}


def _per_instance_jacrev(module: Any, *inputs: np.ndarray) -> np.ndarray:
    """torch.func.jacrev of the source module, one instance at a time, w.r.t. the first input."""
    t = [torch.from_numpy(a) for a in inputs]

    def one(u: Any, *rest: Any) -> Any:
        return module(u[None], *(r[None] for r in rest))[0]

    with torch.no_grad():
        return torch.func.vmap(torch.func.jacrev(one))(*t).numpy()


def _ort(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript-exporter", "dynamo-exporter"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_jacobians_equal_the_source_models(exported: dict[str, Any], name: str, dynamo: bool) -> None:
    path = exported["files"][(name, dynamo)]
    rng = np.random.default_rng(1)
    x = rng.normal(size=(37, 6 if name == "mlp" else 36)).astype("float32")
    y, jac = batchjac.jacobian(str(path), x, return_outputs=True)
    assert_rel_close(jac, _per_instance_jacrev(exported["models"][name], x))
    assert_rel_close(y, _ort(path, {"x": x}))
    for mode in ("forward", "reverse"):
        assert_rel_close(batchjac.jacobian(path, x, mode=mode), jac)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript-exporter", "dynamo-exporter"])
@pytest.mark.parametrize("name", ["mlp", "concat"])
def test_hessians_and_laplacians_equal_the_source_models(exported: dict[str, Any], name: str,
                                                         dynamo: bool) -> None:
    """Second derivatives of an ONNX file: torch.func.hessian of the source module, one
    instance at a time (float64 inputs through a float32 graph: float32 tolerances)."""
    path = exported["files"][(name, dynamo)]
    module = exported["models"][name]
    rng = np.random.default_rng(2)
    if name == "mlp":
        x = rng.normal(size=(23, 6)).astype("float32")
        hess = batchjac.hessian(str(path), x)
        with torch.no_grad():
            ref = torch.func.vmap(torch.func.hessian(lambda r: module(r[None])[0]))(
                torch.from_numpy(x)).numpy()
    else:
        u, h = rng.normal(size=(23, 5)).astype("float32"), rng.normal(size=(23, 3)).astype("float32")
        hess = batchjac.hessian(str(path), {"u": u, "h": h}, wrt="u")
        with torch.no_grad():
            ref = torch.func.vmap(torch.func.hessian(lambda a, b: module(a[None], b[None])[0]))(
                torch.from_numpy(u), torch.from_numpy(h)).numpy()
    assert_rel_close(hess, ref, rtol=1e-4)
    lap = batchjac.laplacian(str(path), x) if name == "mlp" else \
        batchjac.laplacian(str(path), {"u": u, "h": h}, wrt="u")
    assert_rel_close(lap, np.trace(ref, axis1=-2, axis2=-1), rtol=1e-4)


def test_check_hessian_takes_an_onnx_file(exported: dict[str, Any]) -> None:
    x = np.random.default_rng(3).normal(size=(9, 6)).astype("float32")
    report = batchjac.check_hessian(str(exported["files"][("mlp", False)]), x)
    assert report.passed, report
    assert report.max_rel_error.shape == (9,)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript-exporter", "dynamo-exporter"])
def test_concat_inside_the_model_with_two_inputs(exported: dict[str, Any], dynamo: bool) -> None:
    """Two ONNX inputs (unknown, known), concatenated inside: by position and by the ONNX names."""
    path = exported["files"][("concat", dynamo)]
    rng = np.random.default_rng(2)
    u, h = rng.normal(size=(29, 5)).astype("float32"), rng.normal(size=(29, 3)).astype("float32")
    ref = _per_instance_jacrev(exported["models"]["concat"], u, h)
    y, jac = batchjac.jacobian(str(path), (u, h), wrt=0, return_outputs=True)
    assert jac.shape == (29, 3, 5)
    assert_rel_close(jac, ref)
    assert_rel_close(y, _ort(path, {"u": u, "h": h}))
    assert_rel_close(batchjac.jacobian(str(path), {"u": u, "h": h}, wrt="u"), ref)


def test_a_model_proto_and_its_file_give_one_module(exported: dict[str, Any]) -> None:
    """The same bytes give the same module object, so kernels and probes are reused."""
    from batchjac._loaders import as_model

    path = exported["files"][("mlp", True)]
    proto = onnx.load(str(path))
    assert as_model(proto) is as_model(onnx.load(str(path)))
    assert as_model(str(path)) is as_model(Path(path))
    rng = np.random.default_rng(3)
    x = rng.normal(size=(11, 6)).astype("float32")
    assert_rel_close(batchjac.jacobian(proto, x), _per_instance_jacrev(exported["models"]["mlp"], x))


def test_check_propagate_and_solve_take_onnx(exported: dict[str, Any]) -> None:
    path = str(exported["files"][("mlp", False)])
    module = exported["models"]["mlp"]
    rng = np.random.default_rng(4)
    x = rng.normal(size=(12, 6)).astype("float32")
    report = batchjac.check(path, x.astype("float64"), sample=4)
    assert report.passed
    assert report.reference_dtype == "float64"
    cov = np.diag(rng.uniform(0.01, 0.1, size=6))
    res = batchjac.propagate(path, x.astype("float64"), cov=cov)
    jac = _per_instance_jacrev(module.double(), x.astype("float64"))
    module.float()
    np.testing.assert_allclose(res.cov, jac @ cov @ jac.transpose(0, 2, 1), rtol=1e-6, atol=1e-12)
    # solve: 6 unknowns -> 4 outputs is underdetermined; solve 4 of them with 2 known
    known = x[:, 4:].astype("float64")
    with torch.no_grad():
        targets = module.double()(torch.from_numpy(x.astype("float64"))).numpy()
    module.float()

    sol = batchjac.solve(path, targets, known, n_unknowns=4, x0=x[:, :4] + 0.05, dtype="float64")
    assert sol.success.all()
    np.testing.assert_allclose(sol.residual, 0, atol=1e-6)


def test_keras_model_through_tf2onnx(tmp_path: Path) -> None:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tf2onnx = pytest.importorskip("tf2onnx")
    keras.utils.set_random_seed(5)
    init = keras.initializers.RandomNormal(stddev=0.5)
    inp = keras.Input((7,))
    z = keras.layers.Dense(16, activation="tanh", bias_initializer=init)(inp)
    model = keras.Model(inp, keras.layers.Dense(3, bias_initializer=init)(z))
    path = tmp_path / "keras.onnx"
    spec = (tf.TensorSpec((None, 7), tf.float32, name="x"),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tf2onnx.convert.from_function(tf.function(lambda x: model(x)), input_signature=spec,
                                      opset=17, output_path=str(path))
    x = np.random.default_rng(6).normal(size=(21, 7)).astype("float32")
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        yt = model(xt)
    ref = tape.batch_jacobian(yt, xt).numpy()
    y, jac = batchjac.jacobian(str(path), x, return_outputs=True)
    assert_rel_close(jac, ref)
    assert_rel_close(y, _ort(path, {"x": x}))


def test_scikit_learn_mlp_through_skl2onnx(tmp_path: Path) -> None:
    sklearn_nn = pytest.importorskip("sklearn.neural_network")
    skl2onnx = pytest.importorskip("skl2onnx")
    rng = np.random.default_rng(7)
    x_train = rng.normal(size=(200, 4))
    y_train = np.sin(x_train[:, 0]) + x_train[:, 1] * x_train[:, 2]
    with warnings.catch_warnings():  # a few iterations do not converge: the weights serve anyway
        warnings.simplefilter("ignore")
        reg = sklearn_nn.MLPRegressor(hidden_layer_sizes=(12,), activation="tanh", max_iter=200,
                                      random_state=0).fit(x_train, y_train)
        proto = skl2onnx.to_onnx(reg, x_train[:1].astype("float32"), target_opset=17)
    path = tmp_path / "mlp.onnx"
    path.write_bytes(proto.SerializeToString())
    x = rng.normal(size=(15, 4)).astype("float32")
    (w1, w2), (b1, _) = reg.coefs_, reg.intercepts_
    slope = 1 - np.tanh(x.astype("float64") @ w1 + b1) ** 2  # the closed form of the MLP
    ref = np.einsum("hj,nh,ih->nji", w2, slope, w1)
    y, jac = batchjac.jacobian(proto, x, return_outputs=True)
    assert_rel_close(jac, ref)
    assert_rel_close(y, _ort(path, {proto.graph.input[0].name: x}))
    np.testing.assert_allclose(y[:, 0], reg.predict(x), rtol=1e-4)


def _graph(nodes: list[Any], *, batch: int | str = "n", outputs: tuple[str, ...] = ("y",),
           opset: int = 17) -> Any:
    helper = onnx.helper
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [batch, 3])
    ys = [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, [batch, 3]) for o in outputs]
    graph = helper.make_graph(nodes, "hand_built", [x], ys)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_an_operator_the_converter_lacks_is_named(tmp_path: Path) -> None:
    """A hand-built graph with two operators onnx2torch has no converter for: both are named,
    in the API and in the CLI (exit 5, a model that cannot be loaded)."""
    from onnx2torch.node_converters.registry import _CONVERTER_REGISTRY

    lacking = [op for op in ("Hardmax", "LpNormalization", "Shrink", "Trilu")
               if not any(d.operation_type == op for d in _CONVERTER_REGISTRY)]
    assert len(lacking) >= 2, "pick other operators: onnx2torch has learnt these"
    first, second = lacking[:2]
    helper = onnx.helper
    model = _graph([helper.make_node(first, ["x"], ["t"]), helper.make_node("Tanh", ["t"], ["s"]),
                    helper.make_node(second, ["s"], ["y"])])
    onnx.checker.check_model(model)
    path = tmp_path / "odd.onnx"
    onnx.save(model, str(path))
    x = np.random.default_rng(8).normal(size=(5, 3)).astype("float32")
    with pytest.raises(batchjac.ModelLoadError, match=rf"{first} \(opset 17\), {second} \(opset 17\)"):
        batchjac.jacobian(str(path), x)
    with pytest.raises(batchjac.ModelLoadError, match=rf"cannot translate.*{first}"):
        batchjac.jacobian(model, x)
    res = CliRunner().invoke(cli, ["compute", str(path), "-i", _npy(tmp_path, x), "-o",
                                   str(tmp_path / "j.npy")])
    assert res.exit_code == 5, res.output
    assert f"{first} (opset 17)" in res.output
    assert "Traceback" not in res.output


def test_a_fixed_batch_size_or_several_outputs_are_refused_by_name() -> None:
    helper = onnx.helper
    tanh = [helper.make_node("Tanh", ["x"], ["y"])]
    x = np.random.default_rng(9).normal(size=(5, 3)).astype("float32")
    with pytest.raises(batchjac.ModelLoadError, match=r"fixed batch size.*'x' has shape \[16, 3\]"):
        batchjac.jacobian(_graph(tanh, batch=16), x)
    two = [*tanh, helper.make_node("Sigmoid", ["x"], ["z"])]
    with pytest.raises(batchjac.ModelLoadError, match=r"2 outputs \['y', 'z'\]"):
        batchjac.jacobian(_graph(two, outputs=("y", "z")), x)
    # a later opset of a known operator (Tanh-13 serves opset 21) is translated
    jac = batchjac.jacobian(_graph(tanh, opset=21), x)
    expected = np.zeros((5, 3, 3), dtype="float32")
    idx = np.arange(3)
    expected[:, idx, idx] = 1 - np.tanh(x) ** 2
    assert_rel_close(jac, expected)


@pytest.mark.parametrize("allowzero", [0, 1])
def test_reshape_copies_a_zero_dimension_unless_allowzero(allowzero: int) -> None:
    """ONNX Reshape: a 0 in the shape copies the input's dimension (allowzero=0); allowzero=1,
    which torch's dynamo exporter writes on every Reshape (onnx2torch refuses it), is
    translated too."""
    helper = onnx.helper
    shape = [0, 3, 1] if not allowzero else [-1, 3, 1]
    nodes = [helper.make_node("Constant", [], ["s1"], value=helper.make_tensor(
                 "s1", onnx.TensorProto.INT64, [3], shape)),
             helper.make_node("Constant", [], ["s2"], value=helper.make_tensor(
                 "s2", onnx.TensorProto.INT64, [2], [0 if not allowzero else -1, 3])),
             helper.make_node("Reshape", ["x", "s1"], ["r1"], allowzero=allowzero),
             helper.make_node("Sin", ["r1"], ["r2"]),
             helper.make_node("Reshape", ["r2", "s2"], ["y"], allowzero=allowzero)]
    x = np.random.default_rng(12).normal(size=(6, 3)).astype("float32")
    jac = batchjac.jacobian(_graph(nodes, opset=19), x)
    expected = np.zeros((6, 3, 3), dtype="float32")
    idx = np.arange(3)
    expected[:, idx, idx] = np.cos(x)
    assert_rel_close(jac, expected)


def test_new_weights_in_the_external_data_file_are_a_new_model(tmp_path: Path) -> None:
    """The weights of y = tanh(x @ W) live in an external data file beside the .onnx file.
    Re-exported with new W, the .onnx file's bytes are the same (the graph and the data's
    offsets did not change); the module loaded for the old weights must not be reused."""
    helper, numpy_helper = onnx.helper, onnx.numpy_helper
    rng = np.random.default_rng(2202)
    x = rng.normal(size=(6, 3)).astype("float32")
    path, data = tmp_path / "m.onnx", tmp_path / "m.data"

    def export(w: np.ndarray) -> bytes:
        model = _graph([helper.make_node("MatMul", ["x", "W"], ["t"]),
                        helper.make_node("Tanh", ["t"], ["y"])])
        model.graph.initializer.append(numpy_helper.from_array(w, "W"))
        data.unlink(missing_ok=True)  # (onnx refuses to write over an existing data file)
        onnx.save_model(model, str(path), save_as_external_data=True, location=data.name,
                        size_threshold=0)
        return path.read_bytes()

    def reference(w: np.ndarray) -> np.ndarray:  # J[n, j, i] = (1 - tanh^2) W[i, j]
        t = np.tanh(x.astype(np.float64) @ w)
        return np.einsum("nj,ij->nji", 1 - t ** 2, w.astype(np.float64))

    w1, w2 = (rng.normal(size=(3, 3)).astype("float32") for _ in range(2))
    first = export(w1)
    assert data.exists()
    assert_rel_close(batchjac.jacobian(str(path), x), reference(w1))
    assert export(w2) == first  # the main file is byte-identical: only the data file changed
    assert_rel_close(batchjac.jacobian(str(path), x), reference(w2))


def test_a_corrupt_onnx_file_is_a_load_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"\x08\x07this is not protobuf" * 3)
    with pytest.raises(batchjac.ModelLoadError, match="not a readable ONNX file"):
        load_model(str(path))
    with pytest.raises(batchjac.InputFileError, match="does not exist"):
        batchjac.jacobian(str(tmp_path / "missing.onnx"), np.ones((2, 3), "float32"))


def _npy(folder: Path, a: np.ndarray, name: str = "x.npy") -> str:
    path = folder / name
    np.save(path, a)
    return str(path)


def test_cli_compute_on_an_onnx_file_end_to_end(exported: dict[str, Any], tmp_path: Path) -> None:
    """No --trust-model: an ONNX file is data. The stored Jacobians are the source model's."""
    path = exported["files"][("cnn", True)]
    x = np.random.default_rng(10).normal(size=(40, 36)).astype("float32")
    out = tmp_path / "jac.npy"
    res = CliRunner().invoke(cli, ["compute", str(path), "-i", _npy(tmp_path, x), "-o", str(out),
                                   "--chunk-size", "16", "-q"])
    assert res.exit_code == 0, res.output
    assert_rel_close(np.load(out), _per_instance_jacrev(exported["models"]["cnn"], x))


def test_cli_check_propagate_solve_report_on_an_onnx_file(exported: dict[str, Any],
                                                          tmp_path: Path) -> None:
    path = str(exported["files"][("mlp", True)])
    module = exported["models"]["mlp"]
    rng = np.random.default_rng(11)
    x = rng.normal(size=(10, 6)).astype("float32")
    xs = _npy(tmp_path, x)
    run = CliRunner().invoke
    res = run(cli, ["check", path, "-i", xs])
    assert res.exit_code == 0, res.output
    assert "PASSED" in res.output
    res = run(cli, ["propagate", path, "-i", xs, "--std", "0.1", "-o", str(tmp_path / "p")])
    assert res.exit_code == 0, res.output
    jac = _per_instance_jacrev(module, x).astype("float64")
    cov = np.load(tmp_path / "p" / "cov.npy")
    assert_rel_close(cov, 0.01 * jac @ jac.transpose(0, 2, 1), rtol=1e-4)
    with torch.no_grad():
        targets = module(torch.from_numpy(x)).numpy()
    res = run(cli, ["solve", path, "--targets", _npy(tmp_path, targets, "t.npy"), "-k",
                    _npy(tmp_path, x[:, 4:], "k.npy"), "--n-unknowns", "4", "-o",
                    str(tmp_path / "solved.zarr"), "-q"])
    assert res.exit_code == 0, res.output
    res = run(cli, ["report", path, "-i", xs, "-o", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "rep" / "report.md").exists()


# -- Reduce* operators from opset 18 on (axes an input) ----------------------------------------

class Reductions(torch.nn.Module):
    """Every reduction torch.onnx.export writes as a Reduce* operator: at opset 18 the axes
    are an input (ReduceMean, ReduceMax, ReduceMin, ReduceProd, ReduceL2, ReduceLogSumExp;
    ReduceSum since 13)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 12)

    def forward(self, x: Any) -> Any:
        z = torch.tanh(self.lin(x)).reshape(-1, 3, 4)
        parts = [z.mean(-1), z.amax(-1), z.amin(1), torch.exp(z).prod(-1),
                 torch.linalg.vector_norm(z, 2, dim=-1), torch.logsumexp(z, dim=1),
                 (z * z).sum(-1), z.abs().sum((1, 2), keepdim=True)]
        return torch.cat([p.reshape(x.shape[0], -1) for p in parts], -1)


_REDUCE_18 = {"ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2",
              "ReduceLogSumExp", "ReduceSum"}


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript-exporter", "dynamo-exporter"])
def test_reductions_exported_at_opset_18(tmp_path: Path, dynamo: bool) -> None:
    torch.manual_seed(1)
    module = Reductions().eval()
    path = tmp_path / "reductions.onnx"
    names = ["x"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(module, (torch.randn(4, 6),), str(path), dynamo=True,
                              opset_version=18, input_names=names, verbose=False,
                              dynamic_shapes=({0: torch.export.Dim("n")},))
        else:
            torch.onnx.export(module, (torch.randn(4, 6),), str(path), dynamo=False,
                              opset_version=18, input_names=names, dynamic_axes={"x": {0: "n"}})
    proto = onnx.load(str(path))
    assert [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [18]
    assert {n.op_type for n in proto.graph.node} >= _REDUCE_18  # what this test is about
    x = np.random.default_rng(40).normal(size=(25, 6)).astype("float32")
    y, jac = batchjac.jacobian(str(path), x, return_outputs=True)
    assert_rel_close(jac, _per_instance_jacrev(module, x))
    with torch.no_grad():
        assert_rel_close(y, module(torch.from_numpy(x)).numpy())
    assert_rel_close(y, _ort(path, {"x": x}))


def _reduction_graph() -> Any:
    """Every Reduce* operator of opset 18 in float64, on x (n, 2, 3): constant axes (negative
    ones, several, keepdims 0 and 1), axes computed by the graph (the rank minus one: the
    module reads them at run time), no axes with noop_with_empty_axes=1 (the identity)."""
    helper, tp = onnx.helper, onnx.TensorProto

    def const(name: str, values: list[int]) -> Any:
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(
            name, tp.INT64, [len(values)], values))

    nodes = [const("a_last", [-1]), const("a_mid", [1]), const("a_both", [1, 2]),
             const("one", [1]), const("flat", [0, -1]),
             helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Shape", ["shape"], ["rank"]),
             helper.make_node("Sub", ["rank", "one"], ["a_dyn"]),  # [2], not a constant
             helper.make_node("Exp", ["x"], ["ex"])]
    cases = [("ReduceMean", "x", "a_last", 1), ("ReduceMax", "x", "a_mid", 0),
             ("ReduceMin", "x", "a_both", 1), ("ReduceProd", "x", "a_last", 0),
             ("ReduceL1", "x", "a_mid", 1), ("ReduceL2", "x", "a_both", 0),
             ("ReduceLogSum", "ex", "a_last", 1), ("ReduceLogSumExp", "x", "a_mid", 0),
             ("ReduceSumSquare", "x", "a_dyn", 0), ("ReduceSum", "x", "a_dyn", 1)]
    parts = []
    for i, (op, data, axes, keep) in enumerate(cases):
        nodes.append(helper.make_node(op, [data, axes], [f"r{i}"], keepdims=keep))
        nodes.append(helper.make_node("Reshape", [f"r{i}", "flat"], [f"p{i}"]))
        parts.append(f"p{i}")
    nodes.append(helper.make_node("ReduceMean", ["x"], ["same"], noop_with_empty_axes=1))
    nodes.append(helper.make_node("Reshape", ["same", "flat"], ["p_same"]))
    nodes.append(helper.make_node("Concat", [*parts, "p_same"], ["y"], axis=1))
    x = helper.make_tensor_value_info("x", tp.DOUBLE, ["n", 2, 3])
    y = helper.make_tensor_value_info("y", tp.DOUBLE, ["n", None])
    graph = helper.make_graph(nodes, "reductions", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    return model


def test_every_reduction_of_opset_18_against_onnxruntime(tmp_path: Path) -> None:
    """The reference is onnxruntime's own: its outputs, and float64 central differences of
    them (independent of the PyTorch translation)."""
    from batchjac._finite_diff import central_differences

    model = _reduction_graph()
    path = tmp_path / "reduce18.onnx"
    onnx.save(model, str(path))
    x = np.random.default_rng(41).normal(size=(30, 2, 3))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def run(a: np.ndarray) -> np.ndarray:
        return session.run(None, {"x": np.ascontiguousarray(a)})[0]  # type: ignore[no-any-return]

    y_ref = run(x)
    assert y_ref.shape == (30, 2 + 3 + 1 + 2 + 3 + 1 + 2 + 3 + 2 + 2 + 6)  # the cases, in order
    y, jac = batchjac.jacobian(model, x, return_outputs=True)
    assert jac.dtype == np.float64
    assert_rel_close(y, y_ref, rtol=1e-12)
    assert_rel_close(jac, central_differences(run, x), rtol=1e-5)
    assert batchjac.check(str(path), x, sample=5).passed
    from batchjac._loaders.onnx import _Reduce, load_proto

    reductions = [m for m in load_proto(model).modules() if isinstance(m, _Reduce)]
    assert len(reductions) == 11
    # the axes computed by the graph, and the absent ones, are read when the module runs
    assert sorted(m.op for m in reductions if m.axes is None) == ["ReduceMean", "ReduceSum",
                                                                   "ReduceSumSquare"]


def test_a_reduction_version_still_unknown_stays_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Reduce* node the registry has no converter for (as if ReduceMean-18 were not added)
    keeps the clear error naming it."""
    from onnx2torch.node_converters.registry import _CONVERTER_REGISTRY, OperationDescription

    from batchjac._loaders import onnx as onnx_loader

    onnx_loader._import_converter()
    key = OperationDescription("", "ReduceMean", 18)
    monkeypatch.delitem(_CONVERTER_REGISTRY, key)
    helper = onnx.helper
    model = _graph([helper.make_node("ReduceMean", ["x"], ["y"], noop_with_empty_axes=1)],
                   opset=18)
    x = np.random.default_rng(42).normal(size=(4, 3)).astype("float32")
    with pytest.raises(batchjac.ModelLoadError, match=r"ReduceMean \(opset 18\)"):
        batchjac.jacobian(model, x)


@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_sum_13_over_empty_axes_reduces_everything(tmp_path: Path, keepdims: int) -> None:
    """ReduceSum-13 with empty axes (noop_with_empty_axes=0): every axis, as onnxruntime
    computes it (onnx2torch's own converter raised AttributeError with keepdims=0). Not a
    per-row model, so the translated module is called directly."""
    from batchjac._loaders.onnx import load_proto

    helper, tp = onnx.helper, onnx.TensorProto
    nodes = [helper.make_node("Constant", [], ["none"], value=helper.make_tensor(
                 "none", tp.INT64, [0], [])),
             helper.make_node("ReduceSum", ["x", "none"], ["y"], keepdims=keepdims)]
    x_info = helper.make_tensor_value_info("x", tp.FLOAT, ["n", 3])
    y_info = helper.make_tensor_value_info("y", tp.FLOAT, None)
    model = helper.make_model(helper.make_graph(nodes, "sum_all", [x_info], [y_info]),
                              opset_imports=[helper.make_opsetid("", 13)])
    path = tmp_path / "sum_all.onnx"
    onnx.save(model, str(path))
    x = np.random.default_rng(43).normal(size=(5, 3)).astype("float32")
    with torch.no_grad():
        got = load_proto(model)(torch.from_numpy(x)).numpy()
    want = _ort(path, {"x": x})
    assert got.shape == want.shape == ((1, 1) if keepdims else ())
    np.testing.assert_allclose(got, want, rtol=1e-6)
