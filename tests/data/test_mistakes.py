"""Ordinary mistakes lose nothing silently: a mistyped ratio key, a max_length that empties categories, a huge
message, a broken chat template, --help, skipped lines by name, empty inputs, shipped configs that delete runs,
two runs into one output directory."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import tracemalloc
import types
from pathlib import Path

import orjson
import pytest
import yaml

from common.config import ConfigError, field_help
from common.lock import LOCK_NAME, LockHeldError, directory_lock
from data import pipeline, preprocess, sample, tokenize
from data.chat_template import analyze_template, load_chat_tokenizer
from data.config import DataConfig, InputSpec, MergeConfig, PackConfig
from data.pipeline import cli_main
from data.records import RecordError
from data.report import read_report
from data.token_bound import TokenBound
from data.tokenize import TokenizeContext, tokenize_records
from tests.conftest import ROOT, fixture_path, tokenizer_dir


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
    assert "WARNING: tokenize" not in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- 3: huge messages
@pytest.fixture(scope="module")
def qwen_ctx_args():
    tok = load_chat_tokenizer(str(tokenizer_dir("qwen2_5_instruct")))
    return tok, analyze_template(tok)


@pytest.mark.serial  # times the rejection
@pytest.mark.parametrize("role", ["user", "assistant"])
def test_a_multi_megabyte_message_is_rejected_as_overlong_without_encoding_it(qwen_ctx_args, role):
    tok, info = qwen_ctx_args
    big = "lorem ipsum dolor sit amet " * 400_000  # 10.8 MB: ~2.4M tokens, ~10 s and GBs to encode
    record = _record(0, "long", big if role == "assistant" else "ok")
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
    record = _record(0, "short", "word " * 50)
    [measured] = tokenize_records([record], TokenizeContext(tokenizer=tok, info=info, max_length=10**6))
    n = len(measured.input_ids)
    [fits] = tokenize_records([record], TokenizeContext(tokenizer=tok, info=info, max_length=n))  # exactly fits
    assert not isinstance(fits, RecordError) and len(fits.input_ids) == n


# ---------------------------------------------------------------------------------------------- 4: broken templates
@pytest.mark.parametrize("template, line, error", [
    ("{% for m in messages %}\n{{ m.role }}\n{{ m.content }\n{% endfor %}", 3, "TemplateSyntaxError"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}\n\n{{ raise_exception('not for this model') }}", 3,
     "TemplateError"),
])
def test_a_broken_chat_template_file_names_the_tokenizer_the_key_and_the_line(tmp_path, capsys, template, line,
                                                                                error):
    jinja = tmp_path / "broken.jinja"
    jinja.write_text(template)
    config = _tokenize_config(tmp_path, [_record(0, "short", "Fine.")], chat_template=str(jinja),
                              tokenizer_path=str(tokenizer_dir("gpt2")))
    with pytest.raises(SystemExit):
        pipeline.main([str(config), "--stages", "tokenize"])
    err = capsys.readouterr().err
    assert err.startswith(f"error: chat_template: {jinja} (tokenizer {tokenizer_dir('gpt2')}): cannot render a "
                          f"user/assistant exchange: {error} at template line {line}: ")
    assert "Traceback" not in err


def test_a_broken_template_of_the_tokenizer_names_its_file(tmp_path):
    tok_dir = tmp_path / "tok"
    shutil.copytree(tokenizer_dir("qwen2_5_instruct"), tok_dir)
    tok_config = orjson.loads((tok_dir / "tokenizer_config.json").read_bytes())
    tok_config["chat_template"] = "{{ bos_token }}\n{% if messages %}{{ messages[0].content | nosuchfilter }}{% endif %}"
    (tok_dir / "tokenizer_config.json").write_bytes(orjson.dumps(tok_config))
    with pytest.raises(ConfigError, match=rf"tokenizer_path: {tok_dir}: the chat template of tokenizer_config.json: "
                                          r"cannot render a user/assistant exchange: TemplateRuntimeError at "
                                          r"template line 2: .*nosuchfilter"):
        load_chat_tokenizer(str(tok_dir))


# ---------------------------------------------------------------------------------------------- 5: --help
def test_data_process_help_lists_every_key_with_type_default_and_help():
    proc = subprocess.run(["sh", str(ROOT / "data_process.sh"), "--help"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for cls, prefix in ((DataConfig, ""), (MergeConfig, "merge."), (PackConfig, "pack."), (InputSpec, "")):
        helps = field_help(cls)
        for f in dataclasses.fields(cls):
            if f.name in ("merge", "pack"):
                continue
            assert helps[f.name], f"{prefix}{f.name} has no help comment in data/config.py"
            [i] = [i for i, line in enumerate(lines) if line.startswith(f"  {prefix}{f.name} (")]
            assert ", default " in lines[i] and lines[i + 1].strip() == helps[f.name]
    assert "  category_loss_warning (float, default 0.5)" in lines
    assert '  reasoning_tags (list[str], default ["<think>\\n","\\n</think>\\n\\n"])' in lines


# ---------------------------------------------------------------------------------------------- 8: shipped configs
def test_no_shipped_train_config_deletes_an_earlier_run():
    configs = sorted((ROOT / "configs" / "train").glob("*.yaml"))
    assert configs
    for path in configs:
        raw = yaml.safe_load(path.read_text()) or {}
        assert raw.get("overwrite_output_dir", False) is False, f"{path.name} deletes the previous run's checkpoints"


# ---------------------------------------------------------------------------------------------- 7: empty inputs
def _preprocess_config(tmp_path, paths):
    path = tmp_path / "config.json"
    path.write_bytes(orjson.dumps({"inputs": [{"path": p, "category_name": "chat"} for p in paths],
                                   "output_dir": str(tmp_path / "out"), "tokenizer_path": "unused", "num_workers": 1}))
    return str(path)


@pytest.mark.parametrize("empty_bytes", [b"", b"\n\n  \n"])
def test_an_empty_input_next_to_others_is_a_counted_warning(tmp_path, capsys, empty_bytes):
    full = _jsonl(tmp_path / "full.jsonl", [QA] * 3)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(empty_bytes)
    cli_main(preprocess.run, "preprocess", [_preprocess_config(tmp_path, [full, str(empty)])])
    assert capsys.readouterr().err.splitlines()[-1] == f"WARNING: preprocess: input {empty} is empty (no row)"
    section = read_report(tmp_path / "out" / "report.json")["preprocess"]
    assert section["empty_inputs"] == [str(empty)] and section["out"] == 3


def test_an_empty_only_input_is_an_error_naming_it(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(SystemExit):
        cli_main(preprocess.run, "preprocess", [_preprocess_config(tmp_path, [str(empty)])])
    assert capsys.readouterr().err == f"error: preprocess: every input is empty (no row): {empty}\n"


# ---------------------------------------------------------------------------------------------- 9: one run per output dir
def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_a_second_run_into_a_locked_output_dir_is_refused_naming_the_holder(tmp_path, capsys, monkeypatch):
    calls = []
    fake = types.ModuleType("data.pack")
    fake.run = lambda cfg, executor=None: calls.append("pack") or {"in": 0, "out": 0, "dropped": {}}
    monkeypatch.setitem(sys.modules, "data.pack", fake)
    config = _preprocess_config(tmp_path, [])
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from common.lock import directory_lock
with directory_lock({str(tmp_path / 'out')!r}):
    print("locked", flush=True)
    time.sleep(60)
"""], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(SystemExit) as exit_:
            pipeline.main([config, "--stages", "pack"])
        assert exit_.value.code == 2 and calls == []
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / 'out'} is in use by another run (pid {holder.pid} on "
                              f"{socket.gethostname()}, started ")
    finally:
        holder.kill()
        holder.wait()
    pipeline.main([config, "--stages", "pack"])  # the holder is gone: its lock is taken over
    assert calls == ["pack"]
    assert "[lock] took over" in capsys.readouterr().out
    assert not (tmp_path / "out" / LOCK_NAME).exists()  # released at the end


@pytest.mark.parametrize("stale", ["dead pid", "reused pid", "torn file"])
def test_a_lock_whose_holder_is_gone_is_taken_over_and_said_so(tmp_path, capsys, stale):
    lock = tmp_path / LOCK_NAME
    holder = {"pid": _dead_pid(), "host": socket.gethostname(), "start": "x", "started": "then", "command": "old"}
    if stale == "reused pid":  # a live process with the holder's pid, started at another time
        holder.update(pid=os.getpid(), start="another boot:1")
    lock.write_text("{" if stale == "torn file" else json.dumps(holder))
    with directory_lock(tmp_path) as path:
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert f"[lock] took over {lock}" in capsys.readouterr().out
    assert not lock.exists()


def test_a_live_holder_on_this_host_or_a_lock_of_another_host_is_kept(tmp_path):
    with directory_lock(tmp_path):
        with pytest.raises(LockHeldError, match=rf"pid {os.getpid()} on {socket.gethostname()}"):
            with directory_lock(tmp_path):
                pass
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": _dead_pid(), "host": "elsewhere", "started": "then"}))
    with pytest.raises(LockHeldError, match=r"on elsewhere, started then.*if that run is gone, delete"):
        with directory_lock(tmp_path):
            pass


# ---------------------------------------------------------------------------------------------- edited ratio file
def test_later_stages_warn_when_the_ratio_file_changed_after_sampling(tmp_path, capsys):
    """Editing the ratio file, then running merge (or tokenize, pack) without sample would pack the old sample:
    a warning at the start and again at the end names the file and the stages to re-run."""
    cfg = _cfg(tmp_path, [InputSpec(path=[_jsonl(tmp_path / "c.jsonl", [QA] * 4)], category_name="chat")],
               stages=["preprocess", "sample"])
    pipeline.run_pipeline(cfg)
    assert pipeline.stale_input_warnings(dataclasses.replace(cfg, stages=["merge"])) == []
    ratios = orjson.loads(cfg.ratio_file.read_bytes())
    ratios["categories"][0]["sample_rate"] = 0.5
    cfg.ratio_file.write_bytes(orjson.dumps(ratios))
    (warning,) = pipeline.stale_input_warnings(dataclasses.replace(cfg, stages=["merge", "tokenize"]))
    assert f"the ratio file {cfg.ratio_file} changed after the sample stage ran" in warning
    assert "--stages sample,merge,tokenize" in warning
    assert pipeline.stale_input_warnings(dataclasses.replace(cfg, stages=["sample", "merge"])) == []
    sections = pipeline.run_pipeline(dataclasses.replace(cfg, stages=["merge"], merge=MergeConfig(probability=0.0)))
    assert sections["inputs"]["warnings"] == [warning.replace("merge, tokenize", "merge").replace(
        "sample,merge,tokenize", "sample,merge")]
    pipeline.print_warnings(sections)
    assert "WARNING: inputs: the ratio file" in capsys.readouterr().err
