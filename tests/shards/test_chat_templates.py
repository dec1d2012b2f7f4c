"""The built-in chat templates (data/shards/chat_templates.py), for tokenizers without one: each renders a
conversation whose assistant turns the template analysis finds exactly (tool calls as the family writes them), and the
template exported with a model is the data's, unless its file changed since the data was rendered."""
from __future__ import annotations

import pytest

from data.chat_template import analyze_template, assistant_spans, load_chat_tokenizer
from data.shards.chat_templates import BUILTIN_TEMPLATES, chat_template_hash, data_chat_template
from tests.conftest import tokenizer_dir


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


def test_the_exported_template_is_the_datas_unless_its_file_changed(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(BUILTIN_TEMPLATES["chatml"])
    meta = {"chat_template": str(template), "chat_template_hash": chat_template_hash(str(template))}
    assert data_chat_template(meta) == BUILTIN_TEMPLATES["chatml"]
    template.write_text("{{ messages }}")
    assert data_chat_template(meta) is None  # not the template the data was rendered with
    assert data_chat_template({"chat_template": None}) is None
