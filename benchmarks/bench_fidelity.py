"""Cost of issue 12's fidelity work in the tokenize core, on the long-CoT fixture (166 records with reasoning).

    python benchmarks/bench_fidelity.py [--tokenizer qwen3] [--group 4] [--repeats 3]

Rows: `reasoning: template` (the template alone: one render per record, reasoning lost where it does not
render it), `reasoning: auto` on the records alone, and `auto` on merged records of --group originals each
(data.merge.merge_records: one render of the conversation plus one per original). One process, one core,
best of --repeats, CPU seconds of this process; tok/s counts the tokens written.
"""
from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT.parent / "shared" / "fixtures"

from data.chat_template import analyze_template, load_chat_tokenizer  # noqa: E402
from data.merge import merge_records  # noqa: E402
from data.tokenize import BATCH_RECORDS, TokenizeContext, tokenize_records  # noqa: E402


def longcot() -> list[dict]:
    out = []
    with open(FIXTURES / "data" / "skyt1_math500_longcot.messages.jsonl", "rb") as f:
        for line in f:
            out.append({"messages": orjson.loads(line)["messages"], "labels": [0, 1],
                        "meta": {"uid": len(out), "category_id": 1}})
    return out


def timed(records, ctx, repeats) -> tuple[float, int, int]:
    best, tokens, loss = float("inf"), 0, 0
    for _ in range(repeats):
        start = time.process_time()
        tokens = loss = 0
        for i in range(0, len(records), BATCH_RECORDS):
            for res in tokenize_records(records[i:i + BATCH_RECORDS], ctx):
                tokens += res.input_ids.shape[0]
                loss += res.n_loss_tokens
        best = min(best, time.process_time() - start)
    return best, tokens, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="qwen3")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tok = load_chat_tokenizer(str(FIXTURES / "tokenizers" / args.tokenizer))
    info = analyze_template(tok)
    records = longcot()
    merged = [merge_records(records[i:i + args.group]) for i in range(0, len(records), args.group)]
    print(f"{args.tokenizer}, {len(records)} long-CoT records, merged in groups of {args.group}: {len(merged)}")
    print("| run | records | tokens | loss tokens | CPU s | tok/s |\n|---|---:|---:|---:|---:|---:|")
    for name, recs, policy in (("reasoning: template, alone", records, "template"),
                               ("reasoning: auto, alone", records, "auto"),
                               (f"reasoning: auto, merged by {args.group}", merged, "auto")):
        ctx = TokenizeContext(tokenizer=tok, info=info, max_length=10**7, reasoning=policy)
        seconds, tokens, loss = timed(recs, ctx, args.repeats)
        print(f"| {name} | {len(recs)} | {tokens:,} | {loss:,} | {seconds:.2f} | {tokens / seconds:,.0f} |")


if __name__ == "__main__":
    main()
