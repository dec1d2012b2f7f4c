"""The token bound of tokenize (data/token_bound.py): a message far over max_length is rejected as overlong without
being encoded, the bound never exceeds the real token count of any tokenizer, and truncating policies and records
that fit are not bounded."""
from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import pytest

from data import tokenize
from data.chat_template import analyze_template, load_chat_tokenizer
from data.config import DataConfig
from data.records import RecordError
from data.token_bound import TokenBound
from data.tokenize import TokenizeContext, tokenize_records
from tests._data_helpers import tokenize_record
from tests.conftest import fixture_path, tokenizer_dir


def _cfg(tmp_path, inputs, **kw) -> DataConfig:
    return DataConfig(inputs=inputs, output_dir=str(tmp_path / "out"), tokenizer_path="unused", num_workers=1, **kw)


@pytest.fixture(scope="module")
def qwen_ctx_args():
    tok = load_chat_tokenizer(str(tokenizer_dir("qwen2_5_instruct")))
    return tok, analyze_template(tok)


@pytest.mark.serial  # times the rejection
@pytest.mark.parametrize("role", ["user", "assistant"])
def test_a_multi_megabyte_message_is_rejected_as_overlong_without_encoding_it(qwen_ctx_args, role):
    tok, info = qwen_ctx_args
    big = "lorem ipsum dolor sit amet " * 400_000  # 10.8 MB: ~2.4M tokens, ~10 s and GBs to encode
    record = tokenize_record(0, "long", big if role == "assistant" else "ok")
    record["messages"][0]["content"] = big if role == "user" else "Tell me."
    ctx = TokenizeContext(tokenizer=tok, info=info, max_length=4096)
    tracemalloc.start()
    start = time.perf_counter()
    [result] = tokenize_records([record], ctx)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 2.0 and peak < 4 * len(big)  # encoding it: ~10 s and GBs
    assert isinstance(result, RecordError) and result.reason == "overlong"
    assert "> max_length 4096" in str(result) and "not encoded" in str(result)
    tally = tokenize.TokenizeTally()
    tally.add_results([result], writer=None, cfg=_cfg(tmp_path=Path("."), inputs=[]))
    assert tally.dropped == {"overlong": 1}
    with pytest.raises(RecordError, match="max_length 4096"):  # overlong: error still stops the run
        tally.add_results([result], writer=None, cfg=_cfg(tmp_path=Path("."), inputs=[], overlong="error"))


@pytest.mark.parametrize("name", ["qwen2_5_instruct", "qwen3", "llama3_1_instruct", "phi3_mini_instruct"])
def test_the_token_bound_never_exceeds_the_real_count(name):
    tok = load_chat_tokenizer(str(tokenizer_dir(name)))
    bound = TokenBound.of(tok)
    assert bound is not None
    texts = [line.decode() for line in fixture_path("data", "skyt1_math500_longcot.messages.jsonl").read_bytes()
             .splitlines()[:20]]
    texts += ["  \n\t" * 500, "é" * 3000, "e\u0301" * 3000, "가" * 2000, "\u1100\u1161\u11a8" * 1000, "🙂" * 2000,
              " " * 10000, "<|im_end|>" * 300, "a" * 50000]
    for text in texts:
        n = len(tok.backend_tokenizer.encode(text, add_special_tokens=False).ids)
        assert bound.text_tokens(text) <= n
        assert bound.piece_tokens(text) <= n


def test_truncating_policies_and_fitting_records_are_not_bounded(qwen_ctx_args):
    tok, info = qwen_ctx_args
    assert TokenizeContext(tokenizer=tok, info=info, max_length=64, overlong="left").token_bound is None
    record = tokenize_record(0, "short", "word " * 50)
    [measured] = tokenize_records([record], TokenizeContext(tokenizer=tok, info=info, max_length=10**6))
    n = len(measured.input_ids)
    [fits] = tokenize_records([record], TokenizeContext(tokenizer=tok, info=info, max_length=n))  # exactly fits
    assert not isinstance(fits, RecordError) and len(fits.input_ids) == n
