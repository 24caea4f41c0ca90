"""Loading models named on the command line.

``MODEL`` may be a Keras file (``.keras``, ``.h5``), a TensorFlow SavedModel directory, a
TorchScript file (``.pt``/``.pth``), a ``torch.export`` file (``.pt2``), an ONNX file
(``.onnx``: translated into a PyTorch module, :mod:`.onnx`), or a Python callable as
``package.module:attr`` or ``path/to/file.py:attr`` (the user's own code: it runs as given;
``attr`` may be dotted, and ``attr()`` calls a zero-argument factory).

Like the backends, only the modules of this package named after a framework import that
framework, and only when a model of that kind is loaded. Each loader returns the model and a
fingerprint for resumable stores: the hash of the model file's bytes (of every file of a
SavedModel directory), or for Python callables the hash of the object itself
(:func:`batchjac._fingerprint.model_fingerprint`) and of the ``.py`` file.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import InputFileError, ModelLoadError as ModelLoadError
from .._fingerprint import file_fingerprint, model_fingerprint

KERAS_SUFFIXES = (".keras", ".h5", ".hdf5")
TORCHSCRIPT_SUFFIXES = (".pt", ".pth", ".jit")
EXPORT_SUFFIXES = (".pt2",)
ONNX_SUFFIXES = (".onnx",)
MODEL_FORMATS_HELP = ("a Keras .keras/.h5 file, a TensorFlow SavedModel directory, a TorchScript "
                      ".pt file, a torch.export .pt2 file, an ONNX .onnx file, or a Python "
                      "callable as module:attr or file.py:attr")
_ONNX_HINT = "ONNX models need `pip install batchjac[onnx]`"


@dataclass(frozen=True)
class LoadedModel:
    model: Any
    backend: str | None  # None: detect from the model
    fingerprint: str
    description: str


def load_model(ref: str, *, trust: bool = False) -> LoadedModel:
    """Load the model named by ``ref`` (see the module docstring)."""
    path = Path(ref)
    if not path.exists() and ":" in ref:
        target, attr = ref.rsplit(":", 1)
        return _load_callable(target, attr)
    if not path.exists():
        raise InputFileError(f"The model {ref!r} does not exist (give {MODEL_FORMATS_HELP}).")
    if path.is_dir():
        if (path / "saved_model.pb").exists() or (path / "saved_model.pbtxt").exists():
            from . import tensorflow as tf_loader

            model = _guard(ref, lambda: tf_loader.load_saved_model(ref))
            return LoadedModel(model, "tensorflow", file_fingerprint(ref), f"SavedModel {ref}")
        raise InputFileError(f"The model directory {ref!r} is not a TensorFlow SavedModel (it has no "
                             f"saved_model.pb); give {MODEL_FORMATS_HELP}.")
    if not os.access(ref, os.R_OK):
        raise InputFileError(f"The model file {ref!r} is not readable (permission denied).")
    suffix = path.suffix.lower()
    if suffix in KERAS_SUFFIXES:
        _check_keras_file(ref, suffix)
        from . import keras as keras_loader

        model = _guard(ref, lambda: keras_loader.load_keras(ref, trust=trust))
        # computed on the backend Keras runs on (KERAS_BACKEND): detected from the model
        return LoadedModel(model, None, file_fingerprint(ref), f"Keras model {ref}")
    if suffix in TORCHSCRIPT_SUFFIXES:
        from . import torch as torch_loader

        model = _guard(ref, lambda: torch_loader.load_torchscript(ref, trust=trust))
        return LoadedModel(model, "torch", file_fingerprint(ref), f"TorchScript model {ref}")
    if suffix in EXPORT_SUFFIXES:
        from . import torch as torch_loader

        model = _guard(ref, lambda: torch_loader.load_exported(ref))
        return LoadedModel(model, "torch", file_fingerprint(ref), f"torch.export model {ref}")
    if suffix in ONNX_SUFFIXES:  # data, not code: nothing in the file runs, so no trust needed
        from . import onnx as onnx_loader

        model = _guard(ref, lambda: onnx_loader.load_file(ref), hint=_ONNX_HINT)
        return LoadedModel(model, "torch", file_fingerprint(ref), f"ONNX model {ref}")
    if suffix == ".py":
        raise InputFileError(f"{ref!r} is Python code: name the model in it as {ref}:NAME.")
    raise InputFileError(f"Unknown model format {suffix or '(no suffix)'!r} for {ref!r}; give "
                         f"{MODEL_FORMATS_HELP}.")


_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def _check_keras_file(ref: str, suffix: str) -> None:
    """A ``.keras`` model is a zip archive and a ``.h5`` one an HDF5 file: anything else (a
    corrupt or truncated download, a file of another format) is named as not a Keras file,
    before TensorFlow is imported (Keras itself said 'File not found' for it)."""
    import zipfile

    if suffix == ".keras":
        if zipfile.is_zipfile(ref):
            return
        kind = "a zip archive"
    else:
        with open(ref, "rb") as f:  # the signature is at 0, or after a user block of 512 * 2^k
            for offset in (0, 512, 1024, 2048, 4096):
                f.seek(offset)
                if f.read(8) == _HDF5_SIGNATURE:
                    return
        kind = "an HDF5 file"
    raise ModelLoadError(f"Cannot load the model {ref!r}: it is not a Keras file. A {suffix} model "
                         f"is {kind} (written by model.save('model{suffix}')), and this file is "
                         f"not one: is it corrupt or truncated, or a model of another format?")


def as_model(model: Any) -> Any:
    """What the public verbs differentiate when given ``model``: an ONNX model (a path to a
    ``.onnx`` file, or an ``onnx.ModelProto``) becomes its PyTorch module (the same object
    for the same bytes, so kernels and decisions are reused); anything else is returned as it
    is. Imports onnx only for an ONNX model."""
    if isinstance(model, (str, os.PathLike)) and Path(model).suffix.lower() in ONNX_SUFFIXES:
        ref = os.fspath(model)
        if not Path(ref).exists():  # (one that is not a regular file is refused by load_file)
            raise InputFileError(f"The ONNX model file {ref!r} does not exist.")
        from . import onnx as onnx_loader

        return _guard(ref, lambda: onnx_loader.load_file(ref), hint=_ONNX_HINT)
    if type(model).__name__ == "ModelProto" and type(model).__module__.startswith("onnx"):
        from . import onnx as onnx_loader

        return _guard("the onnx.ModelProto", lambda: onnx_loader.load_proto(model), hint=_ONNX_HINT)
    return model


def _guard(ref: str, load: Any, *, hint: str | None = None) -> Any:
    """Framework errors while loading become one ModelLoadError naming the file."""
    try:
        return load()
    except (ModelLoadError, InputFileError):
        raise
    except ImportError as e:
        extra = hint or ("Install the extra, e.g. pip install batchjac[tensorflow] or "
                         "batchjac[torch]")
        raise ModelLoadError(f"Loading {ref!r} needs a framework that is not installed: {e}. "
                             f"{extra}.") from e
    except Exception as e:
        raise ModelLoadError(f"Cannot load the model {ref!r}: {type(e).__name__}: "
                             f"{_first_line(e)}") from e


def _load_callable(target: str, attr: str) -> LoadedModel:
    call = attr.endswith("()")
    attr = attr[:-2] if call else attr
    if not attr:
        raise InputFileError(f"Name the callable after the colon: {target}:NAME.")
    if target.endswith(".py"):
        if not Path(target).is_file():
            raise InputFileError(f"The model file {target!r} does not exist.")
        module = _run_file(target)
        extra = file_fingerprint(target)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name and (target == e.name or target.startswith(e.name + ".")):
                raise InputFileError(f"Cannot import module {target!r}: it cannot be imported, there is "
                                     f"no such Python module (from the model {target}:{attr}); is it "
                                     f"installed, or on PYTHONPATH?") from None
            raise ModelLoadError(f"Importing {target!r} failed: {type(e).__name__}: {e}") from e
        except Exception as e:
            raise ModelLoadError(f"Importing {target!r} failed: {type(e).__name__}: "
                                 f"{_first_line(e)}") from e
        extra = ""
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelLoadError(f"{target!r} has no attribute {attr!r}.")
        obj = getattr(obj, part)
    if call:
        try:
            obj = obj()
        except Exception as e:
            raise ModelLoadError(f"Calling {target}:{attr}() failed: {type(e).__name__}: "
                                 f"{_first_line(e)}") from e
    if not callable(obj):
        raise ModelLoadError(f"{target}:{attr} is a {type(obj).__name__}, not a callable model.")
    fingerprint = model_fingerprint(obj) + (f"+{extra}" if extra else "")
    return LoadedModel(obj, None, fingerprint, f"{target}:{attr}")


def _run_file(path: str) -> Any:
    """Import a .py file as a module (its directory first on sys.path, for its own imports)."""
    full = os.path.abspath(path)
    name = "batchjac_model_" + Path(full).stem.replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise InputFileError(f"Cannot import {path!r} as Python code.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = os.path.dirname(full)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ModelLoadError(f"Running {path!r} failed: {type(e).__name__}: {_first_line(e)} "
                             f"(run `python {path}` to see the traceback).") from e
    return module


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
