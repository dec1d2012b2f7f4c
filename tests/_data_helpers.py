"""Helpers for the data-pipeline tests: small inputs and configs written to a temp dir, the example pipeline's
config, a pid that no process has."""
from __future__ import annotations

import shutil
import subprocess
import sys

import orjson

from tests.conftest import ROOT, tokenizer_dir

CHAT_QA = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]}


def write_jsonl(path, rows) -> str:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return str(path)


def qa_rows(n, bad=()):
    """GSM8K-style rows (question/answer); rows in `bad` lack the answer."""
    return [{"question": f"q {i}"} if i in bad else {"question": f"q {i}", "answer": f"a {i}"} for i in range(n)]


def data_config_file(tmp_path, inputs, **kw) -> str:
    """A data config over `inputs` (raw dicts), output in tmp_path/out, the example tokenizer, one worker."""
    raw = {"inputs": inputs, "output_dir": str(tmp_path / "out"), "num_workers": 1,
           "tokenizer_path": str(ROOT / "data/example/tokenizer"), **kw}
    path = tmp_path / "config.json"
    path.write_bytes(orjson.dumps(raw))
    return str(path)


def minimal_config_file(tmp_path, **extra):
    """A data config without inputs or tokenizer (stages that need neither), its ratio file in tmp_path."""
    cfg = {"inputs": [], "output_dir": str(tmp_path / "out"), "tokenizer_path": "unused",
           "ratio_path": str(tmp_path / "ratios.json"), **extra}
    path = tmp_path / "config.json"
    path.write_bytes(orjson.dumps(cfg))
    return path


def preprocess_config_file(tmp_path, paths):
    """A data config for preprocess alone: each of `paths` an input of category chat."""
    path = tmp_path / "config.json"
    path.write_bytes(orjson.dumps({"inputs": [{"path": p, "category_name": "chat"} for p in paths],
                                   "output_dir": str(tmp_path / "out"), "tokenizer_path": "unused", "num_workers": 1}))
    return str(path)


def tokenize_record(uid, category, answer):
    """A merged record of category `short` (id 1) or `long` (id 2) whose assistant turn is `answer`."""
    return {"messages": [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": answer}],
            "meta": {"uid": uid, "category_id": 1 if category == "short" else 2, "category_name": category}}


def tokenize_config_file(tmp_path, records, **extra):
    """`records` as tmp_path/out/merged.jsonl, and a config of the tokenize stage over them (Qwen2.5, max_length
    64)."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    write_jsonl(out / "merged.jsonl", records)
    path = tmp_path / "config.json"
    path.write_bytes(orjson.dumps({"inputs": [], "output_dir": str(out), "num_workers": 1, "max_length": 64,
                                   "tokenizer_path": str(tokenizer_dir("qwen2_5_instruct")), **extra}))
    return path


def dead_pid() -> int:
    """The pid of a process that has ended."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def example_config(directory, **extra):
    """configs/data/example.json with absolute paths, its own output_dir and ratio file, one worker."""
    raw = orjson.loads((ROOT / "configs/data/example.json").read_bytes())
    for spec in raw["inputs"]:
        spec["path"] = str(ROOT / spec["path"])
    raw.update({"output_dir": str(directory / "out"), "ratio_path": str(directory / "ratios.json"),
                "tokenizer_path": str(ROOT / raw["tokenizer_path"]), "num_workers": 1, **extra})
    path = directory / "config.json"
    path.write_bytes(orjson.dumps(raw))
    return path


def copy_run(example_run, tmp_path):
    """A copy of the example run (the `example_run` fixture of tests/data/conftest.py) in tmp_path: its config and
    output directory."""
    shutil.copytree(example_run / "out", tmp_path / "out")
    shutil.copy(example_run / "ratios.json", tmp_path / "ratios.json")
    return example_config(tmp_path), tmp_path / "out"
