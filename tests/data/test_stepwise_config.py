"""`stepwise` in the data config: off leaves meta.json's config as it was; combinations that cannot hold are refused
with the key and what would work; the expansion of one record (data/tokenize.py `stepwise_records`)."""
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
