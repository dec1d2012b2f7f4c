"""`stepwise` in the data config and the tokenize core: off leaves meta.json's config as it was; combinations that
cannot hold are refused with the key and what would work; the expansion of one record (`stepwise_records`); trees
hold exactly the kept samples, are cut between steps at their capacity, and an over-long step follows `overlong` as
in `samples` (Qwen3 tokenizer, records whose second user query makes the template drop earlier reasoning)."""
from __future__ import annotations

import pytest

from common.config import ConfigError, from_dict
from data.config import DataConfig, output_config
from data.records import RecordError
from data.tokenize import stepwise_records


def cfg(**kw) -> DataConfig:
    return from_dict(DataConfig, {"inputs": [], "output_dir": "out", "tokenizer_path": "tok", "stages": ["merge"],
                                  **kw})


def test_off_keeps_the_stored_config_and_the_modes_are_recorded():
    assert "stepwise" not in output_config(cfg())
    assert output_config(cfg(stepwise="tree"))["stepwise"] == "tree"


@pytest.mark.parametrize("kw, message", [
    ({"stepwise": "tree", "merge": {"probability": 0.5}}, "set merge.probability to 0"),
    ({"stepwise": "tree", "structure": "parallel_thinking"}, "use stepwise: samples"),
])
def test_impossible_combinations_are_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        cfg(**kw).validate()


def test_a_record_expands_into_one_step_per_trained_assistant_turn():
    record = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
                           {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
                           {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
                           {"role": "user", "content": "q3"}, {"role": "assistant", "content": "a3"},
                           {"role": "user", "content": "trailing"}],
              "labels": [0, 0, 1, 0, 0, 0, 1, 0], "meta": {"uid": 3}}
    steps = stepwise_records(record, "x.jsonl:1")
    assert [len(s["messages"]) for s in steps] == [3, 7]  # turn 2 (label 0) is not a step of its own
    assert [s["labels"] for s in steps] == [[0, 0, 1], [0, 0, 0, 0, 0, 0, 1]]
    assert steps[1]["messages"][2]["reasoning_content"] == "r1"  # the template decides what it renders
    assert stepwise_records({"messages": "bad"}, "x") == [{"messages": "bad"}]  # the tokenize path rejects it
    merged = dict(record, meta={"uids": [1, 2], "parts": [{"start": 0}, {"start": 3}]})
    (refused,) = stepwise_records(merged, "x.jsonl:2")
    assert isinstance(refused, RecordError) and refused.reason == "stepwise"


# ---------------------------------------------------------------------------------------------- tokenize core
@pytest.fixture(scope="module")
def qwen3():
    from data.chat_template import analyze_template, load_chat_tokenizer
    from tests.conftest import tokenizer_dir

    tok = load_chat_tokenizer(str(tokenizer_dir("qwen3")))
    return tok, analyze_template(tok)


def _record(uid: int) -> dict:
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    text = lambda n, k: " ".join(words[(k + i) % len(words)] for i in range(n))  # noqa: E731
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": text(30, uid)},
                {"role": "assistant", "content": text(20, 1), "reasoning_content": text(40, 2)},
                {"role": "user", "content": text(25, 3)},  # a second query: Qwen3 drops the reasoning above
                {"role": "assistant", "content": "", "reasoning_content": text(30, 4),
                 "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}]},
                {"role": "tool", "content": text(35, 5)},
                {"role": "assistant", "content": text(15, 6), "reasoning_content": text(45, 7)}]
    return {"messages": messages, "labels": [int(m["role"] == "assistant") for m in messages],
            "meta": {"uid": uid, "category_id": 1, "category_name": "agent"}}


def _run(qwen3, mode: str, **kw):
    from data.tokenize import TokenizeContext, TokenizedSequence, tokenize_records

    tok, info = qwen3
    ctx = TokenizeContext(tokenizer=tok, info=info, stepwise=mode, **{"max_length": 10**6, **kw})
    results = tokenize_records([_record(0), _record(1)], ctx)
    kept = [r for r in results if isinstance(r, TokenizedSequence)]
    return kept, [r for r in results if not isinstance(r, TokenizedSequence)]


def test_trees_hold_the_kept_samples_and_are_cut_between_steps(qwen3):
    samples, _ = _run(qwen3, "samples")
    assert len(samples) == 6
    longest = max(len(s.input_ids) for s in samples)
    whole, _ = _run(qwen3, "tree")
    assert len(whole) == 2 and all(len(t.samples) == 3 for t in whole)
    cap = max(len(t.input_ids) for t in whole) - 1  # one tree per record does not fit; every step does
    assert cap >= longest
    cut, _ = _run(qwen3, "tree", tree_max_length=cap)
    assert len(cut) > 2 and all(len(t.input_ids) <= cap for t in cut)
    for trees in (whole, cut):
        held = [s for t in trees for s in t.samples]
        assert [s.input_ids.tolist() for s in held] == [s.input_ids.tolist() for s in samples]
        assert sum(int((t.labels != -100).sum()) for t in trees) == sum(s.n_loss_tokens for s in samples)


def test_an_overlong_step_follows_overlong_in_both_modes(qwen3):
    samples, _ = _run(qwen3, "samples")
    lengths = sorted(len(s.input_ids) for s in samples)
    limit = lengths[-1] - 1  # the longest steps are over-long, the others fit
    n_over = sum(n > limit for n in lengths)
    kept, dropped = _run(qwen3, "samples", max_length=limit)
    trees, tree_dropped = _run(qwen3, "tree", max_length=limit)
    assert [d.reason for d in dropped] == [d.reason for d in tree_dropped] == ["overlong"] * n_over
    held = [s for t in trees for s in t.samples]
    assert [s.input_ids.tolist() for s in held] == [s.input_ids.tolist() for s in kept]
    assert len(kept) == 6 - n_over and all(len(t.input_ids) <= limit for t in trees)
