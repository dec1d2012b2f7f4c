"""Paths and the tests' layout. Every path of the repository that README.md, docs/*.md and BENCHMARKS.md write
(`train/...`, `data/...`, `common/...`, `tests/...`, `configs/...`, `scripts/...`, `benchmarks/...`, `docs/...`)
exists; tests/train/ has a folder per wing of train/ and a file per module it tests; no test file is named after a
round of work or an audience."""
from __future__ import annotations

import re

from tests.conftest import ROOT

DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
# a repository path: a top folder, then names (not inside a longer path or URL); it ends at a letter, digit or '/'
PATH = re.compile(r"(?<![\w./-])((?:train|data|common|tests|configs|scripts|benchmarks|docs)/[\w./-]*[\w/])")
PLACEHOLDER = "<{*"  # what follows a path cut short by a placeholder: tests/train/<wing>/, gpu_<date>, *.jsonl
# names of a round of work or an audience, as a part of a test file's name between underscores
NOT_A_SUBJECT = re.compile(r"round\d*|newcomer|usability|frictions?|mistakes?|hardening|issue\d*")


def _is_repository_path(path: str) -> bool:
    """`data/` is also what the docs' examples name the user's own input folder (`data/raw.jsonl`): a data/ path is
    the repository's when it names a module or lies under one of the package's folders (data/example/, data/shards/)."""
    first, _, rest = path.partition("/")
    if first != "data":
        return True
    head = rest.split("/", 1)[0]
    return head.endswith(".py") or (ROOT / "data" / head).is_dir()


def _exists(path: str) -> bool:
    """The path, or the prefix of the files a command wrote beside it (`--out benchmarks/results/moe_ep` writes
    moe_ep.json and moe_ep.md)."""
    target = ROOT / path
    return target.exists() or any(target.parent.glob(f"{target.name}.*"))


def test_every_repository_path_in_the_docs_exists():
    missing = []
    for doc in DOCS:
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            for match in PATH.finditer(line):
                path, after = match.group(1), line[match.end():match.end() + 1]
                if after and after in PLACEHOLDER:
                    continue
                if _is_repository_path(path) and not _exists(path):
                    missing.append(f"{doc.relative_to(ROOT)}:{lineno}: {path}")
    assert missing == []


def test_the_check_sees_a_missing_path_and_passes_the_users_own():
    line = "see tests/train/test_gone.py and train/plan/memory.py; put data/raw.jsonl beside data/example/ (<out>)"
    found = [m.group(1) for m in PATH.finditer(line)]
    assert found == ["tests/train/test_gone.py", "train/plan/memory.py", "data/raw.jsonl", "data/example/"]
    assert [p for p in found if _is_repository_path(p) and not _exists(p)] == ["tests/train/test_gone.py"]


def test_tests_of_train_follow_its_wings():
    """Every folder of tests/train/ is a wing of train/ (a package there), and every test file in it is named
    test_<module>[_<aspect>].py after a module of that package."""
    problems = []
    tests = ROOT / "tests" / "train"
    for folder in sorted(p for p in [tests, *tests.rglob("*")] if p.is_dir() and p.name != "__pycache__"):
        package = ROOT / "train" / folder.relative_to(tests)
        if not (package / "__init__.py").is_file():
            problems.append(f"{folder.relative_to(ROOT)}: train/ has no package {package.relative_to(ROOT)}")
            continue
        if not (folder / "__init__.py").is_file():
            problems.append(f"{folder.relative_to(ROOT)}: no __init__.py")
        modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
        for test in sorted(folder.glob("test_*.py")):
            subject = test.stem.removeprefix("test_")
            if not any(subject == m or subject.startswith(m + "_") for m in modules):
                problems.append(f"{test.relative_to(ROOT)}: names no module of {package.relative_to(ROOT)}")
    assert problems == []


def test_no_test_file_is_named_after_a_round_or_an_audience():
    named = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").rglob("test_*.py"))
             if any(NOT_A_SUBJECT.fullmatch(part) for part in p.stem.split("_"))]
    assert named == []
