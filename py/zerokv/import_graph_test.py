"""The modules of the zerokv package import each other without a cycle.

An import inside a function counts like one at the top of the module: importing lazily hides a
cycle from the interpreter, not from the design, so the graph is read off every import statement.
"""

import ast
import os

import zerokv

PACKAGE_DIR = os.path.dirname(os.path.abspath(zerokv.__file__))


def _modules():
    """{module name: source path} of every non-test module under zerokv/."""
    modules = {}
    for directory, _, files in os.walk(PACKAGE_DIR):
        for file in files:
            if not file.endswith(".py") or file.endswith("_test.py"):
                continue
            path = os.path.join(directory, file)
            parts = ["zerokv", *os.path.relpath(path, PACKAGE_DIR)[: -len(".py")].split(os.sep)]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imported(statement, module, is_package, modules):
    """The zerokv modules one import statement names."""
    if isinstance(statement, ast.Import):
        return {alias.name for alias in statement.names if alias.name in modules}
    base = statement.module or ""
    if statement.level:
        anchor = module.split(".")[: len(module.split(".")) - statement.level + (1 if is_package else 0)]
        base = ".".join(anchor + ([base] if base else []))
    named = set()
    for alias in statement.names:
        submodule = f"{base}.{alias.name}"
        if submodule in modules:
            named.add(submodule)
        elif base in modules:
            named.add(base)
    return named


def import_graph():
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        with open(path) as source:
            tree = ast.parse(source.read(), path)
        is_package = path.endswith("__init__.py")
        graph[module] = set()
        for statement in ast.walk(tree):
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                graph[module] |= _imported(statement, module, is_package, modules)
        graph[module].discard(module)
    return graph


def find_cycle(graph):
    """One cycle as [a, b, ..., a], or None."""
    state = {}  # module -> "open" while on the DFS stack, "done" after

    def visit(module, stack):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target, stack)
                if cycle:
                    return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [])
            if cycle:
                return cycle
    return None


def test_every_area_is_read():
    graph = import_graph()
    for module in ("zerokv.errors", "zerokv.blob.codec", "zerokv.kvwrite.analysis", "zerokv.aoti.compile",
                   "zerokv.tensorrt.lowering", "zerokv.executorch.backend", "zerokv.executorch.runtime_kv"):
        assert module in graph, f"{module} is not in the runfiles: add its library to the test's deps"


def test_the_package_imports_without_a_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_find_cycle_names_the_modules_in_order():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_inside_functions_are_edges():
    tree = ast.parse("def f():\n    from zerokv.executorch import backend\n")
    (statement,) = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    modules = {"zerokv.executorch": "", "zerokv.executorch.backend": ""}
    assert _imported(statement, "zerokv.executorch.runtime_kv", False, modules) == {"zerokv.executorch.backend"}
