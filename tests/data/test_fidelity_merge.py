"""Pseudo-multiturn merging never loses a trained token, for every fixture template.

The long-CoT and both tool fixtures go through preprocess -> sample once; then, per tokenizer, merge + tokenize
run twice: merge.probability 0 (every record alone) and 1 (records chained up to the token budget). A merged
row must train, for each original record, exactly the token ids that record trains alone, in order; the same
records must be dropped (with the same reasons) and the total loss tokens must be equal.
"""
import shutil
import unicodedata

import numpy as np
import orjson
import pytest

from tests.conftest import fixture_path, tokenizer_dir

from common.config import from_dict
from data import merge, preprocess, sample, tokenize
from data.chat_template import load_chat_tokenizer
from data.config import DataConfig
from data.report import check_arithmetic
from data.shards.dataset import PackedDataset

TEMPLATED = ("qwen2_5_instruct", "qwen3", "llama3_1_instruct", "phi3_mini_instruct")
MAX_LENGTH = 16384
IGNORE = -100


def config(out, tokenizer, **kw) -> DataConfig:
    raw = {"inputs": [
        {"path": str(fixture_path("data", "skyt1_math500_longcot.messages.jsonl")), "format": "messages",
         "category_name": "longcot"},
        {"path": str(fixture_path("data", "llamafactory_glaive_toolcall_en_demo.json")), "format": "sharegpt",
         "category_name": "glaive"},
        {"path": str(fixture_path("data", "llamafactory_reason_tool_use_demo_50.jsonl")), "format": "messages",
         "category_name": "reason_tool"},
    ], "output_dir": str(out), "tokenizer_path": str(tokenizer_dir(tokenizer)), "num_workers": 1,
        "max_length": MAX_LENGTH, "on_error": "skip", **kw}
    return from_dict(DataConfig, raw)


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """preprocess + sample (every rate 1: all records, seeded order) of the three fixtures, once."""
    cfg = config(tmp_path_factory.mktemp("front"), "qwen2_5_instruct")
    preprocess.run(cfg)
    sample.run(cfg)
    return cfg.sampled_path


def merged_and_tokenized(sampled_path, out, tokenizer, probability):
    cfg = config(out, tokenizer, merge={"probability": probability, "max_tokens": MAX_LENGTH})
    cfg.out.mkdir(parents=True)
    shutil.copyfile(sampled_path, cfg.sampled_path)
    merge_section = merge.run(cfg)
    section = check_arithmetic(tokenize.run(cfg))
    return merge_section, section, PackedDataset(cfg.tokenized_dir)


def trained_ids(ds, i):
    row = ds[i]
    return row["input_ids"][row["labels"] != IGNORE]


@pytest.mark.parametrize("tokenizer", TEMPLATED)
def test_merged_rows_train_exactly_what_their_records_train_alone(sampled, tmp_path, tokenizer):
    _, alone, ds_alone = merged_and_tokenized(sampled, tmp_path / "alone", tokenizer, 0.0)
    merge_section, merged, ds_merged = merged_and_tokenized(sampled, tmp_path / "merged", tokenizer, 1.0)
    by_uid = {}
    for i in range(len(ds_alone)):
        (uids,) = ds_alone.row_uids(i)
        by_uid[int(uids[0])] = trained_ids(ds_alone, i)
    n_multi = 0
    seen = []
    for i in range(len(ds_merged)):
        uids = [int(u) for u in ds_merged.row_uids(i)[0]]
        seen += uids
        n_multi += len(uids) > 1
        expected = np.concatenate([by_uid[u] for u in uids])
        np.testing.assert_array_equal(trained_ids(ds_merged, i), expected, err_msg=f"{tokenizer} uids {uids}")
    assert sorted(seen) == sorted(by_uid)  # the same records kept...
    assert merged["dropped"] == alone["dropped"]  # ...and dropped, for the same reasons
    assert merged["loss_tokens"] == alone["loss_tokens"] == sum(len(v) for v in by_uid.values())
    assert merged["lost"] == alone["lost"]
    assert n_multi >= 20 and merge_section["group_sizes"] != {"1": merge_section["in"]}
    reasons = set(alone["dropped"])
    if tokenizer == "phi3_mini_instruct":  # no tool calls, no tool messages
        assert "template_drops_tools" in reasons and merge_section["blocked"].get("record_error", 0) > 0
    if tokenizer == "llama3_1_instruct":  # one call per turn, and a tool-call turn renders only the call
        assert {"template_error", "template_drops_content"} <= reasons
    if tokenizer in ("qwen2_5_instruct", "qwen3"):
        assert not reasons and alone["lost"] == {}
    check_pieces_are_trained(sampled, tokenizer, ds_alone, by_uid)


def _squash(text: str) -> str:
    """Whitespace-free NFC text: decoders differ in spaces around special tokens and in normalization."""
    return "".join(unicodedata.normalize("NFC", text).split())


def check_pieces_are_trained(sampled_path, tokenizer, ds, by_uid) -> None:
    """Independently of the conservation check: the decoded loss tokens of every kept record hold the content,
    reasoning and tool-call names of each of its trained assistant messages."""
    tok = load_chat_tokenizer(str(tokenizer_dir(tokenizer)))
    records = {}
    with open(sampled_path, "rb") as f:
        for line in f:
            rec = orjson.loads(line)
            records[rec["meta"]["uid"]] = rec
    n_reasoning = n_calls = 0
    for uid, ids in by_uid.items():
        trained = _squash(tok.decode(ids.tolist()))
        rec = records[uid]
        labels = rec.get("labels") or [int(m["role"] == "assistant") for m in rec["messages"]]
        for msg, label in zip(rec["messages"], labels):
            if not label:
                continue
            for piece in (msg.get("content") or "", msg.get("reasoning_content") or ""):
                assert _squash(piece[-300:]) in trained, (tokenizer, uid, piece[-100:])
            n_reasoning += bool(msg.get("reasoning_content"))
            for call in msg.get("tool_calls") or ():
                assert _squash(call["function"]["name"]) in trained, (tokenizer, uid, call)
                n_calls += 1
    assert n_reasoning > 150 and (n_calls > 50 or tokenizer == "phi3_mini_instruct")  # Phi-3: none kept
