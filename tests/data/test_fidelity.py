"""What a record asks to train reaches the loss (reasoning, tool calls, merged turns), or is counted.

References are written out here independently of data/fidelity.py: inlined reasoning is built by hand as
`<think>\\n` + reasoning + `\\n</think>\\n\\n` + content, parsed tool arguments with json.loads, and token ids
come from `apply_chat_template` on those hand-built messages.
"""
import json
from functools import lru_cache

import orjson
import pytest

from tests.conftest import fixture_path, tokenizer_dir

from data.chat_template import analyze_template, load_chat_tokenizer
from data.records import RecordError, validate_canonical
from data.report import check_arithmetic
from data.tokenize import TokenizeContext, tokenize_records

EOT = {"qwen2_5_instruct": "<|im_end|>", "qwen3": "<|im_end|>", "llama3_1_instruct": "<|eot_id|>",
       "phi3_mini_instruct": "<|end|>"}


@lru_cache(maxsize=None)
def _tok(name):
    tok = load_chat_tokenizer(str(tokenizer_dir(name)))
    return tok, analyze_template(tok)


def ctx_for(name, **kw):
    tok, info = _tok(name)
    return TokenizeContext(tokenizer=tok, info=info, max_length=10**6, **kw)


def longcot(n):
    out = []
    with open(fixture_path("data", "skyt1_math500_longcot.messages.jsonl"), "rb") as f:
        for line in f:
            out.append({"messages": orjson.loads(line)["messages"], "meta": {"uid": len(out), "category_id": 1}})
            if len(out) == n:
                return out
    return out


def inline(reasoning, content):
    return "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")


def trained_text(tok, res, k):
    return tok.decode(res.input_ids[res.turn_ids == k].tolist())


# ---------------------------------------------------------------------------------------------- reasoning
@pytest.mark.parametrize("name", ["qwen2_5_instruct", "llama3_1_instruct", "phi3_mini_instruct"])
def test_auto_inlines_reasoning_the_template_does_not_render(name):
    tok, _ = _tok(name)
    recs = longcot(3)
    assert all(m.get("reasoning_content") for r in recs for m in r["messages"] if m["role"] == "assistant")
    results = tokenize_records(recs, ctx_for(name))
    for rec, res in zip(recs, results):
        assert not isinstance(res, RecordError), res
        user, asst = rec["messages"]
        by_hand = [user, {"role": "assistant", "content": inline(asst["reasoning_content"], asst["content"])}]
        assert res.input_ids.tolist() == tok.apply_chat_template(by_hand)["input_ids"]
        text = trained_text(tok, res, 1)
        assert asst["reasoning_content"].strip()[-200:] in text and asst["content"].strip()[-200:] in text
        assert text.endswith(EOT[name])
        assert res.fidelity["reasoning_inlined"] == 1 and res.fidelity["reasoning_by_template"] == 0
    # the loss grows by the reasoning: about 3x the answer on this fixture (issue 12: ~70% was lost)
    plain = tokenize_records(recs, ctx_for(name, reasoning="template"))
    assert all(p.fidelity["reasoning_not_rendered"] == 1 for p in plain)
    assert sum(r.n_loss_tokens for r in results) > 2 * sum(p.n_loss_tokens for p in plain)


def _two_query_record():
    """Two user queries, each answered with reasoning: Qwen3 renders only the reasoning after the last query."""
    return {"messages": [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5", "reasoning_content": "Two plus three is five."},
        {"role": "user", "content": "And times 4?"},
        {"role": "assistant", "content": "20", "reasoning_content": "Five times four is twenty."},
    ], "meta": {"uid": 7, "category_id": 1}}


def test_qwen3_auto_keeps_the_reasoning_the_template_strips_from_earlier_turns():
    tok, _ = _tok("qwen3")
    rec = _two_query_record()
    (res,) = tokenize_records([rec], ctx_for("qwen3"))
    assert trained_text(tok, res, 1) == inline("Two plus three is five.", "5") + "<|im_end|>"
    assert trained_text(tok, res, 2) == inline("Five times four is twenty.", "20") + "<|im_end|>"  # native
    # turn 1 is rendered as the template renders it as the last turn; the rest is the one render
    assert (res.fidelity["reasoning_inlined"], res.fidelity["reasoning_by_template"]) == (0, 2)
    full = tok.apply_chat_template(rec["messages"], tokenize=False)
    first = "<|im_start|>assistant\n5<|im_end|>"
    assert full.count(first) == 1
    expected = full.replace(first, "<|im_start|>assistant\n" + inline("Two plus three is five.", "5") + "<|im_end|>")
    assert res.input_ids.tolist() == tok(expected, add_special_tokens=False)["input_ids"]

    (kept,) = tokenize_records([rec], ctx_for("qwen3", reasoning="template"))
    assert trained_text(tok, kept, 1) == "5<|im_end|>"  # the template's choice, counted:
    assert kept.fidelity["reasoning_not_rendered"] == 1
    assert kept.fidelity["reasoning_not_rendered_chars"] == len("Two plus three is five.")

    (err,) = tokenize_records([rec], ctx_for("qwen3", reasoning="error"))
    assert isinstance(err, RecordError) and err.reason == "reasoning_not_rendered"
    assert str(err).startswith("record 0: messages[1].reasoning_content: the chat template does not render")

    (dropped,) = tokenize_records([rec], ctx_for("qwen3", reasoning="drop"))
    assert "five." not in tok.decode(dropped.input_ids.tolist()) and dropped.fidelity["reasoning_dropped"] == 2
    assert trained_text(tok, dropped, 2) == "<think>\n\n</think>\n\n20<|im_end|>"  # Qwen3's empty block


def test_reasoning_tags_are_configurable():
    tok, _ = _tok("qwen2_5_instruct")
    (res,) = tokenize_records(longcot(1), ctx_for("qwen2_5_instruct", reasoning_tags=("<reason>", "</reason>")))
    asst = longcot(1)[0]["messages"][1]
    expected = "<reason>" + asst["reasoning_content"].strip("\n") + "</reason>" + asst["content"].lstrip("\n")
    assert trained_text(tok, res, 1) == expected + "<|im_end|>"


# ---------------------------------------------------------------------------------------------- tool calls
def _tool_record(arguments):
    return {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "assistant", "content": "It is 21 degrees."},
    ], "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}], "meta": {"uid": 3, "category_id": 2}}


def test_tool_arguments_json_string_is_parsed_or_kept():
    tok, _ = _tok("qwen2_5_instruct")
    rec = _tool_record('{"city":"Paris"}')
    (parsed,) = tokenize_records([rec], ctx_for("qwen2_5_instruct"))
    call = trained_text(tok, parsed, 1)
    assert '"arguments": {"city": "Paris"}' in call and "\\\"" not in call
    by_hand = json.loads(json.dumps(rec))
    by_hand["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    assert parsed.input_ids.tolist() == tok.apply_chat_template(by_hand["messages"], tools=rec["tools"])["input_ids"]
    assert parsed.fidelity["tool_arguments_parsed"] == 1 and parsed.fidelity["tool_calls"] == 1
    (kept,) = tokenize_records([rec], ctx_for("qwen2_5_instruct", tool_arguments="keep"))
    assert '"arguments": "{\\"city\\":\\"Paris\\"}"' in trained_text(tok, kept, 1)  # double-encoded, as asked


@pytest.mark.parametrize("arguments,message", [("{not json", "invalid JSON"),
                                               ('["Paris"]', "expected a JSON object, got list")])
def test_bad_tool_arguments_name_the_field(arguments, message):
    (err,) = tokenize_records([_tool_record(arguments)], ctx_for("qwen2_5_instruct"), sources=["m.jsonl:4"])
    assert isinstance(err, RecordError) and err.reason == "bad_tool_arguments"
    assert str(err).startswith(f"m.jsonl:4: messages[1].tool_calls[0].function.arguments: {message}")
    (kept,) = tokenize_records([_tool_record(arguments)], ctx_for("qwen2_5_instruct", tool_arguments="keep"))
    assert not isinstance(kept, RecordError)  # keep: the user's text, as given


def test_phi3_drops_tools_and_llama_drops_content_of_a_tool_call_turn():
    rec = _tool_record({"city": "Paris"})
    (err,) = tokenize_records([rec], ctx_for("phi3_mini_instruct"))
    assert err.reason == "template_drops_tools" and "messages[1].tool_calls[0]" in str(err)
    only_tool_message = json.loads(json.dumps(rec))
    only_tool_message["labels"] = [0, 0, 0, 1]  # the call is context: the dropped tool message still counts
    (err,) = tokenize_records([only_tool_message], ctx_for("phi3_mini_instruct"))
    assert err.reason == "template_drops_tools" and "messages[2]" in str(err)
    with_text = json.loads(json.dumps(rec))
    with_text["messages"][1]["content"] = "Let me look that up."
    (err,) = tokenize_records([with_text], ctx_for("llama3_1_instruct"))
    assert err.reason == "template_drops_content" and str(err).startswith("record 0: messages[1].content:")
    (ok,) = tokenize_records([with_text], ctx_for("qwen2_5_instruct"))
    assert "Let me look that up." in trained_text(_tok("qwen2_5_instruct")[0], ok, 1)


def test_empty_assistant_turn_is_an_error():
    rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]}
    with pytest.raises(RecordError, match=r"^x:1: messages\[1\]: trained assistant message has no content") as info:
        validate_canonical(rec, "x:1")
    assert info.value.reason == "empty_assistant"
    validate_canonical(dict(rec, labels=[0, 0]) | {"messages": rec["messages"] + [
        {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}], "labels": [0, 0, 0, 1]}, "x:2")
    only_reasoning = {"messages": [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": "", "reasoning_content": "think"}]}
    (res,) = tokenize_records([only_reasoning], ctx_for("qwen2_5_instruct"))
    assert not isinstance(res, RecordError)
    (err,) = tokenize_records([only_reasoning], ctx_for("qwen2_5_instruct", reasoning="drop"))
    assert err.reason == "empty_assistant"


# ---------------------------------------------------------------------------------------------- the stage report
def test_report_counts_reasoning_tools_and_losses(tmp_path, capsys):
    from data.config import DataConfig
    from data.tokenize import run

    recs = longcot(4) + [_tool_record("{bad"), _tool_record('{"city": "Oslo"}')]
    recs[4]["meta"] = {"uid": 4, "category_id": 2}
    recs[5]["meta"] = {"uid": 5, "category_id": 2}
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "merged.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in recs))
    reasoning_chars = sum(len(r["messages"][1]["reasoning_content"]) for r in recs[:4])
    for policy in ("auto", "template"):
        cfg = DataConfig(inputs=[], output_dir=str(tmp_path), tokenizer_path=str(tokenizer_dir("qwen2_5_instruct")),
                         on_error="skip", reasoning=policy, num_workers=1)
        section = check_arithmetic(run(cfg))
        assert section["dropped"] == {"bad_tool_arguments": 1}
        bad_chars = len("get_weather") + len("{bad") + len("It is 21 degrees.")
        assert section["lost"]["bad_tool_arguments"] == {"records": 1, "chars": bad_chars}
        assert section["reasoning"]["messages"] == 4 and section["reasoning"]["chars"] == reasoning_chars
        assert section["tool_calls"] == {"arguments": "parse", "calls": 1, "arguments_parsed": 1}
        cats = section["categories"]
        assert cats["1"]["loss_tokens"] == cats["1"]["loss_tokens_before"] > 0
        assert cats["2"]["tokens_before"] == cats["2"]["tokens"]  # the bad record failed before encoding
        assert (cats["2"]["before"], cats["2"]["after"]) == (2, 1)
        printed = capsys.readouterr().out
        if policy == "auto":
            assert section["reasoning"]["inlined"] == {"messages": 4, "chars": reasoning_chars}
            assert "reasoning_not_rendered" not in section["lost"]
            auto_loss = section["loss_tokens"]
        else:
            assert section["lost"]["reasoning_not_rendered"] == {"records": 4, "chars": reasoning_chars}
            assert section["reasoning"]["not_rendered"] == {"messages": 4, "chars": reasoning_chars}
            assert section["loss_tokens"] < auto_loss / 2
            assert f"reasoning_not_rendered 4 records / {reasoning_chars:,} chars" in printed


def test_config_keys_are_checked_before_any_work(tmp_path):
    from common.config import ConfigError, from_dict
    from data.config import DataConfig

    base = {"inputs": [], "output_dir": str(tmp_path), "tokenizer_path": str(tokenizer_dir("qwen3")),
            "stages": ["tokenize"]}
    cfg = from_dict(DataConfig, base)
    assert (cfg.reasoning, cfg.reasoning_tags, cfg.tool_arguments) == ("auto", ["<think>\n", "\n</think>\n\n"], "parse")
    with pytest.raises(ConfigError, match=r"config.reasoning: 'inline' is not one of"):
        from_dict(DataConfig, {**base, "reasoning": "inline"})
    with pytest.raises(ConfigError, match=r"config.tool_arguments: 'json' is not one of"):
        from_dict(DataConfig, {**base, "tool_arguments": "json"})
    with pytest.raises(ConfigError, match=r"reasoning_tags must be two non-empty strings"):
        from_dict(DataConfig, {**base, "reasoning_tags": ["<think>"]}).validate()


def test_merged_record_with_bad_parts_is_a_record_error():
    rec = _two_query_record()
    rec["meta"]["parts"] = [{"start": 0}, {"start": 9}]
    (err,) = tokenize_records([rec], ctx_for("qwen2_5_instruct"), sources=["merged.jsonl:2"])
    assert err.reason == "bad_record" and str(err).startswith("merged.jsonl:2: meta.parts: expected")
    rec["meta"]["parts"] = [{"start": 0, "system": False}, {"start": 2, "system": False}]
    (res,) = tokenize_records([rec], ctx_for("qwen3"))
    (alone,) = tokenize_records([dict(rec, meta={"uid": 7})], ctx_for("qwen3"))
    # Qwen3 alone: turn 1 is before the last query; as part 1 of a merged record it is its record's last turn
    assert res.n_loss_tokens == alone.n_loss_tokens


def test_qwen3_think_block_inside_earlier_content_is_kept():
    """Content that already holds a <think> block: Qwen3 strips it from turns before the last query."""
    tok, _ = _tok("qwen3")
    rec = _two_query_record()
    for m in rec["messages"][1::2]:
        m["content"] = inline(m.pop("reasoning_content"), m["content"])
    (res,) = tokenize_records([rec], ctx_for("qwen3"))
    assert trained_text(tok, res, 1) == inline("Two plus three is five.", "5") + "<|im_end|>"
    (err,) = tokenize_records([rec], ctx_for("qwen3", reasoning="template"))
    assert err.reason == "template_drops_content" and str(err).startswith("record 0: messages[1].content:")


def test_whitespace_a_template_rewrites_is_not_a_loss():
    """Qwen3 rewrites `<think>r</think>a` as `<think>\\nr\\n</think>\\n\\na`: the same text, kept."""
    tok, _ = _tok("qwen3")
    rec = {"messages": [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "<think>add</think>5"}]}
    (res,) = tokenize_records([rec], ctx_for("qwen3", reasoning="template"))
    assert trained_text(tok, res, 1) == "<think>\nadd\n</think>\n\n5<|im_end|>"


def test_a_record_that_fails_alone_is_never_merged(tmp_path):
    from data import merge
    from data.config import DataConfig, MergeConfig
    from data.io import iter_jsonl

    def rec(uid, answer):
        return {"messages": [{"role": "user", "content": f"q{uid}"}, {"role": "assistant", "content": answer}],
                "labels": [0, 1], "meta": {"uid": uid, "category_id": 1}}

    bad = _tool_record("{not json")
    bad["meta"] = {"uid": 2, "category_id": 1}
    bad["labels"] = [0, 1, 0, 1]
    records = [rec(0, "a0"), rec(1, "a1"), bad, rec(3, "a3"), rec(4, "a4")]
    cfg = DataConfig(inputs=[], output_dir=str(tmp_path), tokenizer_path=str(tokenizer_dir("qwen2_5_instruct")),
                     num_workers=1, merge=MergeConfig(probability=1.0, max_tokens=10_000))
    cfg.sampled_path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    section = merge.run(cfg)
    assert [o["meta"].get("uids", [o["meta"].get("uid")]) for o in iter_jsonl(cfg.merged_path)] == [[0, 1], [2], [3, 4]]
    assert section["blocked"] == {"record_error": 2}  # it joins nothing, and nothing joins it
    first = next(iter_jsonl(cfg.merged_path))
    assert first["meta"]["parts"] == [{"start": 0, "system": False}, {"start": 2, "system": False}]
