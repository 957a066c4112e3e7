"""The house: jaxspec's imports flow one way. Built from the source with `ast` (imports inside
functions count too), so it needs no import of the package and catches a cycle before it bites."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jaxspec"

# The rooms of docs/layout.md, lower first: a module imports only modules of its own room or of a room
# listed before it (`test_rooms_import_only_rooms_below_them`). The top-level package (`jaxspec`,
# `jaxspec.__main__`) is the API above them all; `jaxspec.testing` (test-only helpers) sits above checkpoint
# (its release-folder writers use the checkpoint's numpy formats).
ROOMS = ["core", "ops", "sharding", "layers", "model", "speculation", "checkpoint", "testing", "cost", "training",
         "harness", "serve", "cli"]

# Within and across the rooms, modules in finer ranks, lower first: a module may import modules of its own
# rank or below, never above.
RANKS = [
    # plain-int checks below everything; the rooms' __init__ files hold a docstring and nothing else
    ("jaxspec.core.checks", "jaxspec.core", "jaxspec.model", "jaxspec.training", "jaxspec.harness"),
    # The safetensors reader, the FP8 / FP4 formats and the damaged-file errors need numpy only (the
    # checkpoint package's __init__ is higher, so only checkpoint modules may import them).
    ("jaxspec.core.hf_fields",),
    ("jaxspec.core.v41",),
    ("jaxspec.core.config", "jaxspec.core.spec", "jaxspec.core.dspark", "jaxspec.core.programs", "jaxspec.core.measure",
     "jaxspec.core.gpu_export", "jaxspec.core.stream", "jaxspec.training.tokenizer", "jaxspec.training.data",
     "jaxspec.training.optim", "jaxspec.speculation.auto", "jaxspec.checkpoint.safetensors_io",
     "jaxspec.checkpoint.quant", "jaxspec.checkpoint.errors"),
    ("jaxspec.ops", "jaxspec.sharding.rules"),
    ("jaxspec.sharding.active", "jaxspec.sharding"),
    ("jaxspec.ops.pallas",),
    ("jaxspec.layers",),
    ("jaxspec.model.rings", "jaxspec.model.state_v41", "jaxspec.model.v41"),
    ("jaxspec.model.state", "jaxspec.model.sampling"),
    ("jaxspec.model.network", "jaxspec.model.dspark_v41"),
    ("jaxspec.model.prefill", "jaxspec.model.dspark"),
    ("jaxspec.model.placement", "jaxspec.model.runner", "jaxspec.model.prefill_plan"),
    ("jaxspec.speculation",),
    ("jaxspec.speculation.cycle",),
    ("jaxspec.speculation.generate", "jaxspec.speculation.stages"),
    ("jaxspec.speculation.slots",),
    # What runs the model: loading and measuring below, the loops that drive them above.
    ("jaxspec.checkpoint", "jaxspec.harness.stages", "jaxspec.harness.report", "jaxspec.harness.fit_values",
     "jaxspec.training.packing", "jaxspec.training.plots", "jaxspec.cost"),
    ("jaxspec.testing",),
    ("jaxspec.cost.xla", "jaxspec.harness.eval", "jaxspec.training.train", "jaxspec.training.dspark"),
    ("jaxspec.harness.tune", "jaxspec.training.distill", "jaxspec.training.dspark_anchors", "jaxspec.harness.calibrate",
     "jaxspec.harness.calibrate_residual", "jaxspec.harness.calibrate_block"),
    ("jaxspec.serve",),
    ("jaxspec.cli",),
    ("jaxspec", "jaxspec.__main__"),
]
MAX_LINES = 500
MAX_FUNCTION_LINES = 100


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: set[str]) -> set[str]:
    """jaxspec modules `path` imports: a package's __init__ too when a submodule of it is imported
    from outside the package (Python runs it first); the top-level `jaxspec` facade excepted."""
    own = _module_name(path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            while name and name not in modules:  # `from pkg import name` imports pkg.name only if it is a module
                name = name.rpartition(".")[0]
            if not name:
                continue
            found.add(name)
            name = name.rpartition(".")[0]
            while name.count(".") and not own.startswith(name + "."):  # enclosing packages' __init__
                found.add(name)
                name = name.rpartition(".")[0]
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}


def _rank(module: str) -> int:
    best = None
    for rank, prefixes in enumerate(RANKS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    if best is None:
        raise AssertionError(f"{module} has no rank in tests/test_imports.py RANKS: place it")
    return best[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_import_graph_has_no_cycle():
    assert _cycles(_graph()) == []


def test_imports_flow_from_higher_rooms_to_lower_ones():
    upward = [(m, dep) for m, deps in _graph().items() for dep in sorted(deps) if _rank(dep) > _rank(m)]
    assert upward == [], "imports of a higher room: " + ", ".join(f"{m} -> {d}" for m, d in upward)


def _room(module: str) -> int | None:
    """Index in ROOMS of a module's room (None: the top-level package)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] == "__main__":
        return None
    if parts[1] not in ROOMS:
        raise AssertionError(f"{module} is in no room of tests/test_imports.py ROOMS (docs/layout.md): place it")
    return ROOMS.index(parts[1])


def test_rooms_import_only_rooms_below_them():
    """The contract of docs/layout.md, checked on rooms, not only modules: no arrow from a room to one above it."""
    up = sorted({(ROOMS[_room(m)], ROOMS[_room(d)]) for m, deps in _graph().items() for d in deps
                 if _room(m) is not None and _room(d) is not None and _room(d) > _room(m)})
    assert up == [], "a room imports a room above it: " + ", ".join(f"{a} -> {b}" for a, b in up)


def test_the_rooms_are_the_package_folders():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders | {"testing"} == set(ROOMS)


@pytest.mark.parametrize("room", ["jaxspec.layers", "jaxspec.ops.pallas", "jaxspec.ops"])
def test_layers_and_kernels_import_nothing_above_them(room):
    allowed = {
        "jaxspec.ops": ("jaxspec.core.checks", "jaxspec.core.config", "jaxspec.ops"),
        "jaxspec.ops.pallas": ("jaxspec.core.checks", "jaxspec.core.config", "jaxspec.ops", "jaxspec.ops.pallas"),
        "jaxspec.layers": ("jaxspec.core.checks", "jaxspec.core.config", "jaxspec.ops", "jaxspec.ops.pallas",
                           "jaxspec.layers", "jaxspec.sharding.rules", "jaxspec.sharding.active", "jaxspec.sharding"),
    }[room]
    bad = [(m, d) for m, deps in _graph().items() if m == room or m.startswith(room + ".")
           for d in deps if d != "jaxspec.core" and not any(d == a or d.startswith(a + ".") for a in allowed)
           or d in ("jaxspec.model.placement", "jaxspec.model.runner")]
    assert bad == []


def test_the_detectors_fire():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _graph()
    assert "jaxspec.sharding" in graph["jaxspec.layers.moe"]  # a submodule import counts its package
    assert _rank("jaxspec.layers.attention") > _rank("jaxspec.ops.pallas.tree_attention")
    assert _room("jaxspec.cost.xla") > _room("jaxspec.speculation.cycle")


def test_no_module_is_longer_than_the_limit():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_no_package_folder_spans_the_model():
    """A folder's name means one floor: none holds both a module the layers import and a module that
    imports the model (sharding/ did: rules and active below the layers, placement and runner above)."""
    graph = _graph()
    below = {d for m, deps in graph.items() if m.startswith("jaxspec.layers") for d in deps}
    above = {m for m in graph if "jaxspec.model.network" in _reaches(graph, m)}
    packages = {name for name, path in _modules().items() if path.name == "__init__.py" and name != "jaxspec"}
    split = {}
    for package in sorted(packages):
        members = {m for m in graph if m.startswith(package + ".")}
        low, high = members & below, members & above
        if low and high:
            split[package] = (sorted(low), sorted(high))
    assert split == {}


def test_no_function_is_longer_than_the_limit():
    long = {}
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[f"{name}.{node.name}"] = n
    assert long == {}
