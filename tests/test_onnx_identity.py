"""ONNX files known by what they hold (batchjac._loaders.onnx): a file rewritten with other
weights is a new model even with its old size and modification time; an empty, corrupt or
not-regular file is refused naming it; a model with several inputs, given them in another
form, names its inputs and the call forms that pass them.

References are closed forms of the hand-built graphs: y = x @ W has the Jacobian W^T in every
row, y = uu @ W + hh the Jacobian W^T with respect to uu and the identity with respect to hh.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import batchjac
from batchjac._loaders import as_model, load_model
from batchjac.cli import cli

onnx = pytest.importorskip("onnx")
pytest.importorskip("torch")

from batchjac._loaders import onnx as onnx_loader  # noqa: E402  (after the skips)

helper, numpy_helper = onnx.helper, onnx.numpy_helper


def linear(w: np.ndarray) -> Any:
    """y = x @ W, x of shape (n, rows of W), with W an initializer."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", w.shape[0]])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", w.shape[1]])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "linear", [x], [y],
                              initializer=[numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def two_inputs(w: np.ndarray) -> Any:
    """y = uu @ W + hh: two graph inputs, named as no variable in a test is."""
    uu = helper.make_tensor_value_info("uu", onnx.TensorProto.FLOAT, ["n", w.shape[0]])
    hh = helper.make_tensor_value_info("hh", onnx.TensorProto.FLOAT, ["n", w.shape[1]])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", w.shape[1]])
    nodes = [helper.make_node("MatMul", ["uu", "W"], ["t"]), helper.make_node("Add", ["t", "hh"], ["y"])]
    graph = helper.make_graph(nodes, "two_inputs", [uu, hh], [y],
                              initializer=[numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def closed_form(w: np.ndarray, n: int) -> np.ndarray:
    """The Jacobian of x @ W in each of n rows: J[k, j, i] = W[i, j]."""
    return np.broadcast_to(w.T.astype(np.float64), (n, w.shape[1], w.shape[0]))


def assert_close(a: Any, ref: np.ndarray) -> None:
    a = np.asarray(a)
    assert a.shape == ref.shape, (a.shape, ref.shape)
    np.testing.assert_allclose(a, ref, rtol=1e-5, atol=1e-6)


def _restore_times(path: Path, before: os.stat_result) -> None:
    """What tar -x, rsync -t and cp -p do: the file's old access and modification times."""
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.parametrize("racy_window", ["default", "none"])
def test_a_file_rewritten_with_new_weights_and_its_old_mtime_is_a_new_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, racy_window: str) -> None:
    """Rewritten in place (same inode) with other weights of the same size and its old
    modification time restored: the new weights' Jacobians. With no racy window the file's
    stamp alone (its ctime, which no user can set back) must tell; by default a file changed
    within the last two seconds is hashed again as well."""
    if racy_window == "none":
        monkeypatch.setattr(onnx_loader, "_RACY_NS", 0)
    rng = np.random.default_rng(3301)
    w1, w2 = (rng.normal(size=(4, 3)).astype(np.float32) for _ in range(2))
    x = rng.normal(size=(9, 4)).astype(np.float32)
    path = tmp_path / "linear.onnx"
    first = linear(w1).SerializeToString()
    path.write_bytes(first)
    before = os.stat(path)
    assert_close(batchjac.jacobian(str(path), x), closed_form(w1, 9))

    time.sleep(0.05)  # (timestamps come from a coarse clock: a later tick for the rewrite)
    second = linear(w2).SerializeToString()
    assert len(second) == len(first)
    assert second != first
    with open(path, "r+b") as f:  # in place: the same inode
        f.write(second)
    _restore_times(path, before)
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == \
        (before.st_ino, before.st_size, before.st_mtime_ns)
    assert_close(batchjac.jacobian(str(path), x), closed_form(w2, 9))
    assert_close(batchjac.jacobian(path, x, mode="forward"), closed_form(w2, 9))


def test_an_unchanged_file_is_known_by_its_stamp_without_reading_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The point of a stamp: a file whose stamp is old enough is not read again (hashing a
    100 MB file on every call costs 0.1 s), and gives the same module object; within the
    racy window it is read again, and still gives the same object."""
    rng = np.random.default_rng(3302)
    w = rng.normal(size=(3, 2)).astype(np.float32)
    path = tmp_path / "m.onnx"
    path.write_bytes(linear(w).SerializeToString())
    reads: list[str] = []
    real_read = onnx_loader._read
    monkeypatch.setattr(onnx_loader, "_read", lambda full, p: reads.append(full) or real_read(full, p))
    module = as_model(str(path))
    assert len(reads) == 1
    assert as_model(str(path)) is module  # just written: read and hashed again, same bytes
    assert len(reads) == 2
    monkeypatch.setattr(onnx_loader, "_RACY_NS", 0)  # as if the file were older
    assert as_model(str(path)) is module
    assert as_model(str(path)) is module
    assert len(reads) == 2  # known by the stamp the second look took: nothing read
    x = rng.normal(size=(5, 3)).astype(np.float32)
    assert_close(batchjac.jacobian(str(path), x), closed_form(w, 5))


def test_external_data_rewritten_with_its_old_mtime_is_a_new_model(tmp_path: Path) -> None:
    """The weights in an external data file, rewritten in place (the same size) with its
    modification time restored: the .onnx file is byte-identical, the data file's stamp
    (its ctime) tells."""
    rng = np.random.default_rng(3303)
    w1, w2 = (rng.normal(size=(3, 3)).astype(np.float32) for _ in range(2))
    x = rng.normal(size=(7, 3)).astype(np.float32)
    path, data = tmp_path / "m.onnx", tmp_path / "m.data"
    onnx.save_model(linear(w1), str(path), save_as_external_data=True, location=data.name,
                    size_threshold=0)
    assert_close(batchjac.jacobian(str(path), x), closed_form(w1, 7))
    main, before = path.read_bytes(), os.stat(data)

    other = tmp_path / "other"
    other.mkdir()
    onnx.save_model(linear(w2), str(other / "m.onnx"), save_as_external_data=True,
                    location=data.name, size_threshold=0)
    assert (other / "m.onnx").read_bytes() == main  # the same graph, the same offsets
    new = (other / data.name).read_bytes()
    assert len(new) == before.st_size
    assert new != data.read_bytes()
    time.sleep(0.05)
    with open(data, "r+b") as f:
        f.write(new)
    _restore_times(data, before)
    assert os.stat(data).st_mtime_ns == before.st_mtime_ns
    assert_close(batchjac.jacobian(str(path), x), closed_form(w2, 7))


def test_an_empty_onnx_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    x = np.random.default_rng(3304).normal(size=(3, 4)).astype(np.float32)
    with pytest.raises(batchjac.ModelLoadError, match=r"'.*empty\.onnx'.*empty \(0 bytes\)"):
        batchjac.jacobian(str(path), x)
    with pytest.raises(batchjac.ModelLoadError, match=r"empty \(0 bytes\)"):
        load_model(str(path))
    np.save(tmp_path / "x.npy", x)
    res = CliRunner().invoke(cli, ["compute", str(path), "-i", str(tmp_path / "x.npy"), "-o",
                                   str(tmp_path / "j.npy")])
    assert res.exit_code == 5, res.output
    assert "empty.onnx" in res.output
    assert "0 bytes" in res.output
    assert "Traceback" not in res.output
    assert "IndexError" not in res.output


@pytest.mark.parametrize("content", [b"\x08\x07", b"\x08\x07\x12\x04test", b"\x3a\x00"],
                         ids=["ir-version-only", "no-graph", "empty-graph"])
def test_a_protobuf_that_is_no_onnx_model_is_named(tmp_path: Path, content: bytes) -> None:
    """Bytes that protobuf reads as a ModelProto (it reads many) but that hold no model: the
    file is named, not an IndexError from inside the converter."""
    path = tmp_path / "odd.onnx"
    path.write_bytes(content)
    x = np.random.default_rng(3305).normal(size=(3, 4)).astype(np.float32)
    with pytest.raises(batchjac.ModelLoadError, match=r"'.*odd\.onnx'.*not an ONNX model") as e:
        batchjac.jacobian(str(path), x)
    assert "IndexError" not in str(e.value)
    with pytest.raises(batchjac.ModelLoadError, match=r"ModelProto.*not an ONNX model"):
        batchjac.jacobian(onnx.ModelProto(), x)


def test_a_fifo_named_as_an_onnx_model_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO is not read (that would block until a writer came): refused as not a regular
    file, by the API and by the command line's loader."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    fifo = tmp_path / "pipe.onnx"
    os.mkfifo(fifo)
    found: list[BaseException] = []

    def load() -> None:
        for attempt in (lambda: load_model(str(fifo)), lambda: as_model(str(fifo))):
            try:
                attempt()
            except BaseException as e:
                found.append(e)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(30)
    if worker.is_alive():  # blocked in open(): a writer releases it
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        worker.join(10)
        pytest.fail("reading the model blocked on a FIFO")
    assert len(found) == 2, found
    for e in found:
        assert isinstance(e, batchjac.ModelLoadError), e
        assert "pipe.onnx" in str(e)
        assert "not a regular file" in str(e)
        assert "FIFO" in str(e)


def test_two_inputs_given_as_unknown_and_known_are_named(tmp_path: Path) -> None:
    """jacobian(model, U, H) feeds one array, concat([U, H]); a model with two inputs says
    which it takes and how to pass them, and both forms it shows give the closed form."""
    rng = np.random.default_rng(3306)
    w = rng.normal(size=(3, 2)).astype(np.float32)
    path = tmp_path / "two.onnx"
    onnx.save(two_inputs(w), str(path))
    u, h = rng.normal(size=(6, 3)).astype(np.float32), rng.normal(size=(6, 2)).astype(np.float32)
    with pytest.raises(batchjac.InputError) as e:  # (the call's form, not the model, is wrong)
        batchjac.jacobian(str(path), u, h)
    assert not isinstance(e.value, batchjac.ModelError)
    text = str(e.value)
    for part in ("two.onnx", "['uu', 'hh']", "{'uu': ", "wrt='uu'", "wrt=0"):
        assert part in text, text
    assert "missing 1 required positional argument" not in text
    # the forms the message shows
    assert_close(batchjac.jacobian(str(path), {"uu": u, "hh": h}, wrt="uu"), closed_form(w, 6))
    assert_close(batchjac.jacobian(str(path), (u, h), wrt=0), closed_form(w, 6))
    assert_close(batchjac.jacobian(str(path), {"uu": u, "hh": h}, wrt="hh"),
                 np.broadcast_to(np.eye(2), (6, 2, 2)))
    # names the graph does not have
    with pytest.raises(batchjac.BatchJacError, match=r"\['uu', 'hh'\].*named inputs \['u', 'h'\]"):
        batchjac.jacobian(str(path), {"u": u, "h": h}, wrt="u")
    # the command line: --inputs and --known, the same mistake
    np.save(tmp_path / "u.npy", u)
    np.save(tmp_path / "h.npy", h)
    res = CliRunner().invoke(cli, ["compute", str(path), "-i", str(tmp_path / "u.npy"), "-k",
                                   str(tmp_path / "h.npy"), "-o", str(tmp_path / "j.npy")])
    assert res.exit_code == 4, res.output  # invalid input data, as docs/cli.md says
    for part in ("['uu', 'hh']", "--inputs"):
        assert part in res.output, res.output
    assert "Traceback" not in res.output


def test_one_input_given_two_arrays_is_named(tmp_path: Path) -> None:
    rng = np.random.default_rng(3307)
    w = rng.normal(size=(3, 2)).astype(np.float32)
    path = tmp_path / "one.onnx"
    onnx.save(linear(w), str(path))
    u = rng.normal(size=(4, 3)).astype(np.float32)
    with pytest.raises(batchjac.InputError, match=r"takes 1 input, \['x'\], and was given 2"):
        batchjac.jacobian(str(path), (u, u), wrt=0)
