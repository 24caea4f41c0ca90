"""Backend registry: detection from the model's type, lazy imports, install hints."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import batchjac
from batchjac._backends import detect


def test_import_without_any_framework() -> None:
    code = textwrap.dedent(
        """
        import sys
        for name in ("tensorflow", "keras", "torch", "jax", "jaxlib"):
            sys.modules[name] = None  # any import of it raises ImportError
        import numpy as np
        import batchjac
        assert not any(m in sys.modules and sys.modules[m] is not None
                       for m in ("tensorflow", "torch", "jax"))
        class Net:  # looks like a torch module to the detector
            pass
        Net.__module__ = "torch.nn.modules.module"
        try:
            batchjac.jacobian(Net(), np.ones((3, 2), np.float32))
        except batchjac.BackendNotAvailableError as e:
            assert isinstance(e, ImportError)
            print(e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install batchjac[torch]" in out.stdout


def test_detect_by_type_and_references() -> None:
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert detect(model) == "tensorflow"
    assert detect(tf.function(lambda x: x)) == "tensorflow"

    def uses_tf(x):
        return tf.sin(x)

    assert detect(uses_tf) == "tensorflow"
    assert detect(lambda x: model(x)) == "tensorflow"  # via the closure


def test_detect_through_a_global_function_as_at_a_scripts_top_level() -> None:
    """``batchjac.jacobian(lambda z: model(z), x)`` at a script's or a notebook's top level:
    ``model`` is a global there (a plain function whose own code uses the framework), not a
    closure cell, and is read the same way."""
    pytest.importorskip("jax")
    from batchjac._examples import jax as jax_examples

    scope = {"model": jax_examples.mlp((3, 4, 2), seed=1), "scale": 2.0}
    wrapper = eval("lambda z: scale * model(z)", scope)  # (a lambda of that module's globals)
    assert detect(wrapper) == "jax"
    x = np.random.default_rng().normal(size=(5, 3)).astype(np.float32)
    np.testing.assert_allclose(batchjac.jacobian(wrapper, x), 2 * batchjac.jacobian(scope["model"], x),
                               rtol=1e-5, atol=1e-6)
    helper = eval("lambda z: abs(z) + len(str(z))", {})  # (builtins only: still undetectable)
    with pytest.raises(batchjac.InputError, match="refers to no known framework"):
        detect(helper)


def test_undetectable_model_asks_for_backend() -> None:
    with pytest.raises(batchjac.InputError, match="Pass backend='tensorflow', 'torch' or 'jax'"):
        detect(lambda x: x * 2)
