"""The import layers (docs/ARCHITECTURE.md, "Layers"): common/ at the bottom, data/ and train/ above it, and train/
taking from data/ only the shard format, the packer and Parallel-R1's structures. Read from the source (ast), lazy
imports inside functions included, so nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "data", "train")
TRAIN_MAY_IMPORT_FROM_DATA = ("data.pack", "data.parallel_thinking", "data.shards")


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
