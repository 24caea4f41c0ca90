"""ONNX models, translated into PyTorch modules by onnx2torch (imports onnx, onnx2torch and
PyTorch; a framework module).

An ``.onnx`` file is data (a graph of named operators and its weights), not code: loading one
runs nothing from the file, so it needs no ``--trust-model``. The graph becomes a
``torch.fx.GraphModule`` of PyTorch operators, which the PyTorch backend differentiates like any
``torch.nn.Module`` (forward or reverse mode, float64 copies for ``check``). The README says why
this route (op coverage and speed measured against a JAX interpreter of ONNX).

What onnx2torch 1.5 lacks, and this module adds (through its own registry, ``add_converter``):

- operator versions newer than the ones it registered, where the ONNX schema only widened the
  types (float8, int4, bfloat16, strings) or appended optional inputs or attributes: the newest
  converter it has serves them, and a node that *uses* an input or attribute the older version
  did not have is refused by name (:func:`_problem`). Models exported by ``torch.onnx.export``
  in torch 2.9+ are opset 18-20 (``Reshape``-19, ``Constant``-19), which it did not convert;
- ``Gelu`` (opset 20), which ``torch.onnx.export`` writes for ``nn.GELU``;
- the ``Reduce*`` operators from opset 18 on (``ReduceMean``, ``ReduceMax``, ``ReduceMin``,
  ``ReduceProd``, ``ReduceL1``, ``ReduceL2``, ``ReduceLogSum``, ``ReduceLogSumExp``,
  ``ReduceSumSquare``), whose ``axes`` became an input (``ReduceSum`` did so at 13), with
  ``noop_with_empty_axes``: one converter (:class:`_Reduce`) for all of them, ``ReduceSum``-13
  included (onnx2torch's fails on empty axes with ``keepdims=0``).

Operators it still cannot translate are named, all of them, before anything is converted
(:func:`unsupported`).

A file is known again without reading it by its stamp (:data:`Stamp`: device, inode, size,
mtime and ctime, for it and for its external data files); a changed stamp, or one too close to
the file's last change to be trusted, means reading and hashing its bytes again, and only new
bytes mean a new module. An empty or corrupt file, and bytes that protobuf reads as a message
but that hold no model, are refused naming the file. The converted module checks the inputs it
is called with (:class:`InputCheck`): a model of two inputs given one array, or inputs by names
it does not have, is told its inputs' names and the call forms that pass them.

onnx2torch imports torchvision (for two detection operators, ``NonMaxSuppression`` and
``RoiAlign``). Where torchvision is installed but its compiled operators do not load (PyPI's
torchvision wheels are built for CUDA torch, and fail to load beside a CPU build of torch), the
import of onnx2torch would fail for every model; :func:`_import_converter` then imports it with
a stand-in torchvision that names the problem if one of those two operators is ever run, and
takes the stand-in out of ``sys.modules`` again.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import stat
import sys
import threading
import time
import types
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
from onnx import defs, external_data_helper

from .._errors import InputError, ModelLoadError
from . import onnx_compat

#: converted modules by the sha256 of the model's bytes: the same file or ModelProto gives the
#: same module object, so compiled kernels, probes and tuning decisions are found again
_MODULES: OrderedDict[str, torch.nn.Module] = OrderedDict()
_KEEP = 8
_LOCK = threading.Lock()

#: A file's identity without reading it: device, inode, size, modification and status-change
#: times. The status-change time (ctime) moves on every write, and no user can set it back:
#: a file rewritten in place with other weights of the same size and its mtime restored (as
#: ``tar -x``, ``rsync -t`` and ``cp -p`` do) has a new ctime, and one replaced by a rename a
#: new inode. (Hashing the bytes instead costs 8 ms for a 10 MB file and 120 ms for 100 MB on
#: every call; a stat costs 2 us.)
Stamp = tuple[int, int, int, int, int]

#: a file's timestamps are taken from a coarse clock (a kernel tick; a second on some file
#: systems): a stamp taken within this long of the file's last change cannot tell it from a
#: change in the same tick, so the bytes are hashed again until it is older (git's "racily
#: clean" rule)
_RACY_NS = 2_000_000_000


@dataclass
class _Seen:
    """What a file was when its module was made: the stamps of the file and of its external
    data files (None for one missing), the sha256 of the file's bytes, the external files, the
    module's key, and when (``time.time_ns``, taken before the stamps) it was looked at."""

    stamps: tuple[Stamp | None, ...]
    digest: str
    externals: tuple[str, ...]
    key: str
    checked_ns: int

    def trusted(self, stamps: tuple[Stamp | None, ...]) -> bool:
        """Whether the files are still those stamps, and the stamps were taken long enough after
        the files' last change to tell any later one."""
        if stamps != self.stamps:
            return False
        latest = max((s[4] for s in stamps if s is not None), default=0)
        return latest + _RACY_NS <= self.checked_ns


#: realpath of a file -> what it was when its module was made (the newest few files)
_FILES: OrderedDict[str, _Seen] = OrderedDict()
_KEEP_FILES = 64

_DEFAULT_DOMAINS = ("", "ai.onnx")


def load_file(path: str | os.PathLike[str]) -> torch.nn.Module:
    """The PyTorch module of the ONNX model in ``path`` (its external data files, if any, are
    read from beside it). The same bytes give the same module: a file is known again by its
    stamp and those of its external data files (:data:`Stamp`: device, inode, size, mtime and
    ctime), and read and hashed again when any of them changed, so a model re-exported with new
    weights, in the file or in its external data, is a new model even where its size and
    modification time are the old ones."""
    full = os.path.realpath(path)
    checked = time.time_ns()  # before the stamps: a change after this moves a file's ctime past it
    stamp = _file_stamp(full, path)
    with _LOCK:
        seen = _FILES.get(full)
    if seen is not None and seen.trusted((stamp, *_stamps(seen.externals))):
        with _LOCK:
            module = _MODULES.get(seen.key)
            if module is not None:
                _MODULES.move_to_end(seen.key)
                if full in _FILES:
                    _FILES.move_to_end(full)
                return module
    data = _read(full, path)
    digest = hashlib.sha256(data).hexdigest()
    model = None
    if seen is not None and digest == seen.digest:
        externals = seen.externals  # the same bytes name the same external files
    else:
        model = _parse(data, full, path)
        externals = _external_files(model, os.path.dirname(full))
    stamps = (stamp, *_stamps(externals))
    key = _key(digest, externals, path)
    with _LOCK:
        _FILES[full] = _Seen(stamps, digest, externals, key, checked)
        _FILES.move_to_end(full)
        while len(_FILES) > _KEEP_FILES:
            _FILES.popitem(last=False)
        if key in _MODULES:
            _MODULES.move_to_end(key)
            return _MODULES[key]
    if model is None:
        model = _parse(data, full, path)
    if externals:
        try:
            external_data_helper.load_external_data_for_model(model, os.path.dirname(full))
        except Exception as e:
            raise ModelLoadError(f"Cannot load the model {str(path)!r}: its external data "
                                 f"({', '.join(map(repr, externals))}) cannot be read "
                                 f"({type(e).__name__}: {_first_line(e)}).") from e
    return _remember(key, _convert(model, repr(str(path))))


def _file_stamp(full: str, path: Any) -> Stamp:
    """The stamp of the model file; a path that is not a regular file (a FIFO, a device, a
    directory) is refused before it is opened (reading a FIFO would block)."""
    st = os.stat(full)
    if not stat.S_ISREG(st.st_mode):
        raise ModelLoadError(f"The ONNX model {str(path)!r} is not a regular file (it is "
                             f"{_file_kind(st.st_mode)}); give the path of the .onnx file.")
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def _read(full: str, path: Any) -> bytes:
    data = Path(full).read_bytes()
    if not data:
        raise ModelLoadError(
            f"Cannot load the model {str(path)!r}: the file is empty (0 bytes), not an ONNX "
            f"model. Was it written completely? Export or copy it again (torch.onnx.export, "
            f"onnx.save_model).")
    return data


def _parse(data: bytes, full: str, path: Any) -> onnx.ModelProto:
    """The ModelProto in ``data``: bytes that are no protobuf, or a protobuf that is no ONNX
    model (no IR version, no graph, no output), are refused naming the file."""
    try:
        model = onnx.load_model_from_string(data)
    except Exception as e:
        raise ModelLoadError(f"Cannot load the model {str(path)!r}: it is not a readable ONNX file "
                             f"({type(e).__name__}: {_first_line(e)}). Is it corrupt or truncated, "
                             f"or a model of another format?") from e
    problem = _not_a_model(model)
    if problem:
        raise ModelLoadError(f"Cannot load the model {str(path)!r}: it is not an ONNX model "
                             f"({problem}; {len(data)} bytes). Is it corrupt or truncated, or a "
                             f"file of another format?")
    return model


def _not_a_model(model: onnx.ModelProto) -> str | None:
    """What a parsed ModelProto lacks that every ONNX model has (protobuf reads many byte
    strings, even an empty one, as some message): None when it has it all."""
    if model.ir_version <= 0:
        return "it has no IR version"
    if not model.HasField("graph"):
        return "it has no graph"
    if not model.graph.output:
        return "its graph has no output"
    return None


def _key(digest: str, externals: tuple[str, ...], path: Any) -> str:
    """The key of a file's module: the sha256 of its bytes and of each of its external data
    files' bytes."""
    h = hashlib.sha256(digest.encode())
    for f in externals:
        h.update(f"\0{f}\0".encode())
        try:
            if not stat.S_ISREG(os.stat(f).st_mode):
                raise ModelLoadError(f"Cannot load the model {str(path)!r}: its external data "
                                     f"{f!r} is not a regular file.")
            part = hashlib.sha256()
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    part.update(block)
            h.update(part.digest())
        except OSError as e:
            raise ModelLoadError(f"Cannot load the model {str(path)!r}: its external data file "
                                 f"{f!r} cannot be read ({type(e).__name__}: "
                                 f"{_first_line(e)}).") from e
    return h.hexdigest()


def _external_files(model: onnx.ModelProto, base: str) -> tuple[str, ...]:
    """The external data files the model's tensors name, as full paths (sorted, once each)."""
    ext = external_data_helper
    names = {ext.ExternalDataInfo(t).location for t in onnx_compat.all_tensors(model)
             if ext.uses_external_data(t)}
    return tuple(sorted(os.path.realpath(os.path.join(base, n)) for n in names))


def _stamps(files: tuple[str, ...]) -> tuple[Stamp | None, ...]:
    """The :data:`Stamp` of each file; None for one that is missing."""
    out: list[Stamp | None] = []
    for f in files:
        try:
            st = os.stat(f)
        except OSError:
            out.append(None)
        else:
            out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


def load_proto(model: Any) -> torch.nn.Module:
    """The PyTorch module of an ``onnx.ModelProto``."""
    if not isinstance(model, onnx.ModelProto):
        raise ModelLoadError(f"Expected an onnx.ModelProto; got {type(model).__name__}.")
    key = hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()
    with _LOCK:
        if key in _MODULES:
            _MODULES.move_to_end(key)
            return _MODULES[key]
    name = model.graph.name
    what = f"(graph {name!r})" if name else "(ModelProto)"
    problem = _not_a_model(model)
    if problem:
        raise ModelLoadError(f"The onnx.ModelProto {what} is not an ONNX model: {problem}.")
    return _remember(key, _convert(model, what))


def _remember(key: str, module: torch.nn.Module) -> torch.nn.Module:
    with _LOCK:
        _MODULES[key] = module
        while len(_MODULES) > _KEEP:
            _MODULES.popitem(last=False)
    return module


def _convert(model: onnx.ModelProto, what: str) -> torch.nn.Module:
    convert = _import_converter()
    missing = unsupported(model)
    if missing:
        raise ModelLoadError(
            f"The ONNX model {what} uses operators that batchjac cannot translate to PyTorch "
            f"(onnx2torch has no converter for them): {', '.join(missing)}. Export the model with "
            f"other operators (an older opset, e.g. torch.onnx.export(..., opset_version=17)), or "
            f"pass the model in the framework it was trained in.")
    _check_interface(model, what)
    names = [i.name for i in _graph_inputs(model)]
    try:
        module = convert(model, save_input_names=all(n.isidentifier() for n in names))
    except Exception as e:
        raise ModelLoadError(f"onnx2torch could not translate the ONNX model {what}: "
                             f"{type(e).__name__}: {_first_line(e)}") from e
    try:
        params = tuple(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        params = ()
    if names and len(params) == len(names):
        module.register_forward_pre_hook(InputCheck(what, tuple(names), params),
                                         with_kwargs=True)
    return module.eval()


class InputCheck:
    """A forward pre-hook of a converted module: a call with another number of inputs than the
    graph's, or with names it does not have, is refused naming the graph's inputs and the
    call forms that give them (onnx2torch's module said "forward() missing 1 required
    positional argument: 'h'"). A class, not a closure, so that the module pickles (Dask)."""

    def __init__(self, what: str, names: tuple[str, ...], params: tuple[str, ...]) -> None:
        self.what, self.names, self.params = what, names, params

    def __repr__(self) -> str:  # (stable: no address)
        return f"InputCheck({self.what}, {self.names})"

    def __call__(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if len(args) + len(kwargs) == len(self.params) and set(kwargs) <= set(self.params[len(args):]):
            return
        raise InputError(self.message(len(args), tuple(kwargs)))

    def message(self, given: int, keys: tuple[str, ...]) -> str:
        names, params = self.names, self.params
        count = f"{len(names)} input{'s' if len(names) != 1 else ''}"
        if keys:
            got = f"the named input{'s' if len(keys) != 1 else ''} {list(keys)}"
            got += f" and {given} more" if given else ""
        else:
            got = f"{given} array{'s' if given != 1 else ''}"
        why = ""
        if given == 1 and not keys and len(names) > 1:
            why = (" (jacobian(model, unknown, known) feeds a model one array, "
                   "concat([unknown, known], axis=-1))")
        if len(names) == 1:
            fix = ("Pass one array: jacobian(model, x); for a model that takes "
                   "concat([unknown, known], axis=-1), jacobian(model, unknown, known)")
        else:
            by_name = "{" + ", ".join(f"{p!r}: {n.upper() if n.isidentifier() else 'X'}"
                                      for p, n in zip(params, names)) + "}"
            in_order = ", ".join(n.upper() if n.isidentifier() else f"X{i}"
                                 for i, n in enumerate(names))
            fix = (f"Pass one array per input, by name: jacobian(model, {by_name}, "
                   f"wrt={params[0]!r}), or as a tuple in this order: jacobian(model, "
                   f"({in_order}), wrt=0); on the command line, one --inputs file per input, "
                   f"in this order, and --wrt-input")
        renamed = "" if params == names else f" (by name here: {list(params)})"
        return (f"The ONNX model {self.what} takes {count}, {list(names)}{renamed}, and was "
                f"given {got}{why}. {fix}.")


def _graph_inputs(model: onnx.ModelProto) -> list[Any]:
    weights = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in weights]


def _check_interface(model: onnx.ModelProto, what: str) -> None:
    """One output, and inputs whose first axis (the batch) is free: batchjac feeds chunks of
    any number of rows."""
    outputs = [o.name for o in model.graph.output]
    if len(outputs) != 1:
        raise ModelLoadError(
            f"The ONNX model {what} has {len(outputs)} outputs {outputs}; batchjac differentiates "
            f"one output tensor. Keep the one you need, e.g. with onnx.utils.extract_model(path, "
            f"new_path, input_names, [{outputs[0]!r}]).")
    for value in _graph_inputs(model):
        dims = value.type.tensor_type.shape.dim
        if dims and dims[0].HasField("dim_value"):
            shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
            raise ModelLoadError(
                f"The ONNX model {what} has a fixed batch size: its input {value.name!r} has shape "
                f"{shape}, and batchjac feeds chunks of any number of rows. Export it with a "
                f"dynamic first axis: torch.onnx.export(..., dynamic_axes={{{value.name!r}: "
                f"{{0: 'n'}}}}) or dynamic_shapes=..., tf2onnx with a None batch dimension.")


def unsupported(model: onnx.ModelProto) -> list[str]:
    """The operators of ``model`` (as ``"Name (opset V)"``, in order of first use) that the
    converter cannot translate; empty when it can translate them all."""
    _import_converter()
    from onnx2torch.node_converters.registry import get_converter

    opsets = {o.domain: o.version for o in model.opset_import}
    found: dict[str, None] = {}
    for node in model.graph.node:
        domain = "" if node.domain in _DEFAULT_DOMAINS else node.domain
        version = opsets.get(domain) or (opsets.get("ai.onnx", 1) if not domain else 1)
        label = f"{domain + '.' if domain else ''}{node.op_type} (opset {version})"
        try:
            converter = get_converter(node.op_type, version, domain or defs.ONNX_DOMAIN)
        except NotImplementedError:
            found.setdefault(label)
            continue
        problem = _problem(converter, node)
        if problem:
            found.setdefault(f"{label}: {problem}")
    return list(found)


# -- what this module adds to onnx2torch's registry --------------------------------------------

_imported: Any = None
_IMPORT = threading.Lock()


def _import_converter() -> Any:
    """``onnx2torch.convert``, with the registry extended (once)."""
    global _imported
    with _IMPORT:
        if _imported is None:
            _imported = _import_onnx2torch()
            _extend_registry()
        return _imported


def _import_onnx2torch() -> Any:
    if "onnx2torch" in sys.modules:
        from onnx2torch import convert

        return convert
    try:
        import torchvision  # noqa: F401  (onnx2torch imports it; see the module docstring)
    except Exception as e:  # a torchvision whose compiled ops do not load raises RuntimeError
        reason = f"{type(e).__name__}: {_first_line(e)}"
    else:
        from onnx2torch import convert

        return convert
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    stand_in = types.ModuleType("torchvision")
    ops = types.ModuleType("torchvision.ops")

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise ModelLoadError(f"This ONNX model's NonMaxSuppression/RoiAlign operators run on "
                             f"torchvision, which does not load here ({reason}); install the "
                             f"torchvision build that matches your torch.")

    ops.nms = ops.batched_nms = ops.roi_align = unavailable  # type: ignore[attr-defined]
    stand_in.ops = ops  # type: ignore[attr-defined]
    sys.modules["torchvision"], sys.modules["torchvision.ops"] = stand_in, ops
    try:
        from onnx2torch import convert
    finally:  # the stand-in served onnx2torch's import only
        sys.modules.pop("torchvision", None)
        sys.modules.pop("torchvision.ops", None)
    return convert


class _Alias:
    """onnx2torch's converter of an older version of an operator, serving a newer version whose
    schema has the same inputs and attributes plus, at most, new optional ones at the end."""

    def __init__(self, base: Any, attributes: set[str], inputs: int) -> None:
        self.base, self.attributes, self.inputs = base, attributes, inputs

    def problem(self, node: Any) -> str | None:
        extra = sorted({a.name for a in node.attribute} - self.attributes)
        if extra:
            return f"attribute {', '.join(extra)} is not supported"
        if len([i for i in node.input if i]) > self.inputs:
            return f"more than {self.inputs} inputs are not supported"
        return None

    def __call__(self, node: Any, graph: Any) -> Any:
        return self.base(node, graph)


def _problem(converter: Any, node: Any) -> str | None:
    return converter.problem(node) if isinstance(converter, _Alias) else None


def _signature(schema: Any) -> tuple[set[str], list[str], list[str]]:
    return (set(schema.attributes), [i.name for i in schema.inputs],
            [o.name for o in schema.outputs])


def _extend_registry() -> None:
    found = onnx_compat.converter_registry()
    if found is None:  # (an onnx2torch without that registry: its own converters only)
        return
    _CONVERTER_REGISTRY, OperationDescription = found
    _register_reductions(_CONVERTER_REGISTRY, OperationDescription)
    for schema in [defs.get_schema("Reshape", 14), *_later_versions("Reshape", 14)]:
        # onnx2torch refuses allowzero=1, which torch.onnx.export (dynamo) writes on every Reshape
        _CONVERTER_REGISTRY[OperationDescription(defs.ONNX_DOMAIN, "Reshape",
                                                 schema.since_version)] = _convert_reshape
    newest: dict[str, int] = {}
    for d in list(_CONVERTER_REGISTRY):
        if d.domain == defs.ONNX_DOMAIN:
            newest[d.operation_type] = max(newest.get(d.operation_type, 0), d.version)
    for op, have in newest.items():
        base = _CONVERTER_REGISTRY[OperationDescription(defs.ONNX_DOMAIN, op, have)]
        old_attrs, old_inputs, old_outputs = _signature(defs.get_schema(op, have))
        for schema in _later_versions(op, have):
            attrs, inputs, outputs = _signature(schema)
            if not (old_attrs <= attrs and inputs[:len(old_inputs)] == old_inputs
                    and outputs == old_outputs):
                break  # a version that changed the operator: it and later ones stay unsupported
            key = OperationDescription(defs.ONNX_DOMAIN, op, schema.since_version)
            _CONVERTER_REGISTRY.setdefault(key, _Alias(base, old_attrs, len(old_inputs)))
    gelu = OperationDescription(defs.ONNX_DOMAIN, "Gelu", 20)
    _CONVERTER_REGISTRY.setdefault(gelu, _convert_gelu)


def _register_reductions(registry: dict[Any, Any], description: Any) -> None:
    """:class:`_Reduce` for every version of a ``Reduce*`` operator that takes ``axes`` as an
    input, while later versions keep that signature (a later change stays unsupported)."""
    for op, since in _REDUCTIONS.items():
        first = defs.get_schema(op, since)
        for schema in [first, *_later_versions(op, since)]:
            if _signature(schema) != _signature(first):
                break
            registry[description(defs.ONNX_DOMAIN, op, schema.since_version)] = _convert_reduce


def _later_versions(op: str, version: int) -> list[Any]:
    """The schemas of ``op`` after ``version``, oldest first."""
    found: dict[int, Any] = {}
    for v in range(version + 1, defs.onnx_opset_version() + 1):
        schema = defs.get_schema(op, v)
        if schema.since_version > version:
            found.setdefault(schema.since_version, schema)
    return [found[v] for v in sorted(found)]


class _Reshape(torch.nn.Module):
    """ONNX ``Reshape``: a 0 in ``shape`` copies the input's dimension, unless ``allowzero``
    (then it is a dimension of size 0)."""

    def __init__(self, allowzero: bool) -> None:
        super().__init__()
        self.allowzero = allowzero

    def forward(self, x: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
        dims = [int(d) for d in shape.tolist()]
        if not self.allowzero:
            dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
        return torch.reshape(x, dims)


def _convert_reshape(node: Any, graph: Any) -> Any:
    from onnx2torch.utils.common import OperationConverterResult, onnx_mapping_from_node

    return OperationConverterResult(torch_module=_Reshape(bool(node.attributes.get("allowzero", 0))),
                                    onnx_mapping=onnx_mapping_from_node(node))


def _convert_gelu(node: Any, graph: Any) -> Any:
    from onnx2torch.utils.common import OperationConverterResult, onnx_mapping_from_node

    approximate = node.attributes.get("approximate", "none")
    if isinstance(approximate, bytes):
        approximate = approximate.decode()
    return OperationConverterResult(torch_module=torch.nn.GELU(approximate=approximate),
                                    onnx_mapping=onnx_mapping_from_node(node))


#: the version from which each reduction takes ``axes`` as an input
_REDUCTIONS = {"ReduceSum": 13, **dict.fromkeys((
    "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceSumSquare"), 18)}


def _reduce_many(fn: Any) -> Any:
    """A reduction of torch's that takes several axes at once."""
    return lambda x, dims, keep: fn(x, dim=dims, keepdim=keep)


def _prod(x: torch.Tensor, dims: tuple[int, ...], keep: bool) -> torch.Tensor:
    for d in dims:  # torch.prod takes one axis; kept, so the others keep their place
        x = torch.prod(x, dim=d, keepdim=True)
    return x if keep else x.squeeze(dims)


_REDUCE_FNS: dict[str, Any] = {
    "ReduceSum": _reduce_many(torch.sum),
    "ReduceMean": _reduce_many(torch.mean),
    "ReduceMax": _reduce_many(torch.amax),
    "ReduceMin": _reduce_many(torch.amin),
    "ReduceProd": _prod,
    "ReduceL1": lambda x, dims, keep: torch.sum(torch.abs(x), dim=dims, keepdim=keep),
    "ReduceL2": lambda x, dims, keep: torch.sqrt(torch.sum(x * x, dim=dims, keepdim=keep)),
    "ReduceLogSum": lambda x, dims, keep: torch.log(torch.sum(x, dim=dims, keepdim=keep)),
    "ReduceLogSumExp": _reduce_many(torch.logsumexp),
    "ReduceSumSquare": lambda x, dims, keep: torch.sum(x * x, dim=dims, keepdim=keep),
}


class _Reduce(torch.nn.Module):
    """An ONNX ``Reduce*`` operator with ``axes`` as an input (or fixed at conversion when
    that input is a constant): no or empty ``axes`` reduce every axis, or none with
    ``noop_with_empty_axes``; negative axes count from the end."""

    def __init__(self, op: str, keepdims: bool, noop: bool, axes: list[int] | None = None
                 ) -> None:
        super().__init__()
        self.op, self.keepdims, self.noop, self.axes = op, keepdims, noop, axes

    def forward(self, x: torch.Tensor, axes: torch.Tensor | None = None) -> torch.Tensor:
        given = self.axes if axes is None else [int(a) for a in axes.reshape(-1).tolist()]
        if not given:
            if self.noop:
                return x
            given = list(range(x.dim()))
        dims = tuple(sorted({a % x.dim() for a in given})) if x.dim() else ()
        return _REDUCE_FNS[self.op](x, dims, self.keepdims)  # type: ignore[no-any-return]


def _convert_reduce(node: Any, graph: Any) -> Any:
    from onnx2torch.utils.common import (
        OnnxMapping,
        OperationConverterResult,
        get_const_value,
        onnx_mapping_from_node,
    )

    keepdims = bool(node.attributes.get("keepdims", 1))
    noop = bool(node.attributes.get("noop_with_empty_axes", 0))
    names = [name for name in node.input_values if name]
    if len(names) < 2:
        return OperationConverterResult(
            torch_module=_Reduce(node.operation_type, keepdims, noop),
            onnx_mapping=OnnxMapping(inputs=(names[0],), outputs=node.output_values))
    try:  # axes a constant (what exporters write): fixed now, the module takes the data only
        axes = get_const_value(names[1], graph)
    except KeyError:
        return OperationConverterResult(torch_module=_Reduce(node.operation_type, keepdims, noop),
                                        onnx_mapping=onnx_mapping_from_node(node))
    fixed = [int(a) for a in torch.as_tensor(axes).reshape(-1).tolist()]
    return OperationConverterResult(
        torch_module=_Reduce(node.operation_type, keepdims, noop, fixed),
        onnx_mapping=OnnxMapping(inputs=(names[0],), outputs=node.output_values))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


__all__ = ["load_file", "load_proto", "unsupported"]
