"""Tokenize-stage core throughput (tokens/s, one process) against (a) the raw fast-tokenizer batch encode of the
same rendered texts (the ceiling) and (b) the OpenSFT per-turn prefix method, on multi-turn GSM8K conversations.

    python benchmarks/bench_tokenize.py [--tokenizer qwen2_5_instruct] [--conversations 1000] [--per-conv 3]

(b), re-implemented here: for every assistant turn i, render messages[:i] with the generation prompt and
messages[:i+1], tokenize both; the turn's labels are the tokens between the two lengths; the ids are those of
the last render. Every method runs on one core (TOKENIZERS_PARALLELISM=false), best of --repeats, interleaved,
timed in CPU seconds of this process (single-threaded, so equal to wall time on an idle machine; the shared
sandbox makes wall time noisy).
"""
from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one worker = one core, for every method alike

import argparse
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT.parent / "shared" / "fixtures"

from data.chat_template import analyze_template, load_chat_tokenizer  # noqa: E402
from data.tokenize import BATCH_RECORDS, IGNORE_INDEX, TokenizeContext, template_inputs, tokenize_records  # noqa: E402


def gsm8k_conversations(n: int, per_conv: int) -> list[dict]:
    rows = []
    with open(FIXTURES / "data" / "gsm8k_train.jsonl", "rb") as f:
        for line in f:
            rows.append(orjson.loads(line))
            if len(rows) >= n * per_conv:
                break
    if len(rows) < n * per_conv:
        raise SystemExit(f"gsm8k_train.jsonl has only {len(rows)} rows for {n} x {per_conv}")
    out = []
    for c in range(n):
        msgs = []
        for r in rows[c * per_conv:(c + 1) * per_conv]:
            msgs += [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]
        out.append({"messages": msgs, "labels": [int(m["role"] == "assistant") for m in msgs],
                    "meta": {"uid": c, "category_id": 1}})
    return out


def chunks(seq, size):
    return [seq[i:i + size] for i in range(0, len(seq), size)]


def ours(records, ctx):
    n = 0
    for part in chunks(records, BATCH_RECORDS):
        for res in tokenize_records(part, ctx):
            n += res.input_ids.shape[0]
    return n


def ceiling(texts, tok):
    n = 0
    for part in chunks(texts, BATCH_RECORDS):
        n += sum(len(ids) for ids in tok(part, add_special_tokens=False)["input_ids"])
    return n


def backend_ids(texts, tok):
    n = 0
    backend = tok.backend_tokenizer
    for part in chunks(texts, BATCH_RECORDS):
        n += sum(len(e.ids) for e in backend.encode_batch_fast(part, add_special_tokens=False))
    return n


def opensft(records, tok):
    n = 0
    for rec in records:
        messages, kwargs = template_inputs(rec)
        ids, labels = [], []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = tok(tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True, **kwargs),
                         add_special_tokens=False)["input_ids"]
            ids = tok(tok.apply_chat_template(messages[:i + 1], tokenize=False, **kwargs),
                      add_special_tokens=False)["input_ids"]
            labels += [IGNORE_INDEX] * (len(prompt) - len(labels))  # the turn's header and the prompt before it
            labels += ids[len(prompt):] if rec["labels"][i] else [IGNORE_INDEX] * (len(ids) - len(prompt))
        n += len(ids)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default="qwen2_5_instruct")
    ap.add_argument("--conversations", type=int, default=1000)
    ap.add_argument("--per-conv", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    tok = load_chat_tokenizer(str(FIXTURES / "tokenizers" / args.tokenizer))
    ctx = TokenizeContext(tokenizer=tok, info=analyze_template(tok), max_length=10**9)
    records = gsm8k_conversations(args.conversations, args.per_conv)
    texts = [tok.apply_chat_template(*template_inputs(r)[:1], tokenize=False) for r in records]

    # the same ids everywhere (the ceiling tokenizes the same texts; ours must equal it)
    first = tokenize_records(records[:50], ctx)
    ref = tok(texts[:50], add_special_tokens=False)["input_ids"]
    assert all(r.input_ids.tolist() == list(x) for r, x in zip(first, ref))

    methods = {
        "ours (render + encode + masks)": lambda: ours(records, ctx),
        "(a) raw batch encode, pre-rendered": lambda: ceiling(texts, tok),
        "(b) OpenSFT per-turn prefix renders": lambda: opensft(records, tok),
        "(a') Rust encode_batch_fast, ids only, pre-rendered": lambda: backend_ids(texts, tok),
    }
    best = {k: float("inf") for k in methods}
    tokens = {}
    for _ in range(args.repeats):
        for name, fn in methods.items():
            t0 = time.process_time()
            tokens[name] = fn()
            best[name] = min(best[name], time.process_time() - t0)
    assert len(set(tokens.values())) == 1, tokens
    n_tok = next(iter(tokens.values()))
    rate = {k: n_tok / v for k, v in best.items()}
    names = list(methods)
    print(f"tokenizer {args.tokenizer}, {args.conversations} conversations x {args.per_conv} QA pairs, "
          f"{n_tok} tokens, best of {args.repeats}, CPU seconds, one core")
    print("| method | CPU s | tokens/s |")
    print("|---|---:|---:|")
    for k in names:
        print(f"| {k} | {best[k]:.3f} | {rate[k]:,.0f} |")
    print(f"\nours / (a) = {rate[names[0]] / rate[names[1]]:.2f}   (target >= 0.8)")
    print(f"ours / (b) = {rate[names[0]] / rate[names[2]]:.2f}   (target >= 3)")
    print(f"ours / (a') = {rate[names[0]] / rate[names[3]]:.2f}   (the bare Rust encoder, for reference)")


if __name__ == "__main__":
    main()
