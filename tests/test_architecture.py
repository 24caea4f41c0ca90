"""The layering of the package, read from its source: no import cycles (function-level imports
included: a cycle hidden inside a function is still a cycle), and frameworks imported only by
the modules whose job is a framework.

The graph is built from the AST of every module, so it sees every ``import`` statement
whether or not it runs; ``if TYPE_CHECKING:`` imports are left out (they never run).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import batchjac

PACKAGE = Path(batchjac.__file__).parent
FRAMEWORKS = {"tensorflow", "keras", "tf_keras", "torch", "torchvision", "jax", "jaxlib", "flax",
              "equinox", "onnx", "onnx2torch", "onnxruntime"}
#: modules whose job is one framework, and the only ones that may import it:
#: the backends (the kernels), the loaders of framework model files, the example models built
#: in each framework, and the benchmark harness (it times each framework's native answer).
FRAMEWORK_MODULES = ("batchjac._backends.", "batchjac._loaders.tensorflow", "batchjac._loaders.torch",
                     "batchjac._loaders.keras",
                     "batchjac._loaders.onnx", "batchjac._examples.keras", "batchjac._examples.torch",
                     "batchjac._examples.jax", "batchjac._bench.")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            stack.append(child)


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom,
             known: dict[str, Path]) -> Iterator[str]:
    """Absolute names of the modules ``node`` imports: for ``from X import y``, ``X.y`` when it is
    a module, and ``X`` when ``y`` is a name defined in it."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    if node.level:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    names = [f"{source}.{alias.name}" for alias in node.names]
    yield from (name for name in names if name in known)
    if any(name not in known for name in names):  # a name defined in ``source`` itself
        yield source


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    known = _modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    external: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            for target in _targets(module, path, node, known):
                if target in known and target != module:
                    edges[module].add(target)
                elif not target.startswith("batchjac"):
                    external[module].add(target.split(".")[0])
    return edges, external


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as a path that starts and ends at the same module."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_the_graph_is_read() -> None:
    edges, external = _graph()
    # a few edges that must exist, so that a parser that reads nothing cannot pass
    assert "batchjac._errors" in edges["batchjac._config"]
    assert "torch" in external["batchjac._backends.torch"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    edges, _ = _graph()
    cycle = _cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_frameworks_only_in_framework_modules() -> None:
    _, external = _graph()
    wrong = {module: sorted(names & FRAMEWORKS) for module, names in external.items()
             if names & FRAMEWORKS and not (module + ".").startswith(FRAMEWORK_MODULES)
             and not module.startswith(FRAMEWORK_MODULES)}
    assert not wrong, f"framework imports outside the backend and adapter modules: {wrong}"


#: the layers of the data flow, lowest first: a module imports only its own layer and those
#: below (the longest matching prefix places a module)
LAYERS = [
    ["batchjac._version", "batchjac._errors", "batchjac._config", "batchjac._finite_diff",
     "batchjac._closures", "batchjac._keras_compat",
     "batchjac._fit"],
    ["batchjac._spec", "batchjac._twins", "batchjac._xp", "batchjac._fingerprint", "batchjac._chain",
     "batchjac._tune.cache",
     "batchjac._tune.files", "batchjac._tune.state", "batchjac._tune.chooser"],
    ["batchjac._backends", "batchjac._loaders", "batchjac._examples"],  # the framework modules
    ["batchjac._plan", "batchjac._probes", "batchjac._sinks", "batchjac._runner",
     "batchjac._validate", "batchjac._io", "batchjac._tune.fastpath", "batchjac._arrays",
     "batchjac._estimators"],
    ["batchjac._tune.races", "batchjac._tune.policy", "batchjac._bind", "batchjac._tune",
     "batchjac._compute"],
    ["batchjac._stores", "batchjac._dask"],
    ["batchjac._jacobian", "batchjac._hessian", "batchjac._differentiable", "batchjac._evaluate",
     "batchjac._check",
     "batchjac._check_hessian", "batchjac._propagate_second",
     "batchjac._propagate",
     "batchjac._solve", "batchjac._solve_store", "batchjac._sensitivity", "batchjac._report",
     "batchjac._api"],
    ["batchjac.cli", "batchjac._demo", "batchjac._bench", "batchjac.examples", "batchjac",
     "batchjac.__main__"],
]


def _layer(module: str) -> int | None:
    best: tuple[int, int] | None = None
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[1]):
                best = (index, len(name))
    return None if best is None else best[0]


def test_imports_point_down_the_layers() -> None:
    edges, _ = _graph()
    unplaced = sorted(m for m in edges if _layer(m) is None)
    assert not unplaced, f"modules in no layer (place them in LAYERS): {unplaced}"
    up = [f"{m} -> {t}" for m, targets in sorted(edges.items()) for t in sorted(targets)
          if (_layer(t) or 0) > (_layer(m) or 0)]
    assert not up, "imports pointing up the layers: " + "; ".join(up)
    assert _layer("batchjac._backends.torch") == 2
    assert _layer("batchjac._runner") == 3


#: modules that may use a framework's private names: each backend's compat module and the ONNX
#: loader's (whose every use is guarded, with a fallback: tests/test_compat_*.py), and the
#: benchmark harness (it reads nothing private into a result)
COMPAT_MODULES = ("batchjac._backends.jax.compat", "batchjac._backends.torch.compat",
                  "batchjac._backends.tensorflow.compat", "batchjac._loaders.onnx_compat",
                  "batchjac._keras_compat")
#: dotted names that are private by the framework's own convention, beside ``_``-prefixed ones
PRIVATE_PACKAGES = ("tensorflow.python", "jax.interpreters", "jaxlib.xla_extension")


def _is_private(dotted: str) -> bool:
    parts = dotted.split(".")
    return (any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts[1:])
            or dotted.startswith(PRIVATE_PACKAGES))


def _private_uses(path: Path) -> list[str]:
    """The framework-private names ``path`` imports or reaches through a module alias:
    ``import torch.utils._pytree``, ``from jax._src import core``, ``from torch.nn.modules.batchnorm
    import _BatchNorm``, ``torch.utils._python_dispatch.TorchDispatchMode``,
    ``getattr(jax, "_src")``."""
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}
    found = []
    for statement in _imports(tree):
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                if alias.name.split(".")[0] in FRAMEWORKS:
                    aliases[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0])
                    if _is_private(alias.name):
                        found.append(alias.name)
        elif statement.module and not statement.level and statement.module.split(".")[0] in FRAMEWORKS:
            for alias in statement.names:
                dotted = f"{statement.module}.{alias.name}"
                aliases[alias.asname or alias.name] = dotted
                if _is_private(dotted):
                    found.append(dotted)
    for node in ast.walk(tree):
        chain: list[str] = []
        base: ast.AST = node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if chain and isinstance(base, ast.Name) and base.id in aliases:
            dotted = ".".join([aliases[base.id], *reversed(chain)])
            if _is_private(dotted):
                found.append(dotted)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in
                ("getattr", "hasattr") and len(node.args) >= 2 and isinstance(node.args[0], ast.Name)
                and node.args[0].id in aliases and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)):
            dotted = f"{aliases[node.args[0].id]}.{node.args[1].value}"
            if _is_private(dotted):
                found.append(dotted)
    return sorted(set(found))


def test_the_private_name_scan_sees_each_form(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import torch\nimport torch.utils._pytree as pt\nfrom jax._src import core\n"
        "from torch.nn.modules.batchnorm import _BatchNorm\nimport tensorflow as tf\n"
        "x = torch.utils._python_dispatch.TorchDispatchMode\ny = getattr(tf, '_api')\n"
        "z = tf.python.client\nok = torch.nn.functional.relu\n")
    assert _private_uses(source) == [
        "jax._src.core", "tensorflow._api", "tensorflow.python", "tensorflow.python.client",
        "torch.nn.modules.batchnorm._BatchNorm", "torch.utils._python_dispatch",
        "torch.utils._python_dispatch.TorchDispatchMode", "torch.utils._pytree"]


def test_private_framework_names_only_in_compat_modules() -> None:
    """Census #1-34 of the engine review: every private or version-specific framework name a
    module reaches by import or through a module alias is in its backend's compat module, where
    each is guarded (tests/test_compat_*.py remove each one and still get right numbers)."""
    wrong = {}
    for module, path in _modules().items():
        if module in COMPAT_MODULES or module.startswith("batchjac._bench"):
            continue
        uses = _private_uses(path)
        if uses:
            wrong[module] = uses
    assert not wrong, f"private framework names outside the compat modules: {wrong}"


def test_no_context_variables_carry_call_state() -> None:
    """What a call says (its rows, its race, the mode it asked for) reaches the kernels as an
    explicit argument (``CallBudget``), never through a ``contextvars.ContextVar`` set around
    them: a thread the call starts (a compilation beside it, a Dask worker) would not see it."""
    users = []
    for module, path in _modules().items():
        for node in _imports(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            if "contextvars" in names:
                users.append(module)
    assert not users, f"modules importing contextvars: {users}"
