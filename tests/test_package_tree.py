"""The package tree: toolkit's top holds only the user-facing modules, and no toolkit modules import each other in a
circle. Read from the source with `ast` (nothing is imported, no torch): every import counts, at module level or
inside a function, so a circle cannot hide behind a function-level import."""

from __future__ import annotations

import ast
from pathlib import Path

TOOLKIT = Path(__file__).resolve().parents[1] / "toolkit"
TOP_LEVEL = {"__init__.py", "api.py", "cli.py", "errors.py"}  # the rest lives in packages by concern


def module_files(root: Path = TOOLKIT) -> dict[str, Path]:
    """Dotted module name -> file, packages under their own name (toolkit.train -> toolkit/train/__init__.py)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the toolkit modules it imports. `from a.b import c` is an edge to a.b.c when that is a module,
    else to a.b (c is a name defined there); `import a.b.c` to the longest prefix that is a module."""
    packages = {name.rpartition(".")[0] for name in modules}  # namespace packages (no __init__.py) included

    def enclosing(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges.update(enclosing(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's package (a package's own name for __init__.py)
                    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    if full in modules:
                        edges.add(full)
                    elif source in modules or source not in packages:
                        edges.add(enclosing(source))
        graph[name] = {edge for edge in edges if edge and edge != name and edge.split(".")[0] == "toolkit"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    return "\n".join(f"  {module} -> {', '.join(sorted(graph[module] & set(component)))}" for module in component)


def test_no_import_cycles_between_toolkit_modules():
    graph = import_graph(module_files())
    found = cycles(graph)
    assert not found, "import cycles (strongly connected components), each module -> its imports inside it:\n" + \
        "\n\n".join(describe(component, graph) for component in found)


def test_the_graph_sees_every_kind_of_import():
    """Guards the test above against passing on an empty graph: module-level, function-level, `from package import
    module` and `from module import name` imports all give edges."""
    graph = import_graph(module_files())
    assert "toolkit.errors" in graph["toolkit.cli"]  # from toolkit.errors import DsmtError (module level)
    assert "toolkit.spec.checks" in graph["toolkit.api"]  # inside a function
    assert "toolkit.adapters.transforms" in graph["toolkit.convert.hf_to_mcore"]  # from toolkit.adapters import transforms
    assert "toolkit.backend" in graph["toolkit.adapters.build"]  # from toolkit import backend as backends
    assert "toolkit.train.job.run" in graph["toolkit.train.__main__"]


def test_cycle_finder_reports_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_toolkit_top_holds_only_the_user_facing_modules():
    assert {path.name for path in TOOLKIT.glob("*.py")} == TOP_LEVEL


def test_python_dash_m_toolkit_train_stays():
    """Generated launch scripts start `python -m toolkit.train` on every rank."""
    assert (TOOLKIT / "train" / "__main__.py").is_file()


def test_every_folder_of_code_is_a_package_an_install_ships():
    """pyproject's `packages.find` (setuptools.find_packages) skips folders without __init__.py: a `pip install .`
    (not editable) would leave their modules out."""
    from setuptools import find_packages

    shipped = set(find_packages(where=str(TOOLKIT.parent), include=["toolkit*"]))
    folders = {".".join(path.parent.relative_to(TOOLKIT.parent).parts) for path in TOOLKIT.rglob("*.py")}
    assert folders <= shipped, sorted(folders - shipped)
