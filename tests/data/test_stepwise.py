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


# ------------------------------------------------------------------------- ShareGPT with Llama 3.1, agent trajectories
def _sharegpt_records() -> list[dict]:
    import orjson

    from data.config import InputSpec
    from data.preprocess import convert_sharegpt
    from tests.conftest import fixture_path

    path = fixture_path("data", "fastchat_dummy_conversation.json")
    spec = InputSpec(path=[str(path)], format="sharegpt")
    out = []
    for i, raw in enumerate(orjson.loads(path.read_bytes())):
        rec = convert_sharegpt(raw, spec, f"{path}:{i}")
        if sum(m["role"] == "assistant" for m in rec["messages"]) >= 2:
            rec.setdefault("labels", [int(m["role"] == "assistant") for m in rec["messages"]])
            rec["meta"] = {"uid": i, "category_id": 1, "category_name": "sharegpt"}
            out.append(rec)
        if len(out) == 4:
            return out
    return out


def _agent_records() -> list[dict]:
    """Two trajectories of 10-12 steps (reasoning + tool call, tool result) behind a ~2K-token tools prompt."""
    from benchmarks.bench_stepwise import agent_records

    return agent_records(2, seed=0, steps=(10, 12))


@pytest.mark.parametrize("tokenizer, records", [("llama3_1_instruct", _sharegpt_records),
                                                ("qwen3", _agent_records)])
def test_samples_are_template_renders_and_trees_train_them(tokenizer, records):
    from data.chat_template import analyze_template, load_chat_tokenizer
    from data.shards.prefix_tree import tree_positions
    from data.tokenize import TokenizeContext, stepwise_records, template_inputs, tokenize_records
    from tests.conftest import tokenizer_dir
    from tests.shards.test_prefix_tree import paths, trained_pairs_of_samples, trained_pairs_of_tree

    tok = load_chat_tokenizer(str(tokenizer_dir(tokenizer)))
    info = analyze_template(tok)
    recs = records()
    assert len(recs) >= 2
    samples = tokenize_records(recs, TokenizeContext(tokenizer=tok, info=info, max_length=10**6, stepwise="samples"))
    trees = tokenize_records(recs, TokenizeContext(tokenizer=tok, info=info, max_length=10**6, stepwise="tree"))
    steps = [step for rec in recs for step in stepwise_records(rec, "test")]
    assert len(samples) == len(steps) and len(trees) == len(recs)
    for seq, step in zip(samples, steps):  # sequence k: the template's own rendering of the messages up to turn k
        messages, kwargs = template_inputs(step)
        assert seq.input_ids.tolist() == list(tok.apply_chat_template(messages, tokenize=True, **kwargs)["input_ids"])
    k = 0
    for tree in trees:
        mine = [s.token_fields() for s in samples[k:k + len(tree.samples)]]
        k += len(tree.samples)
        arrays = tree.token_fields()
        got = sorted(tuple(arrays["input_ids"][p].tolist()) for p in paths(arrays))
        assert got == sorted(tuple(s["input_ids"].tolist()) for s in mine)
        depth = tree_positions(arrays["tree_spans"])
        assert all(depth[p].tolist() == list(range(len(p))) for p in paths(arrays))
        assert trained_pairs_of_tree(arrays) == trained_pairs_of_samples(mine)
    if tokenizer == "qwen3":  # 10+ steps behind a long tools prompt: the trees store >= 3x fewer tokens
        assert sum(len(s.input_ids) for s in samples) >= 3 * sum(len(t.input_ids) for t in trees)


@pytest.mark.parametrize("mode", ["samples", "tree"])
def test_the_pipelines_console_says_what_the_trees_save(tmp_path, capsys, monkeypatch, mode):
    """`sh data_process.sh` with stepwise: the tokenize summary says how many samples the records gave and, for
    trees, the tokens stored against storing every sample, as report.json counts them. Before: report.json only."""
    import orjson

    from data import pipeline
    from data.report import read_report
    from tests.conftest import tokenizer_dir

    raw = tmp_path / "agent.jsonl"
    raw.write_bytes(b"".join(orjson.dumps({k: v for k, v in _record(uid).items() if k != "meta"}) + b"\n"
                             for uid in range(4)))
    config = tmp_path / "c.json"
    config.write_bytes(orjson.dumps({"inputs": [{"path": str(raw), "category_name": "agent"}],
                                     "output_dir": str(tmp_path / "out"), "num_workers": 1, "max_length": 4096,
                                     "tokenizer_path": str(tokenizer_dir("qwen3")), "stepwise": mode}))
    monkeypatch.chdir(tmp_path)
    pipeline.main([str(config), "--stages", "preprocess,sample,merge,tokenize"])
    out = capsys.readouterr().out
    step = read_report(tmp_path / "out" / "report.json")["tokenize"]["stepwise"]
    assert step["records"] == 4 and step["samples"] == 12
    head = f"stepwise ({mode}): 4 records -> 12 samples (12 kept)"
    if mode == "samples":
        assert f"{head}, {step['sample_tokens']:,} tokens stored\n" in out
        return
    assert 0 < step["tokens_saved"] == step["sample_tokens"] - step["tokens_stored"]
    assert (f"{head} in 4 prefix trees: {step['tokens_stored']:,} tokens stored, {step['sample_tokens']:,} as samples "
            f"would store; {step['tokens_saved']:,} saved ({step['tokens_saved'] / step['sample_tokens']:.1%})\n") in out
