"""The package's import graph has no circle.

Every `import` / `from ... import` of a `keras_rec_emb` module, at module
level or inside a function (a function-local import only hides a circle),
is an edge; the test fails on any cycle among the package's modules and
names it. Run on its own: `python -m pytest -q tests/test_import_graph.py`.
"""

import ast
import os

import keras_rec_emb

PACKAGE = "keras_rec_emb"
ROOT = os.path.dirname(os.path.abspath(keras_rec_emb.__file__))


def _module_name(path):
    rel = os.path.relpath(path, os.path.dirname(ROOT))[:-len(".py")].split(os.sep)
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(rel)


def _modules():
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                out[_module_name(path)] = path
    return out


def _resolve(name, modules):
    """`name` or the nearest enclosing module that exists (`a.b.func` -> `a.b`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph():
    """{module: set of keras_rec_emb modules it imports} (a package is the
    module its `__init__.py` is). Importing `pkg.mod` also runs
    `pkg/__init__.py`: an edge to `pkg` too, unless `pkg` contains the
    importing module (then it is already being imported)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_pkg = path.endswith("__init__.py")
        edges = set()
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".")
                    parts = parts if is_pkg else parts[:-1]
                    parts = parts[:len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                # `from pkg import mod` imports the module `pkg.mod`;
                # `from mod import func` imports `mod`.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for t in targets:
                if t.split(".")[0] != PACKAGE:
                    continue
                target = _resolve(t, modules)
                # Importing `a.b.c` runs `a/__init__` and `a/b/__init__` too;
                # the packages that contain this module are already running.
                while target and not (name == target or name.startswith(target + ".")):
                    edges.add(target)
                    target = target.rpartition(".")[0]
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_graph_sees_known_edges():
    graph = import_graph()
    assert "keras_rec_emb.backend.tensorflow.ops" in graph["keras_rec_emb.backend.tensorflow.variables"]
    assert "keras_rec_emb.layers.embedding_variable" in graph["keras_rec_emb.layers"]


def test_find_cycles_finds_a_planted_one():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    cycles = find_cycles(import_graph())
    assert cycles == [], f"import cycles among keras_rec_emb modules: {cycles}"
