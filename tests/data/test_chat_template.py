"""Chat templates (data/chat_template.py): a built-in template by name for a tokenizer without one (an unknown name
names the built-in ones), a broken template names the tokenizer, the key and the line, and a template that loops is
stopped by render_timeout, naming the template and the record (or refused before any stage when it loops on every
conversation)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import orjson
import pytest

from common.config import ConfigError
from data import pipeline
from data.chat_template import load_chat_tokenizer
from data.shards.chat_templates import BUILTIN_TEMPLATES, chat_template_hash, data_chat_template
from tests._data_helpers import CHAT_QA, data_config_file, tokenize_config_file, tokenize_record, write_jsonl
from tests.conftest import ROOT, tokenizer_dir


def test_the_example_packs_with_gpt2_and_template_qwen(tmp_path):
    """The user's command with a tokenizer without a template and `chat_template=qwen`: every record tokenizes
    (the tokenize stage checks each trained turn's content and tool calls against its loss span), and the shards
    record the name and the template's hash."""
    pipeline.main([str(ROOT / "configs/data/example.json"), f"output_dir={tmp_path / 'out'}",
                   f"tokenizer_path={tokenizer_dir('gpt2')}", "chat_template=qwen", "merge.probability=0",
                   "inputs=" + orjson.dumps([{**spec, "path": str(ROOT / spec["path"])} for spec in orjson.loads(
                       (ROOT / "configs/data/example.json").read_bytes())["inputs"]]).decode()])
    report = orjson.loads((tmp_path / "out" / "report.json").read_bytes())
    assert report["tokenize"]["in"] == report["tokenize"]["out"] == 410 and not report["tokenize"].get("dropped")
    meta = orjson.loads((tmp_path / "out" / "packed" / "meta.json").read_bytes())
    assert meta["chat_template"] == "qwen" and meta["chat_template_hash"] == chat_template_hash("qwen")
    assert meta["template"] == {"header": "<|im_start|>assistant\n", "end_of_turn": "<|im_end|>"}
    # the trainer exports this template with final/
    assert data_chat_template(meta) == BUILTIN_TEMPLATES["qwen"]


def test_an_unknown_template_name_names_the_builtin_ones(tmp_path):
    from data.config import load_config

    cfg = load_config(ROOT / "configs/data/example.json", [f"output_dir={tmp_path}", "chat_template=qwen9"])
    with pytest.raises(ConfigError, match=r"chat_template: qwen9 is neither a file .*nor a built-in template name "
                                          r"\(chatml, llama3, phi3, qwen\)"):
        cfg.validate()
    with pytest.raises(ConfigError, match=r"has no chat template; set chat_template to the model family's built-in "
                                          r"template \(chatml, llama3, phi3, qwen\)"):
        load_chat_tokenizer(str(tokenizer_dir("gpt2")))


@pytest.mark.parametrize("template, line, error", [
    ("{% for m in messages %}\n{{ m.role }}\n{{ m.content }\n{% endfor %}", 3, "TemplateSyntaxError"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}\n\n{{ raise_exception('not for this model') }}", 3,
     "TemplateError"),
])
def test_a_broken_chat_template_file_names_the_tokenizer_the_key_and_the_line(tmp_path, capsys, template, line,
                                                                                error):
    jinja = tmp_path / "broken.jinja"
    jinja.write_text(template)
    config = tokenize_config_file(tmp_path, [tokenize_record(0, "short", "Fine.")], chat_template=str(jinja),
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


# ---------------------------------------------------------------------------------------------- templates that loop
LOOP = ("{%- for i in range(100000) -%}{%- for j in range(100000) -%}{%- endfor -%}{%- endfor -%}")  # 10^10


def _looping_template(tmp_path, when: str) -> str:
    """The example ChatML template, looping 10^10 times for a message that holds `when` ('' : every message)."""
    text = (ROOT / "data/example/chatml.jinja").read_text()
    marker = "{%- for message in messages -%}"
    loop = LOOP if not when else f"{{%- if '{when}' in (message.content or '') -%}}{LOOP}{{%- endif -%}}"
    path = tmp_path / "loop.jinja"
    path.write_text(text.replace(marker, marker + loop, 1))
    return str(path)


def _run_bounded(args, timeout=120):
    """The pipeline in a child process: before the bound, a looping template hung it (the timeout fails the test)."""
    return subprocess.run([sys.executable, "-m", "data.pipeline", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.serial  # render_timeout 0.5 s: the other records must render within it
@pytest.mark.parametrize("stage, workers", [("tokenize", 1), ("tokenize", 2), ("merge", 1)])
def test_a_template_that_loops_on_one_record_is_an_error_naming_template_and_record(tmp_path, stage, workers):
    template = _looping_template(tmp_path, "SPIN")
    out = tmp_path / "out"
    out.mkdir()
    spin = {**CHAT_QA, "messages": [{"role": "user", "content": "SPIN please"}, CHAT_QA["messages"][1]]}
    rows = [{**r, "meta": {"category_id": 1, "category_name": "chat", "uid": k, "source": f"raw.jsonl:{k + 1}"}}
            for k, r in enumerate([CHAT_QA, CHAT_QA, spin, CHAT_QA])]
    name = "merged.jsonl" if stage == "tokenize" else "sampled.jsonl"
    write_jsonl(out / name, rows)
    config = data_config_file(tmp_path, [], chat_template=template, render_timeout=0.5, num_workers=workers,
                          max_length=512, merge={"probability": 0.9})
    result = _run_bounded([config, "--stages", stage])
    assert result.returncode == 2, result.stderr
    source = f"{out / name}:3" + (" (from raw.jsonl:3)" if stage == "tokenize" else "")
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: chat_template: {template} (tokenizer {ROOT / 'data/example/tokenizer'}): rendering {source} took "
        "more than render_timeout 0.5 s (the template may loop): fix the template, or raise render_timeout "
        "(null: no bound)")


def test_a_template_that_loops_on_every_conversation_is_refused_before_any_stage(tmp_path):
    template = _looping_template(tmp_path, "")
    config = data_config_file(tmp_path, [], chat_template=template, render_timeout=0.5)
    result = _run_bounded([config, "--stages", "tokenize"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: chat_template: {template} (tokenizer {ROOT / 'data/example/tokenizer'}): rendering a "
        "user/assistant exchange (a probe) took more than render_timeout 0.5 s (the template may loop): fix the "
        "template, or raise render_timeout (null: no bound)")
