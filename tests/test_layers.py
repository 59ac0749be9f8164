"""The package's layers, read from its imports (every import statement, at module level or inside a function):
no module of ``flashnb`` reaches itself through imports, and ``flashnb/kernels/`` imports nothing of
``flashnb`` outside it (the kernels are the lowest layer: the planner, the dispatch cache and the public
functions sit above them).  Without running any of it: ``ast`` over the sources."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "flashnb"


def _module(path):
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path, modules):
    """The ``flashnb`` modules ``path`` imports (``from . import x`` as ``package.x`` where that is a module, else
    as the package)."""
    name = _module(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "flashnb"}
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            mod = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
            if mod.split(".")[0] != "flashnb":
                continue
            for a in node.names:
                found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod)
    return found


def _graph():
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    return {m: sorted(x for x in _imports(p, modules) if x in modules and x != m) for m, p in modules.items()}


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for x in graph[m]:
            if state.get(x) == "open":
                return path[path.index(x):] + [x]
            if x not in state:
                found = visit(x, path + [x])
                if found:
                    return found
        state[m] = "done"
        return None

    for m in graph:
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    graph = _graph()
    assert len(graph) > 20 and "flashnb.kernels._jit" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def _upward(graph):
    """The imports of ``flashnb.kernels`` modules from outside it: {module: [imported]}, empty if none."""
    upward = {m: [x for x in deps if not x.startswith("flashnb.kernels")]
              for m, deps in graph.items() if m.startswith("flashnb.kernels")}
    return {m: x for m, x in upward.items() if x}


def test_the_kernels_import_nothing_above_them():
    bad = _upward(_graph())
    assert not bad, bad


def test_the_checks_see_a_cycle_and_an_upward_import():
    """The two checks fail on what they look for: a cycle, and a kernel module importing the dispatch cache."""
    assert _cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    graph = _graph()
    graph["flashnb._dispatch"] = graph["flashnb._dispatch"] + ["flashnb.kernels._jit"]
    graph["flashnb.kernels._jit"] = graph["flashnb.kernels._jit"] + ["flashnb._dispatch"]
    assert _cycle(graph) is not None
    assert _upward(graph) == {"flashnb.kernels._jit": ["flashnb._dispatch"]}
