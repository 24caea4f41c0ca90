"""What the PyTorch backend tells the user when the model fails: out of memory, leaving torch,
devices or dtypes that do not match, and the first line of any other error."""

from __future__ import annotations

import numpy as np

from ..._errors import ModelError
from .._base import Signature
from . import compat

_FORWARD_CAUSE = ("Usual cause: an operator or a custom torch.autograd.Function without a "
                  "forward-mode rule (jvp, or vmap support).")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def _first_sentence(e: Exception) -> str:
    text = _first_line(e)[:300]
    return text.split(". ", 1)[0].rstrip(".")


def _quoted(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _out_of_memory(e: Exception) -> bool:
    text = str(e)
    return isinstance(e, compat.out_of_memory_errors()) or "out of memory" in text \
        or "can't allocate memory" in text


def _explain_model_failure(e: Exception, sig: Signature) -> ModelError:
    text = f"{type(e).__name__}: {e}".strip()
    first = text.splitlines()[0][:300]
    if _out_of_memory(e):
        return ModelError(
            f"The model ran out of memory while computing the Jacobians ({first}). Lower "
            f"`max_memory` or `chunk_size` so that fewer rows are processed at once."
        )
    if "numpy()" in text or ("item()" in text and "vmap" in text):
        return ModelError(
            f"The model leaves torch ({first}): it converts tensors to numpy or Python numbers, "
            f"so gradients cannot flow through it. Write the model with torch operations only."
        )
    if "same device" in text or ("device" in text and ("cuda" in text or "mps" in text)):
        return ModelError(
            f"The model and its inputs are on different devices ({first}). batchjac moves the "
            f"inputs to the device of the model's first parameter; for a plain function pass "
            f"backend_options={{'device': 'cuda'}} (or the device its tensors live on)."
        )
    dtype_hint = ""
    lower = text.lower()
    if any(t in lower for t in ("double", "float64", "float32", "half")) and \
            any(t in lower for t in ("dtype", "scalar type", "same type")):
        dtype_hint = (f" The compute dtype is {np.dtype(sig.dtype).name}; the model holds "
                      f"tensors of another float dtype. Pass the torch.nn.Module itself "
                      f"(batchjac then casts its weights), or choose `dtype` to match.")
    return ModelError(f"Calling the model failed: {text[:2000]}.{dtype_hint}")

