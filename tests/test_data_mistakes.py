"""Ordinary mistakes lose nothing silently: a mistyped ratio key, a max_length that empties categories, a huge
message, a broken chat template, --help, skipped lines by name, empty inputs, shipped configs that delete runs,
two runs into one output directory."""
from __future__ import annotations

import orjson
import pytest

from data import preprocess, sample
from data.config import DataConfig, InputSpec


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
