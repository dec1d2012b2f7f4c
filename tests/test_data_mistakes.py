"""Ordinary mistakes lose nothing silently: a mistyped ratio key, a max_length that empties categories, a huge
message, a broken chat template, --help, skipped lines by name, empty inputs, shipped configs that delete runs,
two runs into one output directory."""
from __future__ import annotations

import orjson
import pytest

from data import preprocess, sample, tokenize
from data.config import DataConfig, InputSpec
from data.pipeline import cli_main
from data.report import read_report
from tests.conftest import tokenizer_dir


def _jsonl(path, rows):
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return str(path)


def _cfg(tmp_path, inputs, **kw) -> DataConfig:
    return DataConfig(inputs=inputs, output_dir=str(tmp_path / "out"), tokenizer_path="unused", num_workers=1, **kw)


QA = {"question": "q", "answer": "a"}


# ---------------------------------------------------------------------------------------------- 1: ratio-file keys
@pytest.mark.parametrize("typo", ["sample_rat", "sample_rate "])
def test_a_mistyped_ratio_key_is_an_error_naming_the_entry_and_the_closest_key(tmp_path, typo):
    cfg = _cfg(tmp_path, [InputSpec(path=[_jsonl(tmp_path / "c.jsonl", [QA] * 4)], category_name="chat")])
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


# ---------------------------------------------------------------------------------------------- 2: emptied categories
def _record(uid, category, answer):
    return {"messages": [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": answer}],
            "meta": {"uid": uid, "category_id": 1 if category == "short" else 2, "category_name": category}}


def _tokenize_config(tmp_path, records, **extra):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    _jsonl(out / "merged.jsonl", records)
    path = tmp_path / "config.json"
    path.write_bytes(orjson.dumps({"inputs": [], "output_dir": str(out), "num_workers": 1, "max_length": 64,
                                   "tokenizer_path": str(tokenizer_dir("qwen2_5_instruct")), **extra}))
    return path


def test_a_category_that_loses_every_record_is_an_error_naming_it(tmp_path, capsys):
    records = [_record(i, "short", "Fine.") for i in range(4)] + [_record(4 + i, "long", "word " * 200)
                                                                  for i in range(3)]
    config = _tokenize_config(tmp_path, records)
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
    records = ([_record(i, "short", "Fine.") for i in range(4)] + [_record(4, "long", "Short enough.")]
               + [_record(5 + i, "long", "word " * 200) for i in range(3)])
    config = _tokenize_config(tmp_path, records)
    cli_main(tokenize.run, "tokenize", [str(config)])
    warning = ("category 'long' (id 2) lost 3 of its 4 records (75%: overlong 3), more than category_loss_warning "
               "0.5")
    assert capsys.readouterr().err.splitlines()[-1] == f"WARNING: tokenize: {warning}"
    section = read_report(tmp_path / "out" / "report.json")["tokenize"]
    assert section["warnings"] == [warning]
    assert section["categories"]["2"]["dropped"] == {"overlong": 3}
    cli_main(tokenize.run, "tokenize", [str(config), "category_loss_warning=0.8"])
    assert "WARNING" not in capsys.readouterr().err
