"""The package tree: toolkit's top holds only the user-facing modules, and no toolkit modules import each other in a
circle. Read from the source with `ast` (nothing is imported, no torch): every import counts, at module level or
inside a function, so a circle cannot hide behind a function-level import."""

from __future__ import annotations

import ast
import functools
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


@functools.lru_cache(maxsize=1)
def toolkit_graph() -> dict[str, frozenset[str]]:
    """The import graph of this checkout's toolkit, parsed once per session (each parse of ~200 files takes ~2 s)."""
    return {name: frozenset(edges) for name, edges in import_graph(module_files()).items()}


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    return "\n".join(f"  {module} -> {', '.join(sorted(graph[module] & set(component)))}" for module in component)


def test_no_import_cycles_between_toolkit_modules():
    graph = toolkit_graph()
    found = cycles(graph)
    assert not found, "import cycles (strongly connected components), each module -> its imports inside it:\n" + \
        "\n\n".join(describe(component, graph) for component in found)


def test_the_graph_sees_every_kind_of_import():
    """Guards the test above against passing on an empty graph: module-level, function-level, `from package import
    module` and `from module import name` imports all give edges."""
    graph = toolkit_graph()
    assert "toolkit.errors" in graph["toolkit.cli"]  # from toolkit.errors import DsmtError (module level)
    assert "toolkit.check.checks" in graph["toolkit.api"]  # inside a function
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


# The floors, bottom first: a package imports only the packages below it (and its own modules). `spec` sits above
# `models` and `adapters` because a spec names its model (its shape and family are read through them), and the
# checks (`check`) sit above everything they check, `train` included: they hand the runners below a CheckedJob
# (toolkit/spec/checked.py). errors is toolkit/errors.py: the exception and Problem / Report types every floor uses;
# below it `toolkit` itself (its __init__: the version, no imports).
PACKAGE_ORDER = ("errors", "backend", "models", "parallel", "launch", "adapters", "spec", "convert", "data", "plan",
                 "generate", "train", "check", "verify", "demo", "api", "cli")
# The few modules that import above their floor, each with its reason (module -> reason).
ABOVE_ITS_FLOOR = {
    "toolkit.train.__main__": "`python -m toolkit.train`, the per-rank entry point the generated scripts start, must "
                              "live in toolkit/train; it checks the spec (toolkit/check/job.py) before the rank runs",
}


def floor_of(module: str) -> int:
    """The floor of a toolkit module: its package's place in PACKAGE_ORDER (toolkit itself below all)."""
    parts = module.split(".")
    if module == "toolkit":
        return -1
    return PACKAGE_ORDER.index(parts[1] if len(parts) > 1 else "api")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import (module level or inside a function) of a module on a higher floor than the importer's."""
    return sorted(f"{module} ({_floor_name(module)}) imports {target} ({_floor_name(target)})"
                  for module, targets in graph.items() for target in targets
                  if module.split(".")[:2] != target.split(".")[:2] and floor_of(target) > floor_of(module)
                  and module not in ABOVE_ITS_FLOOR)


def _floor_name(module: str) -> str:
    return PACKAGE_ORDER[floor_of(module)]


def test_toolkit_init_imports_nothing():
    """`toolkit` is below every floor (toolkit.generate.templates finds launch/ through it)."""
    assert not toolkit_graph()["toolkit"]


def test_every_package_has_a_floor():
    packages = {name.split(".")[1] for name in module_files() if name.count(".") >= 1}
    assert packages == set(PACKAGE_ORDER), "place each package in PACKAGE_ORDER: " + \
        ", ".join(sorted(packages ^ set(PACKAGE_ORDER)))


def test_imports_go_only_downward():
    found = upward_imports(toolkit_graph())
    assert not found, "imports that go up the floors (tests/test_package_tree.py PACKAGE_ORDER):\n  " + \
        "\n  ".join(found)


def test_an_upward_import_inside_a_function_is_found(tmp_path):
    """Guards the test above: a function-level import from a lower floor up is reported; one of ABOVE_ITS_FLOOR's is
    not."""
    for relative, text in {"errors.py": "", "spec/__init__.py": "", "spec/load.py": "def f():\n    import toolkit.check.x\n",
                           "check/__init__.py": "", "check/x.py": "from toolkit.spec import load\n",
                           "train/__init__.py": "", "train/__main__.py": "def main():\n    from toolkit.check import x\n"}.items():
        (tmp_path / "toolkit" / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "toolkit" / relative).write_text(text)
    found = upward_imports(import_graph(module_files(tmp_path / "toolkit")))
    assert found == ["toolkit.spec.load (spec) imports toolkit.check.x (check)"]
