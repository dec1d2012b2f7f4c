"""Tokens stored by `stepwise: off | samples | tree` (issue 44), on the reasoning + tool-use fixture and on synthetic
agent trajectories of 10-30 steps behind a ~2K-token tool schema, with the Qwen3 tokenizer (its template drops the
reasoning of turns before the last user query).

    python benchmarks/bench_stepwise.py [--agents 20] [--seed 0]
    python benchmarks/bench_stepwise.py --train 12     # also: one training step over every row, per mode
    python -m benchmarks.bench_stepwise --prepare DIR --max-length 32768   # packed tree and samples rows only

Per data set and mode: sequences written, tokens stored, loss tokens (trained targets), and the tokenize stage's
core time (`data.tokenize.tokenize_records` in this process, one core; rendering, encoding and the trie). `off` trains
each conversation as one sequence (earlier turns in a context inference never shows: `reasoning: auto` inlines the
reasoning the template drops); `samples` and `tree` train each step in its own rendered context and train the same
targets; `tree` stores the shared prefixes once.

`--train N`: the pipeline (pack capacity 8192) on the fixture's first N records per mode, then one optimizer step of
the Trainer over every row (micro_batch_rows 1, one micro-batch per row) of a small random-init Qwen2 (hidden 256,
4 layers, the Qwen3 vocabulary, fp32, SDPA; trees through the structured SDPA mask), one torch thread: CPU seconds
of the step and trained tokens per CPU second (every mode trains the same targets).

`--prepare DIR`: only the packed rows of `samples` and `tree` (DIR/samples/packed, DIR/tree/packed; `--records N` of
the fixture, pack capacity `--max-length`), and DIR/stepwise.json with each set's rows, tokens and trained tokens:
what the GPU check (benchmarks/gpu_check.py, phase `trees`) trains with bench_train_gpu, tree rows through the
structured attention (FlexAttention on CUDA) against the same targets as samples rows through the varlen kernel.
"""
from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT.parent / "shared" / "fixtures"

from common.config import from_dict  # noqa: E402
from data.chat_template import analyze_template, load_chat_tokenizer  # noqa: E402
from data.config import DataConfig  # noqa: E402
from data.pipeline import run_pipeline  # noqa: E402
from data.tokenize import TokenizeContext, TokenizedSequence, tokenize_records  # noqa: E402

WORDS = ("account balance cache cluster deploy dataset filter index invoice ledger metric node order payload query "
         "region record report schema search service shard status stream ticket token user volume window").split()


def fixture_records(tokenizer: Path) -> list[dict]:
    """The fixture's records as the merge stage writes them (preprocess, sample, merge; no merging)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = from_dict(DataConfig, {
            "inputs": [{"path": str(FIXTURES / "data" / "llamafactory_reason_tool_use_demo_50.jsonl"),
                        "format": "messages", "category_name": "reason_tool"}],
            "output_dir": tmp, "tokenizer_path": str(tokenizer), "num_workers": 1, "merge": {"probability": 0.0},
            "stages": ["preprocess", "sample", "merge"]})
        cfg.validate()
        run_pipeline(cfg)
        return [orjson.loads(line) for line in cfg.merged_path.read_bytes().splitlines()]


def tool_schema(rng: random.Random, n_tools: int = 16) -> list[dict]:
    """~2K tokens of tool definitions (Qwen3 tokenizer)."""
    tools = []
    for k in range(n_tools):
        props = {f"{rng.choice(WORDS)}_{j}": {"type": rng.choice(["string", "integer", "boolean"]),
                                              "description": " ".join(rng.choices(WORDS, k=6))} for j in range(3)}
        tools.append({"type": "function", "function": {
            "name": f"{rng.choice(WORDS)}_{rng.choice(WORDS)}_{k}", "description": " ".join(rng.choices(WORDS, k=14)),
            "parameters": {"type": "object", "properties": props, "required": list(props)[:1]}}})
    return tools


def agent_records(n: int, seed: int, steps: tuple[int, int] = (10, 30)) -> list[dict]:
    """Synthetic agent trajectories: a system prompt, the tool schema, one user task, `steps` (inclusive range) steps
    of (reasoning + tool call, tool result), a final answer; every assistant turn trained. Also the tests' agent data
    (tests/data/test_stepwise.py, tests/e2e/test_stepwise_exact.py)."""
    rng = random.Random(seed)
    tools = tool_schema(rng)
    out = []
    for uid in range(n):
        messages = [{"role": "system", "content": "You are an agent. Use the tools to complete the task."},
                    {"role": "user", "content": "Task: " + " ".join(rng.choices(WORDS, k=40))}]
        for _ in range(rng.randint(*steps)):
            tool = rng.choice(tools)["function"]
            messages.append({"role": "assistant", "content": "",
                             "reasoning_content": " ".join(rng.choices(WORDS, k=rng.randint(30, 90))),
                             "tool_calls": [{"type": "function", "function": {
                                 "name": tool["name"], "arguments": {p: rng.choice(WORDS) for p in
                                                                     tool["parameters"]["properties"]}}}]})
            messages.append({"role": "tool", "content": " ".join(rng.choices(WORDS, k=rng.randint(20, 120)))})
        messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=50)),
                         "reasoning_content": " ".join(rng.choices(WORDS, k=40))})
        labels = [1 if m["role"] == "assistant" else 0 for m in messages]
        out.append({"messages": messages, "labels": labels, "tools": tools,
                    "meta": {"uid": uid, "category_id": 1, "category_name": "agent"}})
    return out


def measure(records: list[dict], tokenizer, info, mode: str) -> dict:
    ctx = TokenizeContext(tokenizer=tokenizer, info=info, max_length=1 << 20, overlong="drop", stepwise=mode)
    start = time.process_time()
    results = tokenize_records(records, ctx)
    seconds = time.process_time() - start
    kept = [r for r in results if isinstance(r, TokenizedSequence)]
    return {"sequences": len(kept), "tokens": sum(len(r.input_ids) for r in kept),
            "loss_tokens": sum(r.n_loss_tokens for r in kept), "seconds": seconds,
            "dropped": len(results) - len(kept)}


def build_stepwise(out_dir: Path, mode: str, tok_dir: Path, max_length: int, n_records: int | None = None,
                   fixtures: Path = FIXTURES) -> Path:
    """The fixture's first `n_records` records (all: None) through the pipeline with `stepwise: mode`, packed into
    rows of `max_length` tokens; returns the packed directory."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [line for line in (fixtures / "data" / "llamafactory_reason_tool_use_demo_50.jsonl").read_bytes()
             .splitlines() if line.strip()]
    subset = out_dir / f"records_{mode}.jsonl"
    subset.write_bytes(b"\n".join(lines[:n_records]) + b"\n")
    cfg = from_dict(DataConfig, {
        "inputs": [{"path": str(subset), "format": "messages", "category_name": "reason_tool"}],
        "output_dir": str(out_dir / mode), "tokenizer_path": str(tok_dir), "num_workers": 1, "max_length": max_length,
        "stepwise": mode, "merge": {"probability": 0.0}, "pack": {"max_length": max_length}})
    cfg.validate()
    run_pipeline(cfg)
    return cfg.packed_dir


def prepare(out_dir: Path, max_length: int, n_records: int | None, fixtures: Path) -> dict:
    """`--prepare`: tree and samples rows of the same records; their sizes in DIR/stepwise.json."""
    import numpy as np

    from data.shards.dataset import PackedDataset

    sets = {}
    for mode in ("tree", "samples"):
        packed = build_stepwise(out_dir, mode, fixtures / "tokenizers" / "qwen3", max_length, n_records, fixtures)
        data = PackedDataset(packed)
        loss_tokens = sum(int((data[i]["labels"] != -100).sum()) for i in range(len(data)))
        sets[mode] = {"packed": str(packed), "rows": len(data), "tokens": int(np.asarray(data.row_n_tokens).sum()),
                      "loss_tokens": loss_tokens}
    out = {"max_length": max_length, "records": n_records, "sets": sets}
    (out_dir / "stepwise.json").write_text(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    print(orjson.dumps(out).decode(), flush=True)
    return out


def train_step_times(n_records: int, tok_dir: Path) -> None:
    import json

    import torch
    import yaml

    from train.config.sections import load_config
    from train.trainer import Trainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        lines = (FIXTURES / "data" / "llamafactory_reason_tool_use_demo_50.jsonl").read_bytes().splitlines()
        (tmp / "subset.jsonl").write_bytes(b"\n".join(lines[:n_records]) + b"\n")
        model = tmp / "model.json"
        model.write_text(json.dumps({
            "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 256,
            "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 16384, "tie_word_embeddings": True, "use_cache": False,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}))
        print("| mode | rows | tokens | loss tokens | step CPU s | trained tokens / CPU s |")
        print("|---|---:|---:|---:|---:|---:|")
        for mode in ("off", "samples", "tree"):
            cfg = from_dict(DataConfig, {
                "inputs": [{"path": str(tmp / "subset.jsonl"), "format": "messages", "category_name": "reason_tool"}],
                "output_dir": str(tmp / mode), "tokenizer_path": str(tok_dir), "num_workers": 1, "max_length": 8192,
                "stepwise": mode, "merge": {"probability": 0.0}, "pack": {"max_length": 8192}})
            cfg.validate()
            run_pipeline(cfg)
            from data.shards.dataset import PackedDataset

            rows = len(PackedDataset(cfg.packed_dir))
            (tmp / f"{mode}.yaml").write_text(yaml.safe_dump({
                "model_config": str(model), "tokenizer_path": str(tok_dir), "data_path": str(cfg.packed_dir),
                "output_dir": str(tmp / f"out_{mode}"), "max_steps": 1, "micro_batch_rows": 1, "grad_accum": rows,
                "lr": 1e-4, "bf16": False, "attn_backend": "sdpa", "loss_chunk_size": 1024, "plot": False,
                "log_backends": [], "save_steps": 0, "self_check": False}))
            trainer = Trainer(load_config(tmp / f"{mode}.yaml"), console=lambda *_: None)
            plan = trainer.sampler.plan(0)
            start = time.process_time()
            record = trainer.train_step(plan)
            seconds = time.process_time() - start
            trainer.metrics.close()
            print(f"| {mode} | {rows} | {record['tokens']:,} | {record['loss_tokens']:,} | {seconds:.1f} | "
                  f"{record['loss_tokens'] / seconds:,.0f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--agents", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", type=int, default=0, help="also time a training step on the first N fixture records")
    ap.add_argument("--prepare", type=Path, help="only write packed tree and samples rows (and their sizes) here")
    ap.add_argument("--max-length", type=int, default=32768, help="--prepare: the rows' capacity")
    ap.add_argument("--records", type=int, default=None, help="--prepare: the fixture's first N records (all: unset)")
    ap.add_argument("--fixtures", type=Path, default=FIXTURES, help="a copy of ../shared/fixtures")
    args = ap.parse_args()
    if args.prepare:
        prepare(args.prepare, args.max_length, args.records, args.fixtures)
        return
    tok_dir = FIXTURES / "tokenizers" / "qwen3"
    if args.train:
        train_step_times(args.train, tok_dir)
        return
    tokenizer = load_chat_tokenizer(str(tok_dir), None)
    info = analyze_template(tokenizer)
    schema_tokens = len(tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=tool_schema(
        random.Random(args.seed)), tokenize=True)["input_ids"])
    sets = {"reason_tool_use fixture (50 records)": fixture_records(tok_dir),
            f"synthetic agents ({args.agents} x 10-30 steps, {schema_tokens}-token tools prompt)":
                agent_records(args.agents, args.seed)}
    print("| data | mode | sequences | tokens stored | loss tokens | vs samples | tokenize core s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, records in sets.items():
        rows = {mode: measure(records, tokenizer, info, mode) for mode in ("off", "samples", "tree")}
        for mode, r in rows.items():
            ratio = rows["samples"]["tokens"] / r["tokens"]
            print(f"| {name} | {mode} | {r['sequences']:,} | {r['tokens']:,} | {r['loss_tokens']:,} | "
                  f"{ratio:.2f}x fewer | {r['seconds']:.2f} |")


if __name__ == "__main__":
    main()
