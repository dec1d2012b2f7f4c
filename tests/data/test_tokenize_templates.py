"""Tokenize core against real chat templates: ids == apply_chat_template, masks == assistant text + end-of-turn.

The expected header / end-of-turn of each template is written out here (not taken from data.chat_template),
so the automatic template analysis is checked too.
"""
import json
import unicodedata

import numpy as np
import pytest

from tests.conftest import fixture_path, tokenizer_dir

from data.chat_template import analyze_template, assistant_spans, load_chat_tokenizer
from data.records import RecordError
from data.tokenize import IGNORE_INDEX, TokenizeContext, tokenize_records

TEMPLATES = {
    "qwen2_5_instruct": ("<|im_start|>assistant\n", "<|im_end|>"),
    "qwen3": ("<|im_start|>assistant\n", "<|im_end|>"),
    "llama3_1_instruct": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "phi3_mini_instruct": ("<|assistant|>\n", "<|end|>"),
}
MARKERS = ("<|im_start|>", "<|start_header_id|>", "<|end_header_id|>", "<|assistant|>", "<|user|>", "<|system|>")


# ---------------------------------------------------------------------------------------------- fixture records
def _gsm8k_records(n_conv=4, per_conv=3):
    rows = []
    with open(fixture_path("data", "gsm8k_train.jsonl"), "rb") as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) >= n_conv * per_conv:
                break
    out = []
    for c in range(n_conv):
        msgs = [{"role": "system", "content": "You solve grade-school maths."}] if c % 2 else []
        for r in rows[c * per_conv:(c + 1) * per_conv]:
            msgs += [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]
        labels = [1 if m["role"] == "assistant" else 0 for m in msgs]
        if c == 0:  # the middle assistant answer is context only
            labels[[i for i, m in enumerate(msgs) if m["role"] == "assistant"][1]] = 0
        out.append({"messages": msgs, "labels": labels, "meta": {"uid": c, "category_id": 1}})
    return out


def _reason_tool_records(n=8):
    out = []
    with open(fixture_path("data", "llamafactory_reason_tool_use_demo_50.jsonl"), "rb") as f:
        for line in f:
            raw = json.loads(line)
            msgs = []
            for m in raw["messages"]:
                msg = {"role": m["role"], "content": ""}
                for part in m["content"]:
                    if part["type"] == "text":
                        msg["content"] += part["value"]
                    elif part["type"] == "reasoning":
                        msg["reasoning_content"] = part["value"]
                    elif part["type"] == "tool_call":
                        msg.setdefault("tool_calls", []).append(json.loads(part["value"]))
                msgs.append(msg)
            out.append({"messages": msgs, "tools": raw["tools"], "meta": {"uid": 100 + len(out), "category_id": 2}})
            if len(out) >= n:
                break
    return out


def _glaive_records(n=4):
    roles = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}
    data = json.loads(fixture_path("data", "llamafactory_glaive_toolcall_en_demo.json").read_text())
    out = []
    for raw in data:
        msgs = []
        for turn in raw["conversations"]:
            if turn["from"] == "function_call":
                msgs.append({"role": "assistant", "content": "", "tool_calls": [json.loads(turn["value"])]})
            else:
                msgs.append({"role": roles[turn["from"]], "content": turn["value"]})
        if not any(m.get("tool_calls") for m in msgs):
            continue
        out.append({"messages": msgs, "tools": raw["tools"], "meta": {"uid": 200 + len(out), "category_id": 3}})
        if len(out) >= n:
            break
    return out


def _jsonl_messages(name, n, uid0, cat):
    out = []
    with open(fixture_path("data", name), "rb") as f:
        for line in f:
            out.append({"messages": json.loads(line)["messages"], "meta": {"uid": uid0 + len(out), "category_id": cat}})
            if len(out) >= n:
                break
    return out


def _unicode_records():
    return [
        {"messages": [
            {"role": "system", "content": "Réponds en français, s'il te plaît. 🙂"},
            {"role": "user", "content": "Quelle est la capitale du Japon ? 日本の首都は？"},
            {"role": "assistant", "content": "  東京 (Tōkyō) 🗼 est la capitale.\n\n", "category_id": 5},
            {"role": "user", "content": "Write the word assistant and an emoji family 👨‍👩‍👧."},
            {"role": "assistant", "content": "assistant 👨‍👩‍👧 — e\u0301 ﬁ Ω≈ç√ \t end", "category_id": 6},
        ], "meta": {"uids": [300, 301], "category_id": 5}},
        {"messages": [
            {"role": "user", "content": "Say hi"},
            {"role": "assistant", "content": "\nhi\n"},
        ], "labels": [0, 1], "meta": {"uid": 302}, "enable_thinking": False},
    ]


def fixture_records():
    return (_gsm8k_records() + _reason_tool_records() + _glaive_records()
            + _jsonl_messages("skyt1_math500_longcot.messages.jsonl", 2, 400, 4)
            + _jsonl_messages("parallel_r1_gsm8k_sft_train.messages.jsonl", 2, 500, 4)
            + _unicode_records())


@pytest.fixture(scope="module")
def canonical_records():
    from data.records import validate_canonical

    return [validate_canonical(r, f"fixture:{i}") for i, r in enumerate(fixture_records())]


# ---------------------------------------------------------------------------------------------- checks
def reference_inputs(rec):
    """What the user would pass to apply_chat_template for this record (written out independently)."""
    kwargs = {}
    if rec.get("tools"):
        kwargs["tools"] = rec["tools"]
    if rec.get("enable_thinking") is not None:
        kwargs["enable_thinking"] = rec["enable_thinking"]
    return rec["messages"], kwargs


def check_turn_text(name, decoded, msg, other_texts, reasoning_rendered):
    """`decoded` (the masked tokens of one trained turn) must be that turn's text + end-of-turn, nothing else."""
    _, eot = TEMPLATES[name]
    decoded = unicodedata.normalize("NFC", decoded)  # Qwen's normalizer composes e + U+0301
    msg = {k: unicodedata.normalize("NFC", v) if isinstance(v, str) else v for k, v in msg.items()}
    assert decoded.endswith(eot), (name, decoded[-80:])
    body = decoded[: -len(eot)]
    assert eot not in body, (name, body[-200:])
    for marker in MARKERS:
        assert marker not in decoded, (name, marker, decoded[:200])
    for other in other_texts:
        assert other not in body, (name, other[:80])
    content = msg["content"].strip()
    if msg.get("tool_calls"):
        if name != "phi3_mini_instruct":  # Phi-3's template drops tool calls
            for call in msg["tool_calls"]:
                assert call["function"]["name"] in body
        if name != "llama3_1_instruct":  # Llama 3.1 renders only the call of a tool-call message
            assert content in body
        return
    if reasoning_rendered:
        assert body.startswith("<think>") and msg["reasoning_content"].strip() in body, body[:200]
        assert body.rstrip().endswith(content), body[-200:]
        return
    if name == "qwen3" and body.startswith("<think>"):  # empty think block of the final turns
        assert body.startswith("<think>\n\n</think>\n\n"), body[:40]
        body = body[len("<think>\n\n</think>\n\n"):]
    assert body.strip() == content, (name, body, content)


# what the conservation check rejects when the template is left to itself (data/fidelity.py)
TEMPLATE_DROPS = {"phi3_mini_instruct": {"template_drops_tools"},  # no tool calls, no tool messages
                  "llama3_1_instruct": {"template_drops_content"}}  # a tool-call turn renders only the call


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_ids_and_masks_match_template(name, canonical_records):
    """The template's own behaviour (reasoning: template, tool_arguments: keep): ids == apply_chat_template."""
    tok = load_chat_tokenizer(str(tokenizer_dir(name)))
    info = analyze_template(tok)
    assert (info.header, info.end_of_turn) == TEMPLATES[name]
    ctx = TokenizeContext(tokenizer=tok, info=info, max_length=10**6, reasoning="template", tool_arguments="keep")
    results = tokenize_records(canonical_records, ctx)
    n_checked = n_turns_checked = n_dropped = 0
    for rec, res in zip(canonical_records, results):
        messages, kwargs = reference_inputs(rec)
        try:
            ref = tok.apply_chat_template(messages, **kwargs)["input_ids"]
        except Exception:
            assert isinstance(res, RecordError) and res.reason == "template_error", res
            continue
        if isinstance(res, RecordError) and res.reason in TEMPLATE_DROPS.get(name, ()):
            assert any(m.get("tool_calls") or m["role"] == "tool" for m in messages), res
            n_dropped += 1
            continue
        assert not isinstance(res, RecordError), res
        n_checked += 1
        assert res.input_ids.tolist() == list(ref)
        assert np.all((res.labels == IGNORE_INDEX) | (res.labels == res.input_ids))
        assert np.array_equal(res.labels != IGNORE_INDEX, res.turn_ids > 0)
        text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
        trained = [i for i, m in enumerate(rec["messages"]) if rec["labels"][i]]
        # the fast char_to_token path equals "token start inside a trained span" computed from full offsets
        starts = np.array(tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"])[:, 0]
        spans = assistant_spans(text, info, sum(m["role"] == "assistant" for m in rec["messages"]))
        assistant_idx = [i for i, m in enumerate(rec["messages"]) if m["role"] == "assistant"]
        ref_mask = np.zeros(len(starts), dtype=bool)
        for (a, b), i in zip(spans, assistant_idx):
            if rec["labels"][i]:
                ref_mask |= (starts >= a) & (starts < b)
        assert np.array_equal(res.labels != IGNORE_INDEX, ref_mask)
        assert int(res.turn_ids.max()) == len(trained)
        others = [m["content"].strip() for i, m in enumerate(rec["messages"])
                  if i not in trained and len(m["content"].strip()) >= 12]
        for k, i in enumerate(trained, 1):
            pos = np.flatnonzero(res.turn_ids == k)
            assert pos.size and np.all(np.diff(pos) == 1), "a turn's loss tokens are contiguous"
            decoded = tok.decode(res.input_ids[pos].tolist())
            msg = rec["messages"][i]
            rendered_reasoning = bool(msg.get("reasoning_content")) and msg["reasoning_content"].strip() in text
            check_turn_text(name, decoded, msg, others, rendered_reasoning)
            assert np.all(res.category_ids[pos] == msg.get("category_id", rec["meta"].get("category_id", 0)))
            n_turns_checked += 1
    assert n_checked >= len(canonical_records) - 6 - n_dropped and n_checked >= 10 and n_turns_checked > 20
    assert (n_dropped >= 9) == (name == "phi3_mini_instruct")  # its tool records


def test_label_zero_turn_has_no_loss():
    tok = load_chat_tokenizer(str(tokenizer_dir("qwen2_5_instruct")))
    ctx = TokenizeContext(tokenizer=tok, info=analyze_template(tok), max_length=10**6)
    rec = _gsm8k_records(n_conv=1)[0]
    all_on = dict(rec, labels=[1 if m["role"] == "assistant" else 0 for m in rec["messages"]])
    res0, res1 = tokenize_records([rec, all_on], ctx)
    assert res0.input_ids.tolist() == res1.input_ids.tolist()
    middle = np.flatnonzero(res1.turn_ids == 2)
    assert middle.size > 10
    assert np.all(res0.labels[middle] == IGNORE_INDEX)
    assert res0.n_loss_tokens == res1.n_loss_tokens - middle.size
    assert int(res0.turn_ids.max()) == 2 and np.all(res0.turn_ids[middle] == 0)
