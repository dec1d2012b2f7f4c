"""The import layers (docs/ARCHITECTURE.md, "Layers"): common/ at the bottom, data/ and train/ above it, and train/
taking from data/ only its contract package data/shards/ (the shard format, the row planner, the image loader and
Parallel-R1's structures). Read from the source (ast), lazy
imports inside functions included, so nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "data", "train")
TRAIN_MAY_IMPORT_FROM_DATA = "data.shards"  # the contract package: what data/ writes and train/ reads


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_in(source: str, package: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of every import of `source`, a module of `package`: `from data import shards` is the
    module data.shards (name None), `from data.shards.dataset import read_meta` the name read_meta of data.shards.dataset;
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


def _train_takes_only_the_contract_of_data(here: str, module: str, name: str | None) -> str | None:
    contract = module == TRAIN_MAY_IMPORT_FROM_DATA or module.startswith(TRAIN_MAY_IMPORT_FROM_DATA + ".")
    if here == "train" and _top(module) == "data" and not contract:
        return f"train/ imports from data/ only {TRAIN_MAY_IMPORT_FROM_DATA}/ (the contract); the rest is in common/"
    return None


def _contract_takes_only_common_and_itself(here: str, module: str, name: str | None, where: str = "") -> str | None:
    if where.startswith("data/shards/") and _top(module) == "data" and not (
            module == TRAIN_MAY_IMPORT_FROM_DATA or module.startswith(TRAIN_MAY_IMPORT_FROM_DATA + ".")):
        return f"{TRAIN_MAY_IMPORT_FROM_DATA}/ (the contract) imports only common/ and itself"
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
    _common_imports_neither_data_nor_train, _data_imports_no_train, _train_takes_only_the_contract_of_data,
    _no_private_name_across_packages)}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_layer_rule(rule):
    broken = [f"{where}: {module if name is None else f'{module}.{name}'}: {why}"
              for here, where, module, name in project_imports()
              if (why := RULES[rule](here, module, name))]
    assert broken == []


def test_the_contract_imports_only_common_and_itself():
    """data/shards/ is what train/ may take from data/: it cannot pull the pipeline in behind it."""
    broken = [f"{where}: {module if name is None else f'{module}.{name}'}: {why}"
              for here, where, module, name in project_imports()
              if (why := _contract_takes_only_common_and_itself(here, module, name, where))]
    assert broken == []
    assert _contract_takes_only_common_and_itself("data", "data.records", None, "data/shards/media.py:3")
    assert not _contract_takes_only_common_and_itself("data", "data.shards.decode", None, "data/shards/media.py:3")


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
    found = imports_in(train_source, "train.steps")
    assert found == [(1, "data.shards", None), (1, "data.config", None), (2, "data.pack", "plan_rows"),
                     (4, "data.io", "_private"), (5, "train.steps.batch", None), (6, "train.steps.batch", "make_batch")]
    assert [module for _, module, name in found if RULES["train_takes_only_the_contract_of_data"]("train", module, name)] \
        == ["data.config", "data.pack", "data.io"]
    assert RULES["no_private_name_across_packages"]("train", "data.io", "_private")
    assert not RULES["no_private_name_across_packages"]("train", "train.steps.batch", "_private")
    assert RULES["common_imports_neither_data_nor_train"]("common", "data.shards.dataset", None)
    assert RULES["data_imports_no_train"]("data", "train.config.sections", "ConfigError")


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
    lazy = "import os\ndef f():\n    from train.steps import batch\n    import train.config.sections\n"
    assert {module for _, module, _ in imports_in(lazy, "train")} == {"os", "train.steps.batch", "train.config.sections"}


# train/'s wings (docs/ARCHITECTURE.md, "The train/ house"): every module but the few entry points and shared leaves
# at the top lives in one of these folders
TRAIN_WINGS = ("config", "plan", "model", "model/patches", "attention", "engines", "steps", "run", "machines")
TRAIN_TOP_FILES_AT_MOST = 12


def test_train_is_in_wings():
    top = sorted(path.name for path in (ROOT / "train").glob("*.py"))
    assert len(top) <= TRAIN_TOP_FILES_AT_MOST, top
    folders = sorted(str(path.parent.relative_to(ROOT / "train")) for path in (ROOT / "train").rglob("*.py")
                     if path.parent != ROOT / "train" and "__pycache__" not in path.parts)
    assert set(folders) == set(TRAIN_WINGS)


@pytest.mark.parametrize("wing", TRAIN_WINGS)
def test_each_wing_says_in_one_line_what_lives_there(wing):
    init = ROOT / "train" / wing / "__init__.py"
    assert init.is_file(), f"train/{wing}/ is not a package"
    tree = ast.parse(init.read_text())
    doc = ast.get_docstring(tree)
    assert doc and "\n" not in doc.strip(), f"train/{wing}/__init__.py: a one-line docstring says what lives there"
    # nothing else: a package that imports its modules would tie every importer of one to all of them
    assert len(tree.body) == 1, f"train/{wing}/__init__.py holds more than its docstring"


def wing_of(module: str) -> str:
    """train.model.patches.rope -> model (its wing); a module at train/'s top is its own node."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else module


def test_train_wings_import_one_way():
    """No cycle between train/'s wings either (a module of one wing importing another wing that imports it back),
    function-level imports counted; a wing's own folders (model/patches/) are inside it."""
    graph: dict[str, set[str]] = {}
    for module, imported in import_graph("train").items():
        graph.setdefault(wing_of(module), set()).update(wing_of(other) for other in imported
                                                         if wing_of(other) != wing_of(module))
    assert [" -> ".join(cycle) for cycle in cycles(graph)] == []
    assert wing_of("train.model.patches.rope") == "model" and wing_of("train.trainer") == "train.trainer"


def _string_constants(tree: ast.AST) -> set[str]:
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def _assigned_into_config(tree: ast.AST, file: str) -> list[str]:
    """`cfg.x = ...`, `self.cfg.x.y = ...`, `run.cfg.x[k] = ...`: a value written into the config."""
    def into_config(target: ast.AST) -> bool:
        while isinstance(target, (ast.Attribute, ast.Subscript)):
            target = target.value
            if isinstance(target, ast.Name) and target.id == "cfg" or isinstance(target, ast.Attribute) and \
                    target.attr == "cfg":
                return True
        return False

    return [f"{file}:{node.lineno}" for node in ast.walk(tree)
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]) if into_config(t)]


def test_the_trainer_is_the_loop():
    """train/trainer.py keeps steps, evaluation and the loop: no start-up choice (no `auto` value read, no
    `_choose_*` / `_check_*`), no question to the engine of which it is (`engine.name`, `getattr(engine, ...)`), no
    import of the config or the model's patches, nothing written into the config, at most 400 lines."""
    path = ROOT / "train" / "trainer.py"
    source = path.read_text()
    tree = ast.parse(source)
    methods = [node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert [name for name in methods if name.startswith(("_choose_", "_check_"))] == []
    assert "auto" not in _string_constants(tree)
    assert "engine.name" not in source and "getattr(self.engine" not in source
    assert [module for _, module, _ in imports_in(source, "train")
            if module.startswith(("train.config", "train.model.patches", "train.plan"))] == []
    assert _assigned_into_config(tree, "trainer.py") == []
    assert len(source.splitlines()) <= 400


def test_the_run_is_built_without_deciding():
    """train/run/ builds the run and holds its checkpoints and export: it compares no config value with `auto`,
    writes nothing into the config, and asks no engine its name to branch on (engines answer facts: which state
    they regroup, which parameters are experts)."""
    for path in sorted((ROOT / "train" / "run").glob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        assert "auto" not in _string_constants(tree), path
        assert _assigned_into_config(tree, path.name) == []
        compared = [node for node in ast.walk(tree) if isinstance(node, ast.Compare)
                    and any(isinstance(side, ast.Attribute) and side.attr == "name"
                            for side in [node.left, *node.comparators])]
        assert compared == [], f"{path.name}:{compared[0].lineno}: a branch on a name"


def test_the_structure_of_the_data_is_read_in_one_place():
    """Whether the data is Parallel-R1's or stepwise trees is `data.shards.dataset.structure_of` (from meta.json's
    token fields): no other module asks whether a field name is present."""
    found = []
    for path in sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and \
                    isinstance(node.left, ast.Constant) and node.left.value in ("tree_spans", "block_ids", "path_ids"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_names_of_the_contract_are_defined_once():
    """A public name of common/ or data/shards/ is defined nowhere else (no wrapper shadows the contract's name: a
    reader never wonders which `read_meta` runs), and the checkpoint's and the pipeline's clean-ups have their own
    names."""
    def public(path: Path) -> set[str]:
        return {node.name for node in ast.parse(path.read_text()).body
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")}

    contract_files = [*(ROOT / "common").rglob("*.py"), *(ROOT / "data" / "shards").rglob("*.py")]
    contract = {name: path for path in contract_files for name in public(path)}
    others = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py") if p not in contract_files]
    shadowed = [f"{path.relative_to(ROOT)}: {name} (of {contract[name].relative_to(ROOT)})"
                for path in others for name in sorted(public(path) & set(contract))]
    assert shadowed == []
    defined = [name for p in [*contract_files, *others] for name in public(p)]
    assert all(defined.count(name) <= 1 for name in ("read_meta", "tokenizer_hash", "remove_stale_temporaries"))
