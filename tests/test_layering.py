"""The import layers (docs/ARCHITECTURE.md, "Layers"): common/ at the bottom, data/ and train/ above it, and train/
taking from data/ only the shard format, the packer, the image loader and Parallel-R1's structures. Read from the source (ast), lazy
imports inside functions included, so nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "data", "train")
TRAIN_MAY_IMPORT_FROM_DATA = ("data.chat_template", "data.chat_templates", "data.images", "data.pack",
                              "data.parallel_thinking", "data.shards")


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_in(source: str, package: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of every import of `source`, a module of `package`: `from data import shards` is the
    module data.shards (name None), `from data.shards import read_meta` the name read_meta of data.shards;
    relative imports resolved against `package`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub, None) if _is_module(sub) else (node.lineno, base, alias.name))
    return found


def project_imports() -> list[tuple[str, str, str, str | None]]:
    """(package, where, module, name) of every import of every module under common/, data/ and train/."""
    out = []
    for package in PACKAGES:
        assert (ROOT / package / "__init__.py").is_file(), f"{package}/ is not a package"
        for path in sorted((ROOT / package).rglob("*.py")):
            inner = ".".join(path.relative_to(ROOT).parent.parts)
            for line, module, name in imports_in(path.read_text(), inner):
                out.append((package, f"{path.relative_to(ROOT)}:{line}", module, name))
    return out


def _common_imports_neither_data_nor_train(here: str, module: str, name: str | None) -> str | None:
    return "common/ is the bottom layer" if here == "common" and _top(module) in ("data", "train") else None


def _data_imports_no_train(here: str, module: str, name: str | None) -> str | None:
    return "data/ never imports train/" if here == "data" and _top(module) == "train" else None


def _train_takes_three_modules_of_data(here: str, module: str, name: str | None) -> str | None:
    if here == "train" and _top(module) == "data" and module not in TRAIN_MAY_IMPORT_FROM_DATA:
        return f"train/ imports from data/ only {', '.join(TRAIN_MAY_IMPORT_FROM_DATA)}; the rest is in common/"
    return None


def _no_private_name_across_packages(here: str, module: str, name: str | None) -> str | None:
    if _top(module) not in PACKAGES or _top(module) == here:
        return None
    parts = module.split(".") + ([name] if name else [])
    private = [part for part in parts if part.startswith("_") and not part.startswith("__")]
    return f"{private[0]} is private to {_top(module)}/" if private else None


def _top(module: str) -> str:
    return module.split(".", 1)[0]


RULES = {rule.__name__.lstrip("_"): rule for rule in (
    _common_imports_neither_data_nor_train, _data_imports_no_train, _train_takes_three_modules_of_data,
    _no_private_name_across_packages)}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_layer_rule(rule):
    broken = [f"{where}: {module if name is None else f'{module}.{name}'}: {why}"
              for here, where, module, name in project_imports()
              if (why := RULES[rule](here, module, name))]
    assert broken == []


def defined_names(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments), not those it imports."""
    names: set[str] = set()
    stack = list(ast.parse(path.read_text()).body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            stack.extend(ast.iter_child_nodes(node))
    return names


def test_what_common_defines_is_imported_from_common():
    """No module passes on a name of common/ (tests and benchmarks included): nothing still reaches one through its
    old home in data/ or through another module that imported it."""
    common = {name for path in (ROOT / "common").rglob("*.py") for name in defined_names(path)}
    defined: dict[str, set[str]] = {}
    broken = []
    for path in sorted(p for folder in (*PACKAGES, "tests", "benchmarks") for p in (ROOT / folder).rglob("*.py")):
        inner = ".".join(path.relative_to(ROOT).parent.parts)
        for line, module, name in imports_in(path.read_text(), inner):
            if name not in common or _top(module) not in ("data", "train"):
                continue
            if module not in defined:
                target = ROOT.joinpath(*module.split("."))
                source = target.with_suffix(".py") if target.with_suffix(".py").is_file() else target / "__init__.py"
                defined[module] = defined_names(source)
            if name not in defined[module]:
                broken.append(f"{path.relative_to(ROOT)}:{line}: {module}.{name} is common/'s: import it from there")
    assert broken == []


def test_the_rules_catch_what_they_forbid():
    """The reader on a made-up train/ module (submodules, names, lazy and relative imports), and each rule on an
    import it forbids."""
    train_source = ("from data import shards, config\nfrom data.pack import plan_rows\n"
                    "def f():\n    from data.io import _private\n    from . import batch\n"
                    "    from .batch import make_batch\n")
    found = imports_in(train_source, "train")
    assert found == [(1, "data.shards", None), (1, "data.config", None), (2, "data.pack", "plan_rows"),
                     (4, "data.io", "_private"), (5, "train.batch", None), (6, "train.batch", "make_batch")]
    assert [module for _, module, name in found if RULES["train_takes_three_modules_of_data"]("train", module, name)] \
        == ["data.config", "data.io"]
    assert RULES["no_private_name_across_packages"]("train", "data.io", "_private")
    assert not RULES["no_private_name_across_packages"]("train", "train.batch", "_private")
    assert RULES["common_imports_neither_data_nor_train"]("common", "data.shards", None)
    assert RULES["data_imports_no_train"]("data", "train.config", "ConfigError")


def import_graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports, read from the source: imports inside functions count (a lazy
    import hides a cycle, it does not remove it)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        inner = ".".join(path.relative_to(ROOT).parent.parts)
        graph[module] = {imported for _, imported, _ in imports_in(path.read_text(), inner)
                         if _top(imported) == package and imported != package}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path back to its start) per strongly connected component of more than one module, and every
    module that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(_cycle_through(graph, sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _cycle_through(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A path from the component's first module back to it, inside the component (breadth first)."""
    start, inside = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & inside):
            if nxt == start:
                return paths[node] + [start]
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    raise AssertionError(f"{component} is not a cycle")


def test_train_has_no_import_cycle():
    """train/'s modules import one way (docs/ARCHITECTURE.md, "The train/ house"), function-level imports counted."""
    assert [" -> ".join(cycle) for cycle in cycles(import_graph("train"))] == []


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b", "c", "a"], ["d", "d"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    lazy = "import os\ndef f():\n    from train import batch\n    import train.config\n"
    assert {module for _, module, _ in imports_in(lazy, "train")} == {"os", "train.batch", "train.config"}
