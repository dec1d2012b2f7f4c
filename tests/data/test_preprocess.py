"""Converters on the real fixtures, canonical validation errors (raised and counted), the ratio file, workers."""
import itertools

import orjson
import pytest

from data import pipeline, preprocess, ratios, sample
from data.config import DataConfig, InputSpec
from data.io import iter_jsonl, iter_rows
from data.pipeline import cli_main
from data.records import RecordError, validate_canonical
from data.report import DROPPED_AT_LIMIT, DroppedAt, check_arithmetic, read_report
from tests._data_helpers import CHAT_QA, data_config_file, preprocess_config_file, qa_rows
from tests.conftest import fixture_path


def make_cfg(tmp_path, inputs, **kw) -> DataConfig:
    kw.setdefault("num_workers", 1)
    return DataConfig(inputs=inputs, output_dir=str(tmp_path / "out"), tokenizer_path="unused", **kw)


def first_rows(path, n):
    return list(itertools.islice(iter_rows(str(path)), n))


def convert(path, n=50, **spec):
    spec = InputSpec(path=[str(path)], **spec)
    out = []
    for source, raw in first_rows(path, n):
        fmt, resolved = preprocess.detect_format(raw, spec, source)
        out.append((fmt, *preprocess.convert_row(raw, resolved, fmt, source)))
    return out


# ---------------------------------------------------------------------------------------------- converters
def test_gsm8k_question_answer_auto_and_explicit():
    path = fixture_path("data", "gsm8k_test.jsonl")
    raw = first_rows(path, 1)[0][1]
    for spec in ({}, {"format": "prompt_response", "prompt_key": "question", "response_key": "answer"}):
        fmt, rec, cat = convert(path, 1, system="Be brief.", **spec)[0]
        assert fmt == "prompt_response" and cat == "untracked"
        assert rec["messages"] == [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": raw["question"]},
                                   {"role": "assistant", "content": raw["answer"]}]
        assert rec["labels"] == [0, 0, 1]


def test_glaive_sharegpt_function_call_observation_and_tools():
    path = fixture_path("data", "llamafactory_glaive_toolcall_en_demo.json")
    converted = convert(path, 300)
    assert {fmt for fmt, _, _ in converted} == {"sharegpt"}
    fmt, rec, _ = converted[0]
    raw = first_rows(path, 1)[0][1]
    roles = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}
    assert [m["role"] for m in rec["messages"]] == [roles[t["from"]] for t in raw["conversations"]]
    call = rec["messages"][3]
    assert call["content"] == "" and call["tool_calls"] == [{"type": "function", "function": {
        "name": "search_recipes", "arguments": {"ingredients": ["chicken", "bell peppers", "rice"]}}}]
    assert rec["messages"][4]["content"] == raw["conversations"][4]["value"]
    assert rec["labels"] == [int(m["role"] == "assistant") for m in rec["messages"]]
    # tools: a JSON string of bare specs -> a list of {"type": "function", "function": spec}
    assert rec["tools"] == [{"type": "function", "function": t} for t in orjson.loads(raw["tools"])]
    # rows whose tools string is empty ("" or "[]") have no tools key
    assert sum("tools" not in r for _, r, _ in converted) == 109


def test_reason_tool_use_messages_with_content_parts():
    path = fixture_path("data", "llamafactory_reason_tool_use_demo_50.jsonl")
    converted = convert(path, 50)
    assert {fmt for fmt, _, _ in converted} == {"messages"}
    raws = [r for _, r in first_rows(path, 50)]
    n_calls = sum(p["type"] == "tool_call" for r in raws for m in r["messages"] for p in m["content"])
    assert sum(len(m.get("tool_calls", [])) for _, r, _ in converted for m in r["messages"]) == n_calls
    for (_, rec, _), raw in zip(converted, raws):
        for msg, raw_msg in zip(rec["messages"], raw["messages"]):
            parts = raw_msg["content"]
            assert msg["content"] == "".join(p["value"] for p in parts if p["type"] == "text")
            reasoning = [p["value"] for p in parts if p["type"] == "reasoning"]
            assert msg.get("reasoning_content") == ("".join(reasoning) if reasoning else None)
        assert rec.get("tools") == (None if raw["tools"] in ("", "[]") else orjson.loads(raw["tools"]))
    # parallel calls: one assistant message with several tool_calls, answered by a tool message
    multi = next(r for _, r, _ in converted if any(len(m.get("tool_calls", [])) > 1 for m in r["messages"]))
    i = next(i for i, m in enumerate(multi["messages"]) if len(m.get("tool_calls", [])) > 1)
    assert multi["messages"][i + 1]["role"] == "tool" and multi["labels"][i] == 1


def test_parallel_r1_verl_parquet():
    path = fixture_path("data", "parallel_r1_gsm8k_sft_train.parquet")
    raw = first_rows(path, 1)[0][1]
    fmt, rec, _ = convert(path, 1)[0]
    assert fmt == "verl"
    assert rec["messages"] == [{"role": "user", "content": raw["prompt"][0]["content"]},
                               {"role": "assistant", "content": raw["output"]}]
    fmt, rec2, _ = convert(path, 1, format="verl", response_key="output")[0]
    assert rec2 == rec


def test_fastchat_sharegpt_multiturn():
    path = fixture_path("data", "fastchat_dummy_conversation.json")
    fmt, rec, _ = convert(path, 1)[0]
    assert fmt == "sharegpt"
    assert [m["content"] for m in rec["messages"]] == ["Who are you?", rec["messages"][1]["content"],
                                                      "Have a nice day!", "You too!"]
    assert rec["labels"] == [0, 1, 0, 1]


def test_user_function_and_category_field(tmp_path):
    fn_file = tmp_path / "conv.py"
    fn_file.write_text(
        "def to_record(row):\n"
        "    if row['q'] == 'skip':\n"
        "        return None\n"
        "    if row['q'] == 'crash':\n"
        "        raise KeyError('nope')\n"
        "    return {'messages': [{'role': 'user', 'content': row['q']},\n"
        "                         {'role': 'assistant', 'content': row['a']}], 'meta': {'origin': row['src']}}\n"
    )
    data = tmp_path / "d.jsonl"
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in [
        {"q": "1+1", "a": "2", "src": "x", "kind": "math"},
        {"q": "skip", "a": "", "src": "y", "kind": "math"},
        {"q": "hi", "a": "hello", "src": "z", "kind": "chat"},
        {"q": "crash", "a": "", "src": "w", "kind": "chat"},
    ]))
    spec = InputSpec(path=[str(data)], format="function", function=f"{fn_file}:to_record", category_field="kind")
    with pytest.raises(RecordError, match=r"d.jsonl:4: function: .*conv.py:to_record raised KeyError: 'nope'"):
        preprocess.run(make_cfg(tmp_path, [spec]))
    cfg = make_cfg(tmp_path, [spec], on_error="skip")
    section = preprocess.run(cfg)
    recs = list(iter_jsonl(cfg.canonical_path))
    assert [r["meta"] for r in recs] == [
        {"category_id": 1, "category_name": "math", "uid": 0, "source": f"{data}:1", "origin": "x"},
        {"category_id": 2, "category_name": "chat", "uid": 1, "source": f"{data}:3", "origin": "z"},
    ]
    assert section["dropped"] == {"filtered_by_function": 1, "function_error": 1}
    assert section["in"] == 4 and section["out"] == 2


# ---------------------------------------------------------------------------------------------- validation
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
BAD = {
    "unknown_role": ({"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
                     "messages[0].role: unknown role 'narrator'"),
    "labels_length": ({**GOOD, "labels": [0, 1, 1]}, "labels: 3 labels for 2 messages"),
    "empty_conversation": ({"messages": []}, "messages: empty conversation"),
    "no_trainable_token": ({**GOOD, "labels": [0, 0]}, "labels: no assistant message is trained"),
    "bad_label": ({**GOOD, "labels": [1, 1]}, "labels[0]: label 1 on a user message"),
    "system_not_first": ({"messages": GOOD["messages"] + [{"role": "system", "content": "s"}]},
                         "messages[2].role: a system message is only allowed as the first message"),
}


def test_validate_defaults_and_passthrough():
    rec = validate_canonical({
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                     {"role": "assistant", "content": None,
                      "tool_calls": [{"name": "f", "arguments": '{"x": 1}'}]},
                     {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"},
                     {"role": "assistant", "content": "done"}],
        "tools": '[{"name": "f", "parameters": {}}]', "enable_thinking": False}, "f:1")
    assert rec["labels"] == [0, 0, 1, 0, 0, 1]
    assert rec["messages"][2] == {"role": "assistant", "content": "",
                                  "tool_calls": [{"type": "function", "function": {"name": "f",
                                                                                  "arguments": '{"x": 1}'}}]}
    assert rec["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert rec["enable_thinking"] is False


@pytest.mark.parametrize("reason", sorted(BAD))
def test_validation_error_messages(reason):
    record, message = BAD[reason]
    with pytest.raises(RecordError) as err:
        validate_canonical(record, "data.jsonl:7")
    assert err.value.reason == reason
    assert str(err.value).startswith(f"data.jsonl:7: {message}")


def _bad_input_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [orjson.dumps(GOOD), b'{"messages": [', *(orjson.dumps(BAD[k][0]) for k in sorted(BAD)),
             orjson.dumps(GOOD)]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_bad_inputs_error_names_file_line_and_field(tmp_path):
    path = _bad_input_file(tmp_path)
    cfg = make_cfg(tmp_path, [InputSpec(path=[str(path)], format="messages")])
    with pytest.raises(RecordError) as err:
        preprocess.run(cfg)
    assert str(err.value).startswith(f"{path}:2: line: malformed JSON")
    path.write_bytes(b"\n".join(path.read_bytes().split(b"\n")[2:]))  # drop good line + malformed line
    with pytest.raises(RecordError) as err:
        preprocess.run(cfg)
    assert str(err.value).startswith(f"{path}:1: labels[0]: label 1 on a user message")  # first of sorted(BAD)
    assert not cfg.canonical_path.exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_inputs_are_counted_under_skip_and_report_adds_up(tmp_path, workers):
    path = _bad_input_file(tmp_path)
    cfg = make_cfg(tmp_path, [InputSpec(path=[str(path)], format="messages")], on_error="skip",
                   num_workers=workers)
    section = preprocess.run(cfg)
    assert section["dropped"] == {"malformed_json": 1, **{k: 1 for k in BAD}}
    assert section["in"] == 2 + 1 + len(BAD) and section["out"] == 2
    check_arithmetic(section)
    assert read_report(cfg.report_path)["preprocess"] == section
    assert [r["meta"]["uid"] for r in iter_jsonl(cfg.canonical_path)] == [0, 1]


@pytest.mark.parametrize("part", [{"type": "text"}, {"type": "text", "text": 3}, {"type": "reasoning", "value": None}])
def test_content_part_without_string_text_is_bad_content(part):
    raw = {"messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": [{"type": "text", "text": "a"}, part]}]}
    with pytest.raises(RecordError) as err:
        preprocess.convert_messages(raw, InputSpec(path=["x"]), "d.jsonl:3")
    assert err.value.reason == "bad_content"
    assert str(err.value) == "d.jsonl:3: messages[1].content[1]: part has no string text/value"


def test_empty_tool_calls_list_is_no_tool_call():
    rec = validate_canonical({"messages": [{"role": "user", "content": "q", "tool_calls": []},
                                           {"role": "assistant", "content": "a", "tool_calls": []}]}, "d:1")
    assert rec["messages"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_message_category_id_beyond_int16_is_rejected():
    rec = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "category_id": 32768}]}
    with pytest.raises(RecordError, match=r"d:1: messages\[1\].category_id: expected an integer in 0..32767"):
        validate_canonical(rec, "d:1")
    rec["messages"][1]["category_id"] = 32767
    assert validate_canonical(rec, "d:1")["messages"][1]["category_id"] == 32767


def test_unknown_format_first_row_is_counted_under_skip(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"foo": 1}, {"bar": 2}, {"question": "q", "answer": "a"}, {"question": "q2", "answer": "a2"}]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    cfg = make_cfg(tmp_path, [InputSpec(path=[str(path)])])
    with pytest.raises(RecordError, match=f"{path}:1: format: cannot detect the format"):
        preprocess.run(cfg)
    cfg.on_error = "skip"
    section = preprocess.run(cfg)
    assert section["dropped"] == {"unknown_format": 2} and section["in"] == 4 and section["out"] == 2
    assert section["inputs"][0]["format"] == "prompt_response"
    assert [r["meta"]["source"] for r in iter_jsonl(cfg.canonical_path)] == [f"{path}:3", f"{path}:4"]


def test_skipped_records_are_listed_by_source_under_their_reason_capped(tmp_path):
    """report.json's `dropped_at`: a malformed line, a record with a bad field and a filtered one each under its
    reason as `path:line`, in input order across inputs; past DROPPED_AT_LIMIT only the count grows."""
    fn_file = tmp_path / "conv.py"
    fn_file.write_text(
        "def to_record(row):\n"
        "    if row['q'] == 'skip':\n"
        "        return None\n"
        "    return {'messages': [{'role': row.get('role', 'user'), 'content': row['q']},\n"
        "                         {'role': 'assistant', 'content': 'a'}]}\n"
    )
    first = tmp_path / "first.jsonl"
    first.write_bytes(b'{"q": "1+1"}\n{"q": "skip"}\n{oops\n{"q": "x", "role": "narrator"}\n')
    many = tmp_path / "many.jsonl"
    many.write_bytes(orjson.dumps(GOOD) + b"\n" + b"[1]\n" * 150)
    inputs = [InputSpec(path=[str(first)], format="function", function=f"{fn_file}:to_record"),
              InputSpec(path=[str(many)], format="messages")]
    cfg = make_cfg(tmp_path, inputs, on_error="skip")
    section = preprocess.run(cfg)
    assert section["dropped"] == {"filtered_by_function": 1, "malformed_json": 151, "unknown_role": 1}
    assert section["dropped_at"] == {
        "filtered_by_function": [f"{first}:2"],
        "malformed_json": [f"{first}:3"] + [f"{many}:{line}" for line in range(2, 2 + DROPPED_AT_LIMIT - 1)],
        "unknown_role": [f"{first}:4"],
    }
    assert read_report(cfg.report_path)["preprocess"]["dropped_at"] == section["dropped_at"]


def test_dropped_at_keeps_input_order_whatever_order_drops_are_found_in():
    """Every source form of data.io (`path:line`, `path:row`, `path:key[row]`, `split@dir:row`) sorts by input,
    then line or row; the list is the same for any order of discovery and holds at most the limit."""
    paths = ["b.jsonl", "a:1.json", "train@ds"]
    sources = ([f"b.jsonl:{n}" for n in (120, 9, 10, 2)] + ["a:1.json:test[3]", "a:1.json:train[2]"]
               + [f"train@ds:{n}" for n in range(200)])
    expected = (["b.jsonl:2", "b.jsonl:9", "b.jsonl:10", "b.jsonl:120", "a:1.json:train[2]", "a:1.json:test[3]"]
                + [f"train@ds:{n}" for n in range(DROPPED_AT_LIMIT - 6)])
    for order in (sources, sources[::-1], sorted(sources)):
        dropped_at = DroppedAt(preprocess.source_order(paths))
        for source in order:
            dropped_at.add("malformed_json", source)
        assert dropped_at.section() == {"malformed_json": expected}


# ---------------------------------------------------------------------------------------------- ratio file
def _jsonl(path, rows):
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return str(path)


def test_ratio_file_update_semantics(tmp_path):
    qa = [{"question": "q", "answer": "a"}]
    a = _jsonl(tmp_path / "a.jsonl", qa * 3)
    b = _jsonl(tmp_path / "b.jsonl", qa * 2)
    c = _jsonl(tmp_path / "c.jsonl", qa * 4)
    cfg = make_cfg(tmp_path, [InputSpec(path=[a], category_name="alpha"), InputSpec(path=[b], category_name="beta"),
                              InputSpec(path=[c])])
    preprocess.run(cfg)
    cats = ratios.read_ratio_file(cfg.ratio_file)
    assert cats == [
        {"category_id": 0, "category_name": "untracked", "size": 4, "sample_rate": 1.0},
        {"category_id": 1, "category_name": "alpha", "size": 3, "sample_rate": 1.0},
        {"category_id": 2, "category_name": "beta", "size": 2, "sample_rate": 1.0},
    ]
    # the user edits a rate; the next run drops beta, adds gamma and changes alpha's size
    cats[1]["sample_rate"] = 0.25
    ratios.write_ratio_file(cfg.ratio_file, cats)
    _jsonl(tmp_path / "a.jsonl", qa * 5)
    g = _jsonl(tmp_path / "g.jsonl", qa)
    cfg.inputs = [InputSpec(path=[g], category_name="gamma"), InputSpec(path=[a], category_name="alpha")]
    before = cfg.canonical_path.read_bytes()
    with pytest.raises(ValueError, match=r"ratios.json: entry 'beta' \(id 2, sample_rate 1.0\) matches no category of the "
                       r"data \(categories: \['alpha', 'gamma'\]\); .*delete the entry if the category is gone"):
        preprocess.run(cfg)  # an entry without data is an error (untracked, managed by the pipeline, may go)
    assert cfg.canonical_path.read_bytes() == before
    ratios.write_ratio_file(cfg.ratio_file, [c for c in cats if c["category_name"] != "beta"])
    preprocess.run(cfg)
    assert ratios.read_ratio_file(cfg.ratio_file) == [
        {"category_id": 0, "category_name": "untracked", "size": 0, "sample_rate": 1.0},
        {"category_id": 1, "category_name": "alpha", "size": 5, "sample_rate": 0.25},
        {"category_id": 2, "category_name": "gamma", "size": 1, "sample_rate": 1.0},  # beta's id was freed
    ]
    assert [r["meta"]["category_id"] for r in iter_jsonl(cfg.canonical_path)] == [2] + [1] * 5


def test_ratio_file_invalid(tmp_path):
    path = tmp_path / "r.json"
    path.write_bytes(orjson.dumps({"categories": [{"category_id": 1, "category_name": "a"},
                                                  {"category_id": 1, "category_name": "b"}]}))
    with pytest.raises(ValueError, match="duplicate category id 1"):
        ratios.read_ratio_file(path)
    path.write_bytes(orjson.dumps({"categories": [{"category_id": 40000, "category_name": "big"}]}))
    with pytest.raises(ValueError, match=r"r.json: categories\[0\]: category_id must be an integer in 0..32767"):
        ratios.read_ratio_file(path)
    for rate in (-0.5, 1e15, True, "2"):
        path.write_bytes(orjson.dumps({"categories": [{"category_id": 1, "category_name": "a", "sample_rate": rate}]}))
        with pytest.raises(ValueError, match=r"r.json: categories\[0\] \('a'\): sample_rate must be a number in "
                           r"0..1000 \(copies of each record\), got "):
            ratios.read_ratio_file(path)
    path.write_bytes(b'{"categories": [{"category_id": 1, "category_name": "a", "sample_rate": NaN}]}')
    with pytest.raises(ValueError, match="r.json: invalid JSON"):
        ratios.read_ratio_file(path)


def test_renamed_ratio_entry_is_an_error_not_a_new_category(tmp_path):
    """Renaming `math` to `maths` (rate 0.5) in the ratio file used to re-id the data's `math` and drop the rate."""
    qa = [{"question": "q", "answer": "a"}]
    cfg = make_cfg(tmp_path, [InputSpec(path=[_jsonl(tmp_path / "m.jsonl", qa * 4)], category_name="math"),
                              InputSpec(path=[_jsonl(tmp_path / "c.jsonl", qa * 2)], category_name="chat")])
    preprocess.run(cfg)
    cats = ratios.read_ratio_file(cfg.ratio_file)
    cats[0].update(category_name="maths", sample_rate=0.5)
    ratios.write_ratio_file(cfg.ratio_file, cats)
    message = r"entry 'maths' \(id 1, sample_rate 0.5\) matches no category of the data \(categories: \['chat', 'math'\]\)"
    with pytest.raises(ValueError, match=message):
        preprocess.run(cfg)
    from data import sample

    with pytest.raises(sample.SamplingError, match=r"categories \[1\] of the data have no entry: 'math' \(id 1\)"):
        sample.run(cfg)  # sample matches by name too (it matched by id: `maths` got math's rate)


# ---------------------------------------------------------------------------------------------- workers
def test_one_and_two_workers_write_identical_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(preprocess, "CHUNK_ROWS", 16)  # many chunks in flight
    inputs = [InputSpec(path=[str(fixture_path("data", "fastchat_dummy_conversation.json"))], category_name="chat"),
              InputSpec(path=[str(fixture_path("data", "llamafactory_reason_tool_use_demo_50.jsonl"))]),
              InputSpec(path=[str(fixture_path("data", "parallel_r1_gsm8k_sft_train.parquet"))],
                        category_name="parallel")]
    outputs = []
    for workers in (1, 2):
        cfg = make_cfg(tmp_path / str(workers), inputs, num_workers=workers)
        section = preprocess.run(cfg)
        outputs.append((cfg.canonical_path.read_bytes(), cfg.ratio_file.read_bytes(), section["out"]))
    assert outputs[0] == outputs[1]
    assert outputs[0][2] == 500 + 50 + 341


def _hostile_inputs(tmp_path) -> list[InputSpec]:
    """Inputs of every kind of task: .jsonl ranges (a BOM, blank lines, malformed and undetectable lines before the
    first detectable row, bad records, a user function that filters rows and adds meta keys, tools after meta),
    .parquet row groups, and rows the driver reads (.csv, a .json object of arrays with bad rows in both arrays)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fn_file = tmp_path / "conv.py"
    fn_file.write_text(
        "def to_record(row):\n"
        "    if row['q'].endswith('7'):\n"
        "        return None\n"
        "    return {'messages': [{'role': row.get('role', 'user'), 'content': row['q']},\n"
        "                         {'role': 'assistant', 'content': 'a'}], 'meta': {'origin': row['q'], 'n': 1}}\n")
    lines = [b"\xef\xbb\xbf\n", b"{oops\n", b'{"foo": 1}\n', b"\n"]
    for i in range(300):
        rec = {"question": f"q {i} \u00e9\t\"x\"", "answer": f"a {i}", "tools": [{"name": f"f{i}"}]}
        lines.append(orjson.dumps(rec if i % 11 else {"question": f"q {i}"}) + b"\n")
        lines += [b"   \n"] if i % 13 == 0 else []
        lines += [b"[1]\n"] if i % 17 == 0 else []
    qa = tmp_path / "qa.jsonl"
    qa.write_bytes(b"".join(lines))
    fn_rows = tmp_path / "fn.jsonl"
    fn_rows.write_bytes(b"".join(orjson.dumps({"q": f"row {i}", **({"role": "robot"} if i % 19 == 0 else {})})
                                 + b"\n" for i in range(200)))
    table = pa.Table.from_pylist([{"q": f"pq {i}", "a": None if i % 23 == 0 else f"b {i}"} for i in range(120)])
    parquet = tmp_path / "qa.parquet"
    pq.write_table(table, parquet, row_group_size=9)
    csv_file = tmp_path / "qa.csv"
    csv_file.write_text("question,answer\n" + "".join(f"c {i},d {i}\n" if i % 7 else f"c {i}\n" for i in range(80)))
    arrays = tmp_path / "arrays.json"
    arrays.write_bytes(orjson.dumps({"train": [GOOD] * 5 + [BAD["unknown_role"][0]] * 150,
                                     "test": [BAD["unknown_role"][0]] * 150 + [GOOD] * 3}))
    return [InputSpec(path=[str(qa)]),
            InputSpec(path=[str(fn_rows)], format="function", function=f"{fn_file}:to_record", category_name="fn"),
            InputSpec(path=[str(parquet)], format="prompt_response", prompt_key="q", response_key="a"),
            InputSpec(path=[str(csv_file)], category_name="csv"), InputSpec(path=[str(arrays)])]


def _outputs(cfg) -> tuple[bytes, bytes, dict]:
    section = orjson.loads(cfg.report_path.read_bytes())["preprocess"]
    for key in ("output", "ratio_file"):
        section.pop(key)
    return cfg.canonical_path.read_bytes(), cfg.ratio_file.read_bytes(), section


def test_outputs_do_not_depend_on_range_size_or_worker_count(tmp_path, monkeypatch):
    """canonical.jsonl, the ratio file and the report (sources, counts, `dropped_at`) are the same whatever size
    the .jsonl ranges are (one line each, a few lines, the whole file) and whatever the worker count: a range's
    line numbers follow those of the ranges before it, uids and category ids follow the input order."""
    inputs = _hostile_inputs(tmp_path)
    outputs = {}
    for range_bytes, workers in ((preprocess.INPUT_RANGE_BYTES, 1), (1, 1), (1, 2), (700, 3), (700, 1)):
        monkeypatch.setattr(preprocess, "INPUT_RANGE_BYTES", range_bytes)
        cfg = make_cfg(tmp_path / f"{range_bytes}_{workers}", inputs, num_workers=workers, on_error="skip")
        preprocess.run(cfg)
        outputs[range_bytes, workers] = _outputs(cfg)
        assert [p.name for p in cfg.out.glob(".*")] == [], "parts or temp files left behind"
    first = next(iter(outputs.values()))
    assert all(out == first for out in outputs.values())
    canonical, _, section = first
    records = [orjson.loads(line) for line in canonical.splitlines()]
    assert [r["meta"]["uid"] for r in records] == list(range(len(records))) == list(range(section["out"]))
    assert section["dropped"] == {"filtered_by_function": 20, "malformed_csv": 12, "malformed_json": 1 + 18,
                                  "missing_field": 27 + 6, "unknown_format": 2, "unknown_role": 10 + 300}
    qa = inputs[0].path[0]
    assert section["dropped_at"]["malformed_json"][:3] == [f"{qa}:2", f"{qa}:7", f"{qa}:26"]
    assert section["dropped_at"]["unknown_format"] == [f"{qa}:3", f"{qa}:5"]
    # the .json object of arrays: its bad rows by row number, then key (not in the order they are read)
    arrays = inputs[4].path[0]
    assert [s for s in section["dropped_at"]["unknown_role"] if s.startswith(arrays)][:7] == [
        f"{arrays}:test[{row}]" for row in range(5)] + [f"{arrays}:test[5]", f"{arrays}:train[5]"]
    fn_record = next(r for r in records if r["meta"]["category_name"] == "fn")
    assert list(fn_record["meta"]) == ["category_id", "category_name", "uid", "source", "origin", "n"]


def test_line_pieces_make_the_records_line():
    """`canonical_line(line_pieces(rec), ...)` is `orjson.dumps` of the record with its meta set (ours first, a
    user function's keys after), whatever optional keys follow meta."""
    base = validate_canonical(GOOD, "x")
    variants = [base, {**base, "meta": {"origin": "é\n", "category_id": 9}},
                {**base, "tools": [{"type": "function", "function": {"name": "f"}}], "enable_thinking": False},
                {**base, "meta": {"k": [1]}, "structure": {"a": 1}}]
    for rec in variants:
        extra = {k: v for k, v in rec["meta"].items() if k not in preprocess.META_KEYS}
        source = 'd:\\ir/"x".jsonl:12'
        expected = orjson.dumps({**rec, "meta": {"category_id": 3, "category_name": "ca\"t", "uid": 17,
                                                 "source": source, **extra}}) + b"\n"
        head, tail = preprocess.line_pieces(rec)
        assert preprocess.canonical_line(head, 3, orjson.dumps('ca"t'), 17, orjson.dumps(source), tail) == expected


@pytest.mark.parametrize("workers", [1, 2])
def test_the_first_error_in_input_order_is_raised(tmp_path, workers):
    """on_error=error: a bad record deep in a .jsonl input (read by a worker) is raised before a malformed row of a
    later .json input (read by the driver, which reads ahead), and a bad record of a .json input before a
    malformed row after it in the same file."""
    lines = [orjson.dumps(GOOD) + b"\n"] * 400 + [orjson.dumps(BAD["unknown_role"][0]) + b"\n"]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_bytes(b"".join(lines))
    array = tmp_path / "b.json"
    array.write_bytes(orjson.dumps([{"question": "q", "answer": "a"}, {"question": "q"}, 5]))
    qa = InputSpec(path=[str(array)], format="prompt_response", prompt_key="question", response_key="answer")
    cfg = make_cfg(tmp_path, [InputSpec(path=[str(jsonl)], format="messages"), qa], num_workers=workers)
    with pytest.raises(RecordError, match=rf"^{jsonl}:401: messages\[0\].role: unknown role"):
        preprocess.run(cfg)
    cfg.inputs = [qa]
    with pytest.raises(RecordError, match=rf"^{array}:1: answer: missing field"):
        preprocess.run(cfg)


# ---------------------------------------------------------------------------------------------- inputs that lose their rows
def test_an_input_that_loses_every_row_under_skip_is_an_error_naming_it(tmp_path, capsys):
    """A wrongly declared format under on_error: skip dropped 100% of the input (150/150 missing_field) with
    `warnings: []`."""
    good = _jsonl(tmp_path / "good.jsonl", [CHAT_QA] * 3)
    wrong = _jsonl(tmp_path / "gsm8k.jsonl", qa_rows(150))
    config = data_config_file(tmp_path, [{"path": good, "category_name": "chat"},
                                     {"path": wrong, "format": "prompt_response", "category_name": "math"}],
                          on_error="skip")
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main([config, "--stages", "preprocess"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"error: preprocess: inputs[1] ({wrong}, format prompt_response) lost all its 150 rows "
                   f"(missing_field 150; the first: {wrong}:1: prompt: missing field 'prompt'; row has ['answer', "
                   "'question']): nothing of it would be trained. Check its format and keys (prompt_key 'prompt', "
                   "response_key 'response'), or remove it from inputs")
    assert not (tmp_path / "out" / "canonical.jsonl").exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_an_input_that_loses_most_of_its_rows_is_a_warning(tmp_path, capsys, workers):
    good = _jsonl(tmp_path / "good.jsonl", [CHAT_QA] * 3)
    mostly = _jsonl(tmp_path / "qa.jsonl", qa_rows(10, bad={1, 2, 4, 5, 6, 7}))
    fine = _jsonl(tmp_path / "fine.jsonl", qa_rows(10, bad={3}))
    config = data_config_file(tmp_path, [{"path": good, "category_name": "chat"},
                                     {"path": mostly, "format": "prompt_response", "prompt_key": "question",
                                      "response_key": "answer", "category_name": "math"},
                                     {"path": fine, "category_name": "math"}],
                          on_error="skip", num_workers=workers)
    pipeline.main([config, "--stages", "preprocess"])
    warning = (f"inputs[1] ({mostly}, format prompt_response) lost 6 of its 10 rows (60%: missing_field 6; the first: "
               f"{mostly}:2: answer: missing field 'answer'; row has ['question']), more than input_loss_warning 0.5")
    section = read_report(tmp_path / "out" / "report.json")["preprocess"]
    assert section["warnings"] == [warning]
    assert [(st["dropped"], st["dropped_by_reason"]) for st in section["inputs"]] == [
        (0, {}), (6, {"missing_field": 6}), (1, {"missing_field": 1})]
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"WARNING: preprocess: {warning}"
    pipeline.main([config, "--stages", "preprocess", "input_loss_warning=0.6"])
    assert read_report(tmp_path / "out" / "report.json")["preprocess"]["warnings"] == []


# ---------------------------------------------------------------------------------------------- ratio-file keys
QA = {"question": "q", "answer": "a"}


@pytest.mark.parametrize("typo", ["sample_rat", "sample_rate "])
def test_a_mistyped_ratio_key_is_an_error_naming_the_entry_and_the_closest_key(tmp_path, typo):
    cfg = make_cfg(tmp_path, [InputSpec(path=[_jsonl(tmp_path / "c.jsonl", [QA] * 4)], category_name="chat")])
    preprocess.run(cfg)
    written = {"categories": [{"category_id": 1, "category_name": "chat", "size": 4, typo: 0.5}]}
    cfg.ratio_file.write_bytes(orjson.dumps(written))
    message = (rf"{cfg.ratio_file}: entry 'chat' \(categories\[0\]\): unknown key '{typo}'; did you mean "
               r"'sample_rate'\?")
    with pytest.raises(ValueError, match=message):
        preprocess.run(cfg)
    assert orjson.loads(cfg.ratio_file.read_bytes()) == written  # the user's key is still there
    with pytest.raises(ValueError, match=message):
        sample.run(cfg)
    cfg.ratio_file.write_bytes(orjson.dumps({"categoris": []}))
    with pytest.raises(ValueError, match=r"unknown key 'categoris'; did you mean 'categories'\?"):
        preprocess.run(cfg)


# ---------------------------------------------------------------------------------------------- empty inputs
@pytest.mark.parametrize("empty_bytes", [b"", b"\n\n  \n"])
def test_an_empty_input_next_to_others_is_a_counted_warning(tmp_path, capsys, empty_bytes):
    full = _jsonl(tmp_path / "full.jsonl", [QA] * 3)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(empty_bytes)
    cli_main(preprocess.run, "preprocess", [preprocess_config_file(tmp_path, [full, str(empty)])])
    assert capsys.readouterr().err.splitlines()[-1] == f"WARNING: preprocess: input {empty} is empty (no row)"
    section = read_report(tmp_path / "out" / "report.json")["preprocess"]
    assert section["empty_inputs"] == [str(empty)] and section["out"] == 3


def test_an_empty_only_input_is_an_error_naming_it(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(SystemExit):
        cli_main(preprocess.run, "preprocess", [preprocess_config_file(tmp_path, [str(empty)])])
    assert capsys.readouterr().err == f"error: preprocess: every input is empty (no row): {empty}\n"


def test_alpaca_records_are_detected_and_converted_as_llamafactory_reads_them(tmp_path, capsys):
    """`sh data_process.sh` on Stanford Alpaca / LLaMA-Factory alpaca rows (instruction, input, output; system and
    history optional) with format auto: the user turn is instruction + "\\n" + input (input empty: the instruction
    alone), history pairs come first and are trained like the answer. Before: `cannot detect the format from keys
    ['input', 'instruction', 'output']`."""
    from data import pipeline

    rows = [
        {"instruction": "Give three tips for staying healthy.", "input": "", "output": "Eat well, move, sleep."},
        {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
        {"instruction": "And in German?", "input": "", "output": "Guten Morgen", "system": "You translate.",
         "history": [["Translate to French: Good morning", "Bonjour"]]},
    ]
    data = tmp_path / "alpaca.jsonl"
    data.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    config = tmp_path / "alpaca.json"
    config.write_bytes(orjson.dumps({"inputs": [{"path": str(data)}], "output_dir": str(tmp_path / "out"),
                                     "tokenizer_path": "data/example/tokenizer", "num_workers": 1}))
    pipeline.main([str(config), "--stages", "preprocess,sample,merge,tokenize,pack"])
    records = [orjson.loads(line) for line in (tmp_path / "out" / "canonical.jsonl").read_bytes().splitlines()]
    assert [r["messages"] for r in records] == [
        [{"role": "user", "content": "Give three tips for staying healthy."},
         {"role": "assistant", "content": "Eat well, move, sleep."}],
        [{"role": "user", "content": "Translate to French.\nGood morning"},
         {"role": "assistant", "content": "Bonjour"}],
        [{"role": "system", "content": "You translate."},
         {"role": "user", "content": "Translate to French: Good morning"}, {"role": "assistant", "content": "Bonjour"},
         {"role": "user", "content": "And in German?"}, {"role": "assistant", "content": "Guten Morgen"}],
    ]
    assert [r["labels"] for r in records] == [[0, 1], [0, 1], [0, 0, 1, 0, 1]]
    report = read_report(tmp_path / "out" / "report.json")
    assert report["preprocess"]["inputs"][0]["format"] == "alpaca"
    assert report["pack"]["out"] >= 1 and capsys.readouterr().out.strip().endswith(f"packed: {tmp_path / 'out' / 'packed'}")


@pytest.mark.parametrize("row, field, message", [
    ({"instruction": ["x"], "output": "y"}, "instruction", "expected a string, got list"),
    ({"instruction": "x", "input": "", "output": "y", "history": [["only one"]]}, "history[0]",
     "expected a [user, assistant] pair of strings"),
])
def test_alpaca_bad_rows_name_the_field(row, field, message):
    spec = InputSpec(path=["a.jsonl"])
    fmt, resolved = preprocess.detect_format(row, spec, "a.jsonl:1")
    assert fmt == "alpaca"
    with pytest.raises(RecordError) as err:
        preprocess.convert_row(row, resolved, fmt, "a.jsonl:1")
    assert str(err.value).startswith(f"a.jsonl:1: {field}: {message}")
