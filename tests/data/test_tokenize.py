"""Tokenize stage: run() end to end, error/overlong policies, structure mode, workers, gpt2 / template file."""
import json
from pathlib import Path

import numpy as np
import orjson
import pytest

from tests._data_helpers import tokenize_config_file, tokenize_record
from tests.conftest import fixture_path, tokenizer_dir
from tests.data.test_tokenize_templates import _gsm8k_records, check_turn_text, reference_inputs

from common.config import ConfigError
from data.chat_template import analyze_template, load_chat_tokenizer
from data import tokenize
from data.config import DataConfig
from data.executor import LocalExecutor
from data.records import RecordError
from data.report import check_arithmetic, read_report
from data.shards.dataset import PackedDataset, ShardWriter
from data.pipeline import cli_main
from data.tokenize import IGNORE_INDEX, TokenizeContext, run, tokenize_records

QWEN = "qwen2_5_instruct"


@pytest.fixture(scope="module")
def qwen():
    tok = load_chat_tokenizer(str(tokenizer_dir(QWEN)))
    return tok, analyze_template(tok)


def _ctx(qwen, **kw):
    tok, info = qwen
    return TokenizeContext(tokenizer=tok, info=info, **{"max_length": 10**6, **kw})


def _write_merged(out: Path, records, extra_lines=()):
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "merged.jsonl", "wb") as f:
        for r in records:
            f.write(orjson.dumps(r) + b"\n")
        for line in extra_lines:
            f.write(line + b"\n")


def _cfg(tmp: Path, **kw):
    return DataConfig(inputs=[], output_dir=str(tmp), tokenizer_path=str(tokenizer_dir(QWEN)), **kw)


def _many_records(n):
    recs = _gsm8k_records(n_conv=n, per_conv=2)
    for i, r in enumerate(recs):
        r["meta"] = {"uid": i, "category_id": 1 + i % 3, "category_name": f"cat{1 + i % 3}"}
    return recs


# ---------------------------------------------------------------------------------------------- run()
def test_run_writes_dataset_and_report(tmp_path, qwen):
    recs = _many_records(12)
    no_train = {"messages": recs[0]["messages"], "labels": [0] * len(recs[0]["messages"]),
                "meta": {"uid": 99, "category_id": 1}}
    _write_merged(tmp_path, recs[:5] + [no_train] + recs[5:], extra_lines=[b"{not json"])
    section = check_arithmetic(run(_cfg(tmp_path, on_error="skip"), LocalExecutor(1)))
    assert (section["in"], section["out"]) == (14, 12)
    assert section["dropped"] == {"malformed_json": 1, "no_trainable_token": 1}
    merged = tmp_path / "merged.jsonl"
    assert section["dropped_at"] == {"malformed_json": [f"{merged}:14"], "no_trainable_token": [f"{merged}:6"]}
    ds = PackedDataset(tmp_path / "tokenized")
    assert len(ds) == 12 and ds.meta["kind"] == "tokenized"
    assert ds.meta["template"] == {"header": "<|im_start|>assistant\n", "end_of_turn": "<|im_end|>"}
    tok, _ = qwen
    seq_index = ds.seq_index
    total_loss = 0
    for row, rec in enumerate(recs):
        messages, kwargs = reference_inputs(rec)
        item = ds[row]
        assert item["input_ids"].tolist() == tok.apply_chat_template(messages, **kwargs)["input_ids"]
        assert int(seq_index[row]["record_index"]) == (row if row < 5 else row + 1)  # line 6 was dropped
        assert ds.row_uids(row)[0].tolist() == [rec["meta"]["uid"]]
        total_loss += int(np.count_nonzero(item["labels"] != IGNORE_INDEX))
    assert section["loss_tokens"] == total_loss == int(ds.row_n_loss_tokens.sum())
    assert section["tokens"] == int(ds.row_n_tokens.sum())
    assert sum(c["tokens"] for c in section["categories"].values()) == section["tokens"]
    assert section["categories"]["2"]["name"] == "cat2"
    assert section["categories"]["1"]["before"] == section["categories"]["1"]["after"] + 1  # no_train: uid 99
    assert section["categories"]["0"] == {"before": 1, "after": 0, "tokens_before": 0, "loss_tokens_before": 0,
                                          "tokens": 0, "loss_tokens": 0, "dropped": {"malformed_json": 1},
                                          "name": "0"}
    assert ds.categories[2] == "cat2"


@pytest.mark.parametrize("workers", [1, 2])
def test_on_error_raises_with_source(tmp_path, workers):
    _write_merged(tmp_path, _many_records(2), extra_lines=[b'{"messages": [{"role": "robot", "content": "x"}]}'])
    with pytest.raises(RecordError) as err:
        run(_cfg(tmp_path), LocalExecutor(workers))
    assert err.value.reason == "unknown_role" and str(err.value).startswith(f"{tmp_path}/merged.jsonl:3: messages[0]")
    assert not (tmp_path / "tokenized").exists()
    if workers == 1:  # overlong=error raises even when other errors are skipped
        with pytest.raises(RecordError, match="max_length 64") as err:
            run(_cfg(tmp_path, on_error="skip", overlong="error", max_length=64), LocalExecutor(1))
        assert err.value.reason == "overlong"


def test_workers_output_byte_identical(tmp_path, monkeypatch):
    import data.tokenize as tk

    monkeypatch.setattr(tk, "RANGE_BYTES", 2000)  # several ranges in flight across the 2 workers
    monkeypatch.setattr(tk, "BATCH_RECORDS", 2)
    recs = _many_records(14)
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        _write_merged(out, recs, extra_lines=[b"[1, 2"])
        outs.append((out, run(_cfg(out, on_error="skip", num_workers=workers))))
    (a, sec_a), (b, sec_b) = outs
    assert sec_a.pop("dropped_at") == {"malformed_json": [f"{a}/merged.jsonl:15"]}
    assert sec_b.pop("dropped_at") == {"malformed_json": [f"{b}/merged.jsonl:15"]}  # the output_dir differs
    assert sec_a == sec_b
    files = sorted(p.name for p in (a / "tokenized").iterdir())
    assert files == sorted(p.name for p in (b / "tokenized").iterdir())
    for name in files:
        if name != "meta.json":
            assert (a / "tokenized" / name).read_bytes() == (b / "tokenized" / name).read_bytes(), name
    meta_a, meta_b = (json.loads((d / "tokenized" / "meta.json").read_bytes()) for d in (a, b))
    assert "num_workers" not in meta_a["config"] and "stages" not in meta_a["config"]
    # output_dir is the only legitimate difference between the two runs (and so the manifest's own checksum)
    meta_b["config"]["output_dir"] = meta_a["config"]["output_dir"]
    meta_b["manifest_blake2b"] = meta_a["manifest_blake2b"]
    assert meta_a == meta_b


@pytest.mark.parametrize("range_bytes", [1, 3000, 1 << 20])
def test_tokenized_is_the_bytes_of_one_writer_whatever_the_ranges_and_workers(tmp_path, monkeypatch, qwen,
                                                                              range_bytes):
    """The workers write each byte range's rows as a part and the parts are re-cut into tokenized/'s shards: the
    shards are those of one writer adding every kept row in file order (`add_row`), for ranges of one record to
    all of them, 1 to 3 workers, and shards (20 kB) that end inside parts, parts of several shards too."""
    import data.tokenize as tk

    real_init = ShardWriter.__init__

    def small_shards(self, *args, max_shard_bytes=1 << 30, **kwargs):
        real_init(self, *args, max_shard_bytes=min(max_shard_bytes, 20_000), **kwargs)

    monkeypatch.setattr(ShardWriter, "__init__", small_shards)  # forked workers inherit it
    monkeypatch.setattr(tk, "RANGE_BYTES", range_bytes)
    recs = _many_records(20)
    recs[3]["messages"][1]["role"] = "robot"  # dropped (on_error: skip): record indices skip it
    lines = [b"", b"[1, 2"]  # a blank line (not a record) and a malformed one
    ctx = _ctx(qwen, max_length=8192)
    kept = [res for res in tokenize_records(recs, ctx) if not isinstance(res, RecordError)]
    with ShardWriter(tmp_path / "one", token_fields=["input_ids", "labels", "category_ids", "turn_ids"],
                     kind="tokenized") as one:
        for res in kept:
            one.add_row([res.token_fields()], record_indices=[res.record_index], uids=[res.uids])
        expected = one.close()
    assert len(expected["shards"]) > 3
    sections = []
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        _write_merged(out, recs, extra_lines=lines)
        sections.append(run(_cfg(out, on_error="skip", max_length=8192), LocalExecutor(workers)))
        meta = json.loads((out / "tokenized" / "meta.json").read_bytes())
        for key in ("counts", "max_token_id", "shards"):
            assert meta[key] == expected[key], key
        for shard in expected["shards"]:
            for entry in shard["files"].values():
                assert (out / "tokenized" / entry["file"]).read_bytes() == (tmp_path / "one" / entry["file"]).read_bytes()
        assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "parts or temp dirs left behind"
    for section in sections:
        section.pop("dropped_at")  # names the output_dir
        assert section == sections[0]
    assert sections[0]["dropped"] == {"malformed_json": 1, "unknown_role": 1} and sections[0]["out"] == 19


def test_cli_writes_report(tmp_path, capsys):
    _write_merged(tmp_path, _many_records(3), extra_lines=[b"{oops"])
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_bytes(orjson.dumps({"inputs": [], "output_dir": str(tmp_path), "tokenizer_path": "nowhere",
                                       "stages": ["tokenize"]}))
    args = [str(cfg_path), f"tokenizer_path={tokenizer_dir(QWEN)}", "on_error=skip", "num_workers=1"]
    cli_main(run, "tokenize", args)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["category", "records", "in", "out", "tokens", "in", "out", "loss", "tokens", "in", "out"]
    assert out[-1].startswith("[tokenize] in=4 out=3 dropped={'malformed_json': 1}")
    report = json.loads((tmp_path / "report.json").read_bytes())
    assert report["tokenize"]["in"] == 4 and report["tokenize"]["dropped"] == {"malformed_json": 1}
    with pytest.raises(SystemExit) as exit_info:  # every record overlong: a clear error, not an empty dataset
        cli_main(run, "tokenize", args + ["max_length=64"])
    assert exit_info.value.code == 2
    assert "dropped {'malformed_json': 1, 'overlong': 3}" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- overlong policies
def test_overlong_policies(qwen):
    rec = _gsm8k_records(n_conv=1, per_conv=3)[0]
    rec["labels"] = [1 if m["role"] == "assistant" else 0 for m in rec["messages"]]
    full = tokenize_records([rec], _ctx(qwen))[0]
    n = full.input_ids.shape[0]
    turn_end = [int(np.flatnonzero(full.turn_ids == k)[-1]) + 1 for k in (1, 2, 3)]
    eot = qwen[0].convert_tokens_to_ids("<|im_end|>")
    limit = turn_end[1] + 5  # turn 2 fits, turn 3 does not
    assert n > limit

    def one(policy, max_length=limit):
        return tokenize_records([rec], _ctx(qwen, max_length=max_length, overlong=policy))[0]

    for policy in ("drop", "error"):
        res = one(policy)
        assert isinstance(res, RecordError) and res.reason == "overlong"
    cut = one("truncate")
    assert cut.truncated and cut.input_ids.shape[0] == turn_end[1]
    assert cut.input_ids[-1] == eot and cut.labels[-1] == eot and int(cut.turn_ids.max()) == 2
    assert np.array_equal(cut.labels, full.labels[: turn_end[1]])
    res = one("truncate", max_length=turn_end[0] - 1)  # not even the first turn fits
    assert isinstance(res, RecordError) and res.reason == "overlong"
    left = one("left")
    assert left.input_ids.tolist() == full.input_ids[-limit:].tolist()
    assert np.array_equal(left.labels, full.labels[-limit:])
    kept_turns = np.unique(left.turn_ids[left.turn_ids > 0])
    assert kept_turns.tolist() == list(range(1, kept_turns.size + 1))  # renumbered from 1 after the cut
    assert np.array_equal(left.turn_ids > 0, full.turn_ids[-limit:] > 0)
    # a left cut that lands inside a trained turn: the row's first token cannot be predicted, so it is not trained
    inside = int(np.flatnonzero(full.turn_ids == 3)[1])  # keep from the 2nd token of the last turn on
    mid = one("left", max_length=n - inside)
    assert full.labels[inside] != IGNORE_INDEX and mid.labels[0] == IGNORE_INDEX and mid.turn_ids[0] == 0
    assert np.array_equal(mid.labels[1:], full.labels[inside + 1:])
    assert mid.turn_ids.max() == 1 and mid.turn_ids[1] == 1
    from train.steps.batch import make_batch, step_totals

    row = {"input_ids": mid.input_ids, "labels": mid.labels, "category_ids": mid.category_ids,
           "turn_ids": mid.turn_ids, "seq_lens": np.array([mid.input_ids.shape[0]])}
    meta = {"row_n_loss_tokens": np.array([int((mid.labels != IGNORE_INDEX).sum())]),
            "row_n_trained_turns": np.array([1]), "row_n_samples": np.array([1])}
    assert float(make_batch([row], step_totals(meta, [0]), "turn").weights.sum()) == pytest.approx(1.0)
    right = one("right")
    assert right.input_ids.tolist() == full.input_ids[:limit].tolist() and right.input_ids.shape[0] == limit
    assert np.array_equal(right.turn_ids, full.turn_ids[:limit])
    # right-truncation inside the first prompt leaves nothing to train
    res = one("right", max_length=10)
    assert isinstance(res, RecordError) and res.reason == "no_trainable_token"
    within = one("drop", max_length=n)
    assert not isinstance(within, RecordError) and not within.truncated


def test_loss_turns_last(qwen):
    """Stepwise masks come from the labels the merge stage sets (per original record): only that turn is trained."""
    from data.merge import apply_loss_turns

    rec = _gsm8k_records(n_conv=1, per_conv=3)[0]
    rec["labels"] = [1 if m["role"] == "assistant" else 0 for m in rec["messages"]]
    full = tokenize_records([rec], _ctx(qwen))[0]
    stepwise = json.loads(json.dumps(rec))
    assert apply_loss_turns(stepwise, "last") == 2
    last = tokenize_records([stepwise], _ctx(qwen))[0]
    last_turn = full.turn_ids == full.turn_ids.max()
    assert int(full.turn_ids.max()) == 3 and int(last.turn_ids.max()) == 1
    assert np.array_equal(last.labels != IGNORE_INDEX, last_turn)


# ---------------------------------------------------------------------------------------------- structure mode
def test_structure_mode(qwen):
    rows = [json.loads(line) for line in open(fixture_path("data", "parallel_r1_gsm8k_sft_train.messages.jsonl"), "rb")]
    recs = [{"messages": rows[i]["messages"], "meta": {"uid": i}} for i in (0, 327)]  # row 327 has an unclosed tag
    skip = tokenize_records(recs, _ctx(qwen, structure="parallel_thinking", on_error="skip"))
    good, plain = skip
    assert good.block_ids.dtype == np.int16 and good.block_ids.max() >= 1 and good.path_ids.max() >= 2
    assert np.all(good.block_ids[good.labels == IGNORE_INDEX][:10] == 0)
    assert plain.structure_kept_plain and not plain.block_ids.any() and not plain.path_ids.any()
    assert plain.n_loss_tokens > 0
    err = tokenize_records(recs[1:], _ctx(qwen, structure="parallel_thinking", on_error="error"))[0]
    assert isinstance(err, RecordError) and err.reason == "structure"
    # a right cut inside the first path of the first block leaves a one-path block: not a valid structure
    cut = int(np.flatnonzero(good.path_ids == 1)[3]) + 1
    for on_error in ("skip", "error"):
        res = tokenize_records(recs[:1], _ctx(qwen, structure="parallel_thinking", on_error=on_error,
                                              max_length=cut, overlong="right"))[0]
        if on_error == "skip":
            assert res.truncated and res.structure_kept_plain and not res.block_ids.any()
        else:
            assert isinstance(res, RecordError) and res.reason == "structure" and "right truncation" in str(res)


# ---------------------------------------------------------------------------------------------- templates
def test_gpt2_without_template_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no chat template.*chat_template"):
        load_chat_tokenizer(str(tokenizer_dir("gpt2")))
    _write_merged(tmp_path, _many_records(1))
    cfg = DataConfig(inputs=[], output_dir=str(tmp_path), tokenizer_path=str(tokenizer_dir("gpt2")))
    with pytest.raises(ConfigError, match="no chat template"):
        run(cfg, LocalExecutor(1))


TEMPLATE = """{%- for m in messages -%}
{%- if m.role == 'assistant' -%}{{ '### Assistant:\\n' + m.content + '\\n### End\\n\\n' }}
{%- else -%}{{ '### ' + m.role + ':\\n' + m.content + '\\n\\n' }}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '### Assistant:\\n' }}{%- endif -%}"""


def test_chat_template_file_for_gpt2(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    tok = load_chat_tokenizer(str(tokenizer_dir("gpt2")), str(path))
    info = analyze_template(tok)
    assert (info.header, info.end_of_turn) == ("### Assistant:\n", "\n### End")
    recs = _many_records(3)
    results = tokenize_records(recs, TokenizeContext(tokenizer=tok, info=info, max_length=10**6))
    for rec, res in zip(recs, results):
        messages, kwargs = reference_inputs(rec)
        assert res.input_ids.tolist() == tok.apply_chat_template(messages, **kwargs)["input_ids"]
        trained = [i for i, lab in enumerate(rec["labels"]) if lab]
        for k, i in enumerate(trained, 1):
            decoded = tok.decode(res.input_ids[res.turn_ids == k].tolist())
            assert decoded == rec["messages"][i]["content"] + "\n### End"


def test_turn_check_can_fail():
    """The acceptance check rejects a mask that leaks the header, misses the marker or holds user text."""
    msg = {"role": "assistant", "content": "The answer is 4."}
    check_turn_text(QWEN, "The answer is 4.<|im_end|>", msg, ["What is 2+2? Please"], False)
    for bad in ("<|im_start|>assistant\nThe answer is 4.<|im_end|>", "The answer is 4.",
                "The answer is 4.<|im_end|>\n<|im_start|>user", "The answer is 4. What is 2+2? Please<|im_end|>",
                "answer is 4.<|im_end|>"):
        with pytest.raises(AssertionError):
            check_turn_text(QWEN, bad, msg, ["What is 2+2? Please"], False)


def test_template_inputs_pass_tools_and_thinking():
    from data.tokenize import template_inputs

    rec = {"messages": [{"role": "user", "content": "q", "category_id": 2}], "tools": [{"type": "function"}]}
    messages, kwargs = template_inputs(rec)
    assert messages == [{"role": "user", "content": "q"}] and kwargs == {"tools": rec["tools"]}
    assert template_inputs(rec, False)[1] == {"tools": rec["tools"], "enable_thinking": False}
    assert template_inputs(dict(rec, enable_thinking=True), False)[1]["enable_thinking"] is True  # record wins
    assert "enable_thinking" not in template_inputs({"messages": []}, None)[1]


def test_meta_records_the_tokenizer_path_resolved(tmp_path, monkeypatch):
    """A relative tokenizer_path is stored absolute: the trainer exports that tokenizer from any directory."""
    tok = tokenizer_dir(QWEN)
    monkeypatch.chdir(tok.parent)
    _write_merged(tmp_path, _many_records(2))
    run(DataConfig(inputs=[], output_dir=str(tmp_path), tokenizer_path=tok.name), LocalExecutor(1))
    stored = Path(PackedDataset(tmp_path / "tokenized").meta["tokenizer_path"])
    assert stored.is_absolute() and stored.resolve() == tok.resolve()  # however ../shared is mounted (a link or not)


# ---------------------------------------------------------------------------------------------- categories that lose their records
def test_a_category_that_loses_every_record_is_an_error_naming_it(tmp_path, capsys):
    records = [tokenize_record(i, "short", "Fine.") for i in range(4)] + [tokenize_record(4 + i, "long", "word " * 200)
                                                                  for i in range(3)]
    config = tokenize_config_file(tmp_path, records)
    with pytest.raises(SystemExit) as exit_:
        cli_main(tokenize.run, "tokenize", [str(config)])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert ("error: tokenize: category 'long' (id 2) lost all its 3 records (overlong 3): nothing of it would be "
            "trained (max_length 64") in captured.err
    assert "sample_rate to 0" in captured.err
    assert "\nlong " in captured.out  # the summary table names the emptied category
    assert not (tmp_path / "out" / "tokenized").exists()


def test_a_category_that_loses_more_than_the_threshold_warns_at_the_end_and_in_the_report(tmp_path, capsys):
    records = ([tokenize_record(i, "short", "Fine.") for i in range(4)] + [tokenize_record(4, "long", "Short enough.")]
               + [tokenize_record(5 + i, "long", "word " * 200) for i in range(3)])
    config = tokenize_config_file(tmp_path, records)
    cli_main(tokenize.run, "tokenize", [str(config)])
    warning = ("category 'long' (id 2) lost 3 of its 4 records (75%: overlong 3), more than category_loss_warning "
               "0.5")
    assert capsys.readouterr().err.splitlines()[-1] == f"WARNING: tokenize: {warning}"
    section = read_report(tmp_path / "out" / "report.json")["tokenize"]
    assert section["warnings"] == [warning]
    assert section["categories"]["2"]["dropped"] == {"overlong": 3}
    cli_main(tokenize.run, "tokenize", [str(config), "category_loss_warning=0.8"])
    assert "WARNING: tokenize" not in capsys.readouterr().err
