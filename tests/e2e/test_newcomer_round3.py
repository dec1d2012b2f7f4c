"""A newcomer's first hour, round 3: built-in chat templates by name for tokenizers without one, the chat command
on an exported model, the run summary, the image environment's hint, the example's ratio file out of the tracked
files."""
from __future__ import annotations

import io
import sys
from pathlib import Path

import orjson
import pytest

from common.config import ConfigError
from data import pipeline
from data.chat_template import analyze_template, assistant_spans, load_chat_tokenizer
from data.shards.chat_templates import BUILTIN_TEMPLATES, chat_template_hash, data_chat_template
from tests.conftest import ROOT, fixture_path, tokenizer_dir

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "Call the tool."},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "It says 5."},
]


# ---------------------------------------------------------------------------------------------- chat templates
@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_a_builtin_template_gives_a_tokenizer_without_one_exact_assistant_spans(name):
    """gpt2 has no chat template: by name, each family's template renders, the header and end-of-turn are found,
    and every assistant turn's span holds exactly its text (tool calls as the family writes them) + end-of-turn."""
    tok = load_chat_tokenizer(str(tokenizer_dir("gpt2")), name)
    info = analyze_template(tok)
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    spans = assistant_spans(text, info, 3)
    bodies = [text[a:b] for a, b in spans]
    assert bodies[0] == "5" + info.end_of_turn and bodies[2] == "It says 5." + info.end_of_turn
    call = bodies[1].removesuffix(info.end_of_turn)
    assert '"name": "add"' in call and '{"a": 2, "b": 3}' in call
    assert text.count("Be brief.") == 1 and "What is 2 + 3?" in text
    prompt = tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith(info.header)


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


def test_the_exported_template_is_the_datas_unless_its_file_changed(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(BUILTIN_TEMPLATES["chatml"])
    meta = {"chat_template": str(template), "chat_template_hash": chat_template_hash(str(template))}
    assert data_chat_template(meta) == BUILTIN_TEMPLATES["chatml"]
    template.write_text("{{ messages }}")
    assert data_chat_template(meta) is None  # not the template the data was rendered with
    assert data_chat_template({"chat_template": None}) is None


# ---------------------------------------------------------------------------------------------- chat command
@pytest.fixture(scope="module")
def gpt2_model(tmp_path_factory):
    """A tiny random Qwen2 with gpt2's vocabulary and tokenizer (no chat template), saved as an export is."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("gpt2_model")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir("gpt2"))
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _reference_replies(path: Path, template: str, turns: list[str], max_new_tokens: int) -> list[str]:
    """transformers alone: greedy generation on the conversation so far, cut at the end-of-turn marker."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = BUILTIN_TEMPLATES[template]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    messages, replies = [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                      return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        text = tok.decode(out[0, ids["input_ids"].shape[1]:]).split("<|im_end|>")[0].split(tok.eos_token)[0].strip()
        messages.append({"role": "assistant", "content": text})
        replies.append(text)
    return replies


def test_chat_without_a_template_says_how_and_with_one_answers_each_line(gpt2_model, monkeypatch, capsys):
    from train import chat

    assert chat.main([str(gpt2_model)]) == 2
    assert "the tokenizer has no chat template; give --template (a built-in name: chatml, llama3, phi3, qwen" in \
        capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 2 + 3?\n\nAnd 4 + 4?\n/reset\nWhat is 2 + 3?\n"))
    assert chat.main([str(gpt2_model), "--template", "chatml", "--max-new-tokens", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line.startswith("assistant: ") for line in lines)
    replies = [line.removeprefix("assistant: ") for line in lines]
    assert replies[:2] == _reference_replies(gpt2_model, "chatml", ["What is 2 + 3?", "And 4 + 4?"], 6)
    assert replies[2] == replies[0]  # /reset: a new conversation, greedy


def test_chat_refuses_what_is_not_a_model(tmp_path, capsys):
    from train import chat

    (tmp_path / "adapter_config.json").write_text("{}")
    assert chat.main([str(tmp_path)]) == 2
    assert "not a model directory (no config.json) (a LoRA run exports an adapter" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- run summary
def test_run_summary_says_time_rate_losses_paths_and_how_to_chat(tmp_path):
    from train.metrics import run_summary

    records = [{"step": 11, "loss": 7.5, "tokens": 4000, "tokens_per_s": 200.0},
               {"step": 12, "loss": 7.25, "tokens": 6000, "tokens_per_s": 300.0, "eval_loss": 7.375}]
    final = tmp_path / "final"
    text = run_summary(records, 99.0, tmp_path / "checkpoints" / "step-000012", final, 75.0)
    assert text.splitlines() == [
        "run summary: steps 11-12 in 0m40s (1m15s in all, start-up and saving included), 250 tokens/s, final loss "
        "7.25, eval loss 7.375 (step 12)",
        f"  checkpoint:  {tmp_path / 'checkpoints' / 'step-000012'}",
        f"  final model: {final}",
        f"  try it:      python -m train.chat {final}   (one user turn per line; with .venv active, from the project "
        "directory)"]
    final.mkdir()
    (final / "adapter_config.json").write_text("{}")
    assert run_summary(records[:1], 20.0, None, final).splitlines()[-1] == (
        "  try it:      the export is a LoRA adapter: set lora_merge_on_save=true to chat with the merged model")
    stopped = run_summary(records, 99.0, tmp_path / "c", None)
    assert "final model" not in stopped and "try it" not in stopped


# ---------------------------------------------------------------------------------------------- image environment
def test_without_torchvision_the_hint_is_the_prefix_when_the_image_environment_exists(tmp_path, monkeypatch):
    try:
        import torchvision  # noqa: F401
        pytest.skip("torchvision loads here (.venv-vision)")
    except Exception:
        pass
    from data.shards import processor as images

    processor = str(fixture_path("multimodal", "qwen2_5_vl_processor"))
    venv = tmp_path / ".venv-vision"
    monkeypatch.setattr(images, "VISION_VENV", venv)
    with pytest.raises(ConfigError, match=r"scripts/setup_vision.sh") as absent:
        images.load_processor(processor)
    assert "PACKSFT_VENV" not in str(absent.value)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    with pytest.raises(ConfigError, match=r"the image environment is built \(.*\): run the command with the prefix "
                                          r"`PACKSFT_VENV=.venv-vision`, e.g. `PACKSFT_VENV=.venv-vision sh "
                                          r"data_process.sh CONFIG`"):
        images.load_processor(processor)


# ---------------------------------------------------------------------------------------------- the ratio file
def test_the_examples_ratio_file_is_written_to_its_output_directory_not_under_configs():
    from data.config import load_config

    cfg = load_config(ROOT / "configs/data/example.json")
    assert cfg.ratio_file == Path("outputs/example/ratios.json")  # outputs/ is ignored by git
    assert "outputs/" in (ROOT / ".gitignore").read_text().splitlines()
    tracked_ratio_files = [p for p in (ROOT / "configs").rglob("*.json")
                           if list(orjson.loads(p.read_bytes())) == ["categories"]]
    assert tracked_ratio_files == []


# ---------------------------------------------------------------------------------------------- start-up
def test_a_single_process_launch_starts_the_trainer_as_accelerate_would(tmp_path, monkeypatch, capfd):
    """One process on one machine: the trainer module started directly (no accelerate launcher process), with
    accelerate's OpenMP setting (the threads train/__main__.py chose on CPU; one on a GPU unless set), and its exit
    status."""
    import signal

    from train.launch import FORWARDED_SIGNALS, run_single_process

    (tmp_path / "probe_env.py").write_text("import os, sys\nprint(os.environ.get('OMP_NUM_THREADS'), *sys.argv[1:])\n"
                                           "sys.exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    handlers = {sig: signal.getsignal(sig) for sig in FORWARDED_SIGNALS}
    try:
        assert run_single_process(["--num_processes", "1", "--cpu", "--num_cpu_threads_per_process", "2", "-m",
                                   "probe_env", "a.yaml", "k=v"]) == 3
        assert run_single_process(["--num_processes", "1", "-m", "probe_env", "a.yaml"]) == 3
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert capfd.readouterr().out.splitlines() == ["2 a.yaml k=v", "1 a.yaml"]
