"""TorchScript and ``torch.export`` files (imports PyTorch; a framework module)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .._errors import ModelLoadError


def load_torchscript(path: str, *, trust: bool) -> Any:
    """A TorchScript archive (``torch.jit.save``). A whole pickled ``nn.Module``
    (``torch.save(model)``) runs code from the file while loading, so it is loaded only with
    ``trust``."""
    try:
        with warnings.catch_warnings():  # recent torch deprecates TorchScript; the file is given
            warnings.filterwarnings("ignore", message=".*torch.jit", category=DeprecationWarning)
            return torch.jit.load(path, map_location="cpu")
    except RuntimeError as script_error:
        if not trust:
            raise ModelLoadError(
                f"{path!r} is not a TorchScript archive ({str(script_error).splitlines()[0][:200]}). "
                f"Save models with torch.jit.save(torch.jit.script(model), path); a module pickled "
                f"with torch.save(model) runs code from the file while loading, so it is loaded "
                f"only with --trust-model."
            ) from script_error
    model = torch.load(path, map_location="cpu", weights_only=False)
    if not callable(model):
        raise ModelLoadError(f"{path!r} holds a {type(model).__name__}, not a model (a state dict? "
                             f"build the module in a .py file and pass file.py:NAME).")
    return model


def load_exported(path: str) -> Any:
    """A ``torch.export`` program (``torch.export.save``), as a function of its input.

    The module of an ``ExportedProgram`` refuses ``.eval()``/``.train()`` (its mode was fixed
    when it was exported), so it is wrapped in a plain function for the backend.
    """
    program = torch.export.load(path)
    module = program.module()

    def exported(*args: Any) -> Any:
        return module(*args)

    exported.__qualname__ = exported.__name__ = "torch_export_program"
    return exported
