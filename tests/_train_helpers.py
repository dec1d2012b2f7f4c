"""Helpers for the trainer tests: synthetic packed datasets, a tiny saved Qwen2, multi-process runs."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 97
CATEGORIES = {0: "untracked", 1: "math", 2: "chat"}


def synthetic_sequence(rng: np.random.Generator, length: int, n_turns: int, category: int) -> dict:
    """A conversation-shaped sequence: an untrained prompt, then `n_turns` trained spans separated by untrained
    gaps (the first token is never trained)."""
    input_ids = rng.integers(3, VOCAB, size=length).astype(np.int32)
    labels = np.full(length, -100, dtype=np.int32)
    turn_ids = np.zeros(length, dtype=np.int16)
    bounds = np.linspace(1, length, n_turns + 1).astype(int)
    for k in range(n_turns):
        lo, hi = bounds[k], bounds[k + 1]
        start = lo + max(1, (hi - lo) // 3)  # untrained gap (a user turn) before each trained span
        if start >= hi:
            start = hi - 1
        labels[start:hi] = input_ids[start:hi]
        turn_ids[start:hi] = k + 1
    categories = np.full(length, category, dtype=np.int16)
    return {"input_ids": input_ids, "labels": labels, "category_ids": categories, "turn_ids": turn_ids}


def untrained_sequence(rng: np.random.Generator, length: int) -> dict:
    return {
        "input_ids": rng.integers(3, VOCAB, size=length).astype(np.int32),
        "labels": np.full(length, -100, dtype=np.int32),
        "category_ids": np.zeros(length, dtype=np.int16),
        "turn_ids": np.zeros(length, dtype=np.int16),
    }


def write_packed(path: Path, rows: list[list[dict]], meta_extra: dict | None = None) -> Path:
    from data.shards.dataset import ShardWriter

    writer = ShardWriter(path, kind="packed")
    for row in rows:
        writer.add_row(row)
    writer.close({"categories": {str(k): v for k, v in CATEGORIES.items()}, **(meta_extra or {})})
    return path


def random_rows(seed: int, n_rows: int, seqs_per_row: int = 3, min_len: int = 6, max_len: int = 24) -> list[list[dict]]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n_rows):
        row = []
        for _ in range(seqs_per_row):
            length = int(rng.integers(min_len, max_len + 1))
            row.append(synthetic_sequence(rng, length, int(rng.integers(1, 4)), int(rng.integers(1, 3))))
        rows.append(row)
    return rows


def tiny_model(vocab: int = VOCAB, tie: bool = False):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import train.attention.function  # noqa: F401

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=tie, use_cache=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM._from_config(cfg, attn_implementation="packsft", dtype=torch.float32)


def save_tiny_model(path: Path, tie: bool = False) -> Path:
    model = tiny_model(tie=tie)
    model.config._attn_implementation = "sdpa"
    model.save_pretrained(path)
    return path


def write_config(path: Path, **values) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


@contextlib.contextmanager
def in_project_root():
    """The shipped configs hold paths relative to the project root (../shared/fixtures, configs/...)."""
    previous = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(previous)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train(config: Path, overrides: list[str], nproc: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m train` in 1 process or under torchrun with `nproc` CPU processes (gloo)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    if nproc == 1:
        cmd = [sys.executable, "-m", "train", str(config), *overrides]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", "-m", "train", str(config), *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture
def one_thread():
    """In-process training on one torch thread: on a shared 2-core machine two threads are ~50x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
