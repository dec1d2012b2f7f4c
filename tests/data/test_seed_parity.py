"""verl / rllm datasets (data side) through the real stages, checked against independent references.

Every test runs data.preprocess.run -> data.sample.run -> data.merge.run -> data.tokenize.run on a config
built with common.config.from_dict, on the real fixtures, and reads the tokenized output back with
data.shards.dataset.PackedDataset. The reference for token ids is `apply_chat_template` of the whole conversation
(with tools); the reference loss mask is built the OpenSFT way, from renders of prefixes (prompt with the
generation prompt vs prompt + turn), which is valid for qwen2_5_instruct because its template is
prefix-stable at assistant boundaries (asserted for every turn). The pipeline instead uses character spans of
one render, so the two methods are independent.
"""
from __future__ import annotations

import shutil
from functools import lru_cache
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import fixture_path, tokenizer_dir

from common.config import from_dict
from data import merge, preprocess, sample, tokenize
from data.config import DataConfig
from data.records import RecordError
from data.report import check_arithmetic
from data.shards.dataset import PackedDataset

QWEN = "qwen2_5_instruct"
IGNORE = -100
EOT = "<|im_end|>"
N_GSM8K = 50
TRUNCATE_AT = 192  # GSM8K rows 0..49 with qwen2.5: prompts 55..144 tokens, whole records 120..465 tokens


# ---------------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module", autouse=True)
def _tokenizer_loaded_once():
    """Every tokenize.run loads the tokenizer (seconds on a busy CPU); share one instance across this module."""
    cached = lru_cache(maxsize=None)(tokenize.load_chat_tokenizer)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokenize, "load_chat_tokenizer", cached)
        yield


@pytest.fixture(scope="module")
def tok():
    return tokenize.load_chat_tokenizer(str(tokenizer_dir(QWEN)), None)  # the call (and cache key) of the stage


def config(out: Path, inputs: list[dict], **kw) -> DataConfig:
    raw = {"inputs": inputs, "output_dir": str(out), "tokenizer_path": str(tokenizer_dir(QWEN)),
           "num_workers": 1, "max_length": 8192, **kw}
    cfg = from_dict(DataConfig, raw)
    cfg.validate()
    return cfg


def run_front(cfg: DataConfig) -> None:
    """preprocess -> sample (every rate 1.0: all records, seeded order) -> merge."""
    preprocess.run(cfg)
    sample.run(cfg)
    merge.run(cfg)


def run_tokenize(cfg: DataConfig) -> tuple[dict, PackedDataset]:
    section = check_arithmetic(tokenize.run(cfg))
    return section, PackedDataset(cfg.tokenized_dir)


def rows_by_uid(ds: PackedDataset) -> dict[int, dict]:
    """Tokenized rows of unmerged records, keyed by their source uid."""
    out = {}
    for i in range(len(ds)):
        (uids,) = ds.row_uids(i)
        assert len(uids) == 1
        out[int(uids[0])] = ds[i]
    return out


def write_jsonl(path: Path, rows) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def reference(tok, messages: list[dict], tools=None, trained: set[int] | None = None):
    """(ids, turn) of a conversation: ids = apply_chat_template(messages, tools); turn[t] = k for the tokens of
    the k-th trained assistant message (all assistant messages, or the indices in `trained`), 0 elsewhere."""
    kw = {"tools": tools} if tools else {}
    ids = tok.apply_chat_template(messages, **kw)["input_ids"]
    turn = np.zeros(len(ids), dtype=np.int64)
    eot_id = tok.convert_tokens_to_ids(EOT)
    k = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or (trained is not None and i not in trained):
            continue
        prompt = tok.apply_chat_template(messages[:i], add_generation_prompt=True, **kw)["input_ids"]
        upto = tok.apply_chat_template(messages[: i + 1], **kw)["input_ids"]
        assert ids[: len(upto)] == upto and upto[: len(prompt)] == prompt, "template not prefix-stable here"
        end = len(upto) - upto[::-1].index(eot_id)  # through the turn's <|im_end|>, not the newline after it
        k += 1
        turn[len(prompt): end] = k
    return np.asarray(ids), turn


def assert_row_matches(row: dict, ids: np.ndarray, turn: np.ndarray) -> None:
    np.testing.assert_array_equal(row["input_ids"], ids)
    np.testing.assert_array_equal(row["turn_ids"], turn)
    np.testing.assert_array_equal(row["labels"], np.where(turn > 0, ids, IGNORE))
    assert row["seq_lens"].tolist() == [len(ids)]


def turn_text(tok, row: dict, k: int) -> str:
    assert np.all(row["labels"][row["turn_ids"] == k] != IGNORE)
    return tok.decode(row["input_ids"][row["turn_ids"] == k].tolist())


def gsm8k_rows() -> list[dict]:
    with open(fixture_path("data", "gsm8k_train.jsonl"), "rb") as f:
        return [orjson.loads(next(f)) for _ in range(N_GSM8K)]


def three_turn_conversations(rows: list[dict]) -> list[dict]:
    """Conversation j = GSM8K rows 3j, 3j+1, 3j+2 as three user/assistant turns."""
    out = []
    for j in range(len(rows) // 3):
        msgs = []
        for r in rows[3 * j: 3 * j + 3]:
            msgs += [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]
        out.append({"messages": msgs})
    return out


# ---------------------------------------------------------------------------------------------- GSM8K, verl single-turn
@pytest.fixture(scope="module")
def gsm8k_merged(tmp_path_factory, tok):
    """GSM8K rows as verl single-turn (prompt_key=question, response_key=answer) through preprocess..merge;
    returns (merged.jsonl, raw rows, reference (ids, turn) per uid)."""
    base = tmp_path_factory.mktemp("gsm8k")
    rows = gsm8k_rows()
    src = write_jsonl(base / "gsm8k.jsonl", rows)
    cfg = config(base / "out", [{"path": str(src), "format": "verl", "prompt_key": "question",
                                 "response_key": "answer", "category_name": "gsm8k"}])
    run_front(cfg)
    refs = {uid: reference(tok, [{"role": "user", "content": r["question"]},
                                 {"role": "assistant", "content": r["answer"]}])
            for uid, r in enumerate(rows)}
    lengths = [len(ids) for ids, _ in refs.values()]
    assert 5 < sum(n > TRUNCATE_AT for n in lengths) < N_GSM8K - 5  # some overflow, some do not
    return cfg.merged_path, rows, refs


def tokenize_gsm8k(gsm8k_merged, out: Path, **kw) -> DataConfig:
    merged_path, _, _ = gsm8k_merged
    cfg = config(out, [], stages=["tokenize"], max_length=TRUNCATE_AT, **kw)
    cfg.out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(merged_path, cfg.merged_path)
    return cfg


@pytest.mark.parametrize("mode", ["left", "right"])
def test_gsm8k_truncation_keeps_the_right_tokens(gsm8k_merged, tok, tmp_path, mode):
    _, rows, refs = gsm8k_merged
    # `truncation` (verl's name) overrides `overlong`
    cfg = tokenize_gsm8k(gsm8k_merged, tmp_path, truncation=mode, overlong="drop")
    section, ds = run_tokenize(cfg)
    by_uid = rows_by_uid(ds)
    assert sorted(by_uid) == list(range(N_GSM8K))  # nothing dropped: every prompt fits in TRUNCATE_AT
    n_over = 0
    for uid, row in by_uid.items():
        ids, turn = refs[uid]
        if len(ids) > TRUNCATE_AT:
            n_over += 1
            keep = slice(0, TRUNCATE_AT) if mode == "right" else slice(len(ids) - TRUNCATE_AT, len(ids))
            ids, turn = ids[keep], turn[keep].copy()
            turn[0] = 0  # nothing predicts a row's first token (labels are shifted), so it carries no loss
            present = np.unique(turn[turn > 0])
            turn[turn > 0] = np.searchsorted(present, turn[turn > 0]) + 1  # turns renumbered 1..T
        assert len(row["input_ids"]) == min(len(refs[uid][0]), TRUNCATE_AT)
        assert_row_matches(row, ids, turn)
        text = turn_text(tok, row, 1)
        answer = rows[uid]["answer"] + EOT
        if len(refs[uid][0]) <= TRUNCATE_AT:
            assert text == answer  # whole answer + end of turn; no prompt, no generation header
        elif mode == "right":
            assert answer.startswith(text) and text != answer  # the head of the answer survives
        else:
            assert answer.endswith(text)  # the tail survives (the prompt goes first)
    assert section["truncated"] == n_over > 0
    assert section["overlong_policy"] == mode and section["out"] == N_GSM8K
    assert ds.row_n_tokens.max() == TRUNCATE_AT


def test_gsm8k_truncation_error_names_the_record(gsm8k_merged, tmp_path):
    merged_path, _, refs = gsm8k_merged
    first_over = None
    with open(merged_path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            meta = orjson.loads(line)["meta"]
            if len(refs[meta["uid"]][0]) > TRUNCATE_AT:
                first_over = lineno, len(refs[meta["uid"]][0]), meta["source"]
                break
    lineno, n_tokens, origin = first_over
    for on_error in ("error", "skip"):  # truncation: error is fatal whatever on_error says
        cfg = tokenize_gsm8k(gsm8k_merged, tmp_path / on_error, truncation="error", on_error=on_error)
        with pytest.raises(RecordError) as info:
            tokenize.run(cfg)
        message = str(info.value)
        assert message.startswith(f"{cfg.merged_path}:{lineno} (from {origin}): messages: ")  # and the raw row
        assert f"{n_tokens} tokens > max_length {TRUNCATE_AT}" in message
        assert info.value.reason == "overlong"
        assert not cfg.tokenized_dir.exists()  # nothing half-written


# ---------------------------------------------------------------------------------------------- one run, four datasets
@pytest.fixture(scope="module")
def mixed(tmp_path_factory, tok):
    """verl parquet (prompt as a message list), glaive tool calls (ShareGPT), reason-tool-use (messages, tools as a
    JSON string or a list) and 3-turn conversations, in one run with loss_turns=all; overlong records are errors.
    Returns (tokenized rows by uid, {category: [(uid, reference messages, tools)]})."""
    base = tmp_path_factory.mktemp("mixed")
    gsm = gsm8k_rows()
    system = "Solve the problem step by step and end with '#### <answer>'."
    verl_rows = [{"data_source": "gsm8k",
                  "prompt": ([{"role": "system", "content": system}] if i % 2 == 0 else [])
                  + [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
                 for i, r in enumerate(gsm)]
    verl_path = base / "gsm8k_verl.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows), verl_path)

    glaive = orjson.loads(fixture_path("data", "llamafactory_glaive_toolcall_en_demo.json").read_bytes())[:60]
    glaive_path = base / "glaive.json"
    glaive_path.write_bytes(orjson.dumps(glaive))

    with open(fixture_path("data", "llamafactory_reason_tool_use_demo_50.jsonl"), "rb") as f:
        reason = [orjson.loads(line) for line in f if line.strip()]
    reason = [dict(r, tools=orjson.loads(r["tools"])) if i % 2 else r for i, r in enumerate(reason)]
    reason_path = write_jsonl(base / "reason.jsonl", reason)

    three = three_turn_conversations(gsm[:30])
    three_path = write_jsonl(base / "three.jsonl", three)

    cfg = config(base / "out", [
        {"path": str(verl_path), "format": "verl", "response_key": "answer", "category_name": "verl"},
        {"path": str(glaive_path), "format": "sharegpt", "category_name": "glaive"},
        {"path": str(reason_path), "format": "messages", "category_name": "reason"},
        {"path": str(three_path), "format": "messages", "category_name": "three"},
    ], overlong="error")
    run_front(cfg)
    _, ds = run_tokenize(cfg)

    # independent conversions of the raw rows into what apply_chat_template should see
    expected: dict[str, list] = {"verl": [], "glaive": [], "reason": [], "three": []}
    uid = 0
    for r in verl_rows:
        expected["verl"].append((uid, r["prompt"] + [{"role": "assistant", "content": r["answer"]}], None))
        uid += 1
    for r in glaive:
        msgs = []
        for t in r["conversations"]:
            if t["from"] == "function_call":
                call = orjson.loads(t["value"])
                msgs.append({"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]})
            else:
                role = {"human": "user", "gpt": "assistant", "observation": "tool"}[t["from"]]
                msgs.append({"role": role, "content": t["value"]})
        tools = [{"type": "function", "function": spec} for spec in orjson.loads(r["tools"])] or None
        expected["glaive"].append((uid, msgs, tools))
        uid += 1
    for r in reason:
        msgs = []
        for m in r["messages"]:
            parts = {"text": [], "reasoning": [], "tool_call": []}
            for p in m["content"]:
                parts[p["type"]].append(p["value"])
            msg = {"role": m["role"], "content": "".join(parts["text"])}
            if parts["reasoning"]:  # Qwen2.5 does not render reasoning: `reasoning: auto` inlines it (issue 12)
                msg["content"] = ("<think>\n" + "".join(parts["reasoning"]).strip("\n") + "\n</think>\n\n"
                                  + msg["content"].lstrip("\n"))
            if parts["tool_call"]:
                msg["tool_calls"] = [{"type": "function", "function": orjson.loads(c)} for c in parts["tool_call"]]
            msgs.append(msg)
        tools = r["tools"] if isinstance(r["tools"], list) else orjson.loads(r["tools"])
        expected["reason"].append((uid, msgs, tools))
        uid += 1
    for r in three:
        expected["three"].append((uid, r["messages"], None))
        uid += 1
    by_uid = rows_by_uid(ds)
    assert sorted(by_uid) == list(range(uid))
    assert {ds.categories[int(row["category_ids"][0])] for row in by_uid.values()} == set(expected)
    return by_uid, expected


def check_against_reference(tok, by_uid, cases) -> None:
    for uid, msgs, tools in cases:
        row = by_uid[uid]
        ids, turn = reference(tok, msgs, tools)
        assert_row_matches(row, ids, turn)
        assistants = [m for m in msgs if m["role"] == "assistant"]
        assert int(row["turn_ids"].max()) == len(assistants)  # every assistant turn trained, nothing else
        trained_text = tok.decode(row["input_ids"][row["labels"] != IGNORE].tolist())
        for k, m in enumerate(assistants, 1):
            text = turn_text(tok, row, k)
            assert text.endswith(EOT) and "<|im_start|>" not in text  # end of turn in, header out
            if not m.get("tool_calls"):
                assert text == m["content"] + EOT
            else:
                assert all(f'"name": "{c["function"]["name"]}"' in text for c in m["tool_calls"])
        assert "<tool_response>" not in trained_text  # tool outputs are never trained
        for m in msgs:
            if m["role"] in ("tool", "user", "system") and len(m["content"]) > 40:
                assert m["content"] not in trained_text


def test_verl_prompt_as_message_list(mixed, tok):
    by_uid, expected = mixed
    check_against_reference(tok, by_uid, expected["verl"])
    with_system = [uid for uid, msgs, _ in expected["verl"] if msgs[0]["role"] == "system"]
    assert with_system and "Solve the problem step by step" in tok.decode(by_uid[with_system[0]]["input_ids"].tolist())


def test_glaive_tool_calls_multi_turn_with_tools(mixed, tok):
    by_uid, expected = mixed
    cases = expected["glaive"]
    assert sum(any(m.get("tool_calls") for m in msgs) for _, msgs, _ in cases) >= 20
    check_against_reference(tok, by_uid, cases)
    uid, msgs, tools = next(c for c in cases if c[2])
    assert tools[0]["function"]["name"] in tok.decode(by_uid[uid]["input_ids"].tolist())  # tools rendered


def test_reason_tool_use_multi_turn_with_tools(mixed, tok):
    by_uid, expected = mixed
    cases = expected["reason"]
    # consecutive tool messages and several tool calls in one assistant turn are both in the data
    assert any(len(m.get("tool_calls", [])) > 1 for _, msgs, _ in cases for m in msgs)
    check_against_reference(tok, by_uid, cases)


def test_loss_turns_all_trains_every_turn_of_three(mixed, tok):
    by_uid, expected = mixed
    check_against_reference(tok, by_uid, expected["three"])
    for uid, msgs, _ in expected["three"]:
        assert int(by_uid[uid]["turn_ids"].max()) == 3


# ---------------------------------------------------------------------------------------------- rllm stepwise
def test_loss_turns_last_is_per_original_record_with_pseudo_multiturn(tmp_path, tok):
    convs = three_turn_conversations(gsm8k_rows()[:36])
    src = write_jsonl(tmp_path / "three.jsonl", convs)
    cfg = config(tmp_path / "out", [{"path": str(src), "format": "messages", "category_name": "three"}],
                 loss_turns="last", merge={"probability": 0.5, "max_tokens": 2000})
    run_front(cfg)
    _, ds = run_tokenize(cfg)
    sizes = []
    for i in range(len(ds)):
        row = ds[i]
        uids = [int(u) for u in ds.row_uids(i)[0]]
        sizes.append(len(uids))
        msgs = [m for u in uids for m in convs[u]["messages"]]
        last_of_each = {6 * k + 5 for k in range(len(uids))}  # each original: u, a, u, a, u, a
        ids, turn = reference(tok, msgs, trained=last_of_each)
        assert_row_matches(row, ids, turn)
        assert int(row["turn_ids"].max()) == len(uids)
        for k, u in enumerate(uids, 1):
            assert turn_text(tok, row, k) == convs[u]["messages"][5]["content"] + EOT
    assert sorted(u for i in range(len(ds)) for u in ds.row_uids(i)[0].tolist()) == list(range(len(convs)))
    assert 1 in sizes and max(sizes) > 1  # unmerged (stepwise: last turn only) and merged records both checked


# ---------------------------------------------------------------------------------------------- system not first
def test_system_message_not_first_is_an_error_naming_file_and_line(tmp_path):
    with open(fixture_path("data", "llamafactory_reason_tool_use_demo_50.jsonl"), "rb") as f:
        rows = [orjson.loads(next(f)) for _ in range(3)]
    msgs = rows[1]["messages"]
    assert msgs[0]["role"] == "system"
    rows[1]["messages"] = [msgs[1], msgs[0]] + msgs[2:]
    src = write_jsonl(tmp_path / "reason.jsonl", rows)
    inputs = [{"path": str(src), "format": "messages"}]
    with pytest.raises(RecordError) as info:
        preprocess.run(config(tmp_path / "strict", inputs))
    assert str(info.value) == f"{src}:2: messages[1].role: a system message is only allowed as the first message"
    section = preprocess.run(config(tmp_path / "skip", inputs, on_error="skip"))
    assert (section["in"], section["out"], section["dropped"]) == (3, 2, {"system_not_first": 1})
