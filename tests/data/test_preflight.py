"""The data pipeline's start-up checks (data/preflight.py), before any stage runs: a max_length the chat template
alone fills is refused, and stages refuse the outputs of another tokenizer, naming the command that re-runs them."""
from __future__ import annotations

import orjson
import pytest

from data import pipeline
from tests._data_helpers import copy_run, example_config
from tests.conftest import ROOT


def test_max_length_below_the_template_overhead_is_refused_before_any_stage(tmp_path, capsys):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "data/example/tokenizer")
    text = tokenizer.apply_chat_template([{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
                                         tokenize=False)
    overhead = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert overhead > 5
    config = example_config(tmp_path, max_length=overhead, overlong="left")
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main([str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: max_length={overhead} leaves no room for a conversation: the chat template of "
                   f"{ROOT / 'data/example/tokenizer'} alone takes {overhead} tokens (an empty user and assistant "
                   f"turn); set max_length above {overhead}")
    assert not (tmp_path / "out").exists()  # no stage ran
    pipeline.load(*pipeline.parse_args([str(example_config(tmp_path, max_length=overhead + 1))], "x"), None)


def test_stages_refuse_the_output_of_another_tokenizer(example_run, tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.chdir(ROOT)  # the command the error suggests names data_process.sh from here
    config, out = copy_run(example_run, tmp_path)
    other = tmp_path / "other_tokenizer"
    shutil.copytree(ROOT / "data/example/tokenizer", other)
    config_json = orjson.loads(config.read_bytes())
    original = config_json["tokenizer_path"]
    (other / "tokenizer_config.json").write_bytes((other / "tokenizer_config.json").read_bytes() + b"\n")
    packed_meta = (out / "packed" / "meta.json").read_bytes()
    for stages, made, rerun in (("pack", out / "tokenized", "tokenize,pack"),
                                ("tokenize,pack", out / "merged.jsonl", "merge,tokenize,pack")):
        with pytest.raises(SystemExit):
            pipeline.main([str(config), "--stages", stages, f"tokenizer_path={other}"])
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: tokenizer_path: {made}") and f"from {original}) than the config's {other}" in err
        assert err.endswith(f"re-run from that stage with this tokenizer (sh data_process.sh {config} --stages "
                            f"{rerun} tokenizer_path={other}), or set tokenizer_path/chat_template back")
    assert (out / "packed" / "meta.json").read_bytes() == packed_meta  # nothing ran
    pipeline.main([str(config), "--stages", "merge,tokenize,pack", f"tokenizer_path={other}"])  # the way out
    assert orjson.loads((out / "packed" / "meta.json").read_bytes())["tokenizer_path"] == str(other)
