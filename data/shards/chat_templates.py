"""Built-in chat templates by name (`chat_template: qwen`), for tokenizers without one (a base model's tokenizer,
GPT-2's): the names LLaMA-Factory users know from its `template:` key, written as Hugging Face Jinja templates.

A named template replaces the tokenizer's own, as a template file does. The rendering follows each family's
published chat format: ChatML (`<|im_start|>role ... <|im_end|>`), Qwen2/2.5 (ChatML with Qwen's default system
prompt, tools in the system turn, tool calls in `<tool_call>` tags, tool results as user turns in
`<tool_response>` tags), Llama 3 (`<|start_header_id|>role<|end_header_id|>` ... `<|eot_id|>`, tool results as
`ipython` turns) and Phi-3 (`<|role|>` ... `<|end|>`). A tokenizer that lacks the family's special tokens still
renders and trains (the markers become ordinary tokens); for a pretrained model use the template of its family.
"""
from __future__ import annotations

import hashlib
import os

# message content: a string, or text parts (`[{"type": "text", "text": ...}]`)
_CONTENT = ("{%- macro content(message) -%}"
            "{%- if message['content'] is string -%}{{- message['content'] -}}"
            "{%- elif message['content'] -%}{%- for part in message['content'] -%}"
            "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
            "{%- endmacro -%}")
# an assistant message's tool calls, one JSON object per call, each in `open` ... `close`
_TOOL_CALLS = ("{%- macro tool_calls(message, open, close, args_key) -%}"
               "{%- for call in message.get('tool_calls') or [] -%}"
               "{%- set fn = call['function'] if call['function'] is defined else call -%}"
               "{%- if message['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
               "{{- open + '{\"name\": \"' + fn['name'] + '\", \"' + args_key + '\": ' -}}"
               "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}"
               "{%- endif -%}{{- '}' + close -}}"
               "{%- endfor -%}"
               "{%- endmacro -%}")
_TOOLS_LIST = ("{%- macro tools_list() -%}"
               "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
               "{%- endmacro -%}")


def _chatml(default_system: str | None, tool_results_as_user: bool) -> str:
    system = (f"{{%- set default_system = {default_system!r} -%}}" if default_system
              else "{%- set default_system = '' -%}")
    tool_turn = ("{%- elif message['role'] == 'tool' -%}"
                 "{{- '<|im_start|>user\\n<tool_response>\\n' -}}{{- content(message) -}}"
                 "{{- '\\n</tool_response><|im_end|>\\n' -}}") if tool_results_as_user else ""
    return (_CONTENT + _TOOL_CALLS + _TOOLS_LIST + system +
            "{%- set first_system = messages and messages[0]['role'] == 'system' -%}"
            "{%- if first_system or default_system or tools -%}"
            "{{- '<|im_start|>system\\n' -}}"
            "{%- if first_system -%}{{- content(messages[0]) -}}{%- else -%}{{- default_system -}}{%- endif -%}"
            "{%- if tools -%}"
            "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
            "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
            "{{- tools_list() -}}"
            "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags.' -}}"
            "{%- endif -%}"
            "{{- '<|im_end|>\\n' -}}"
            "{%- endif -%}"
            "{%- for message in messages -%}"
            "{%- if loop.first and first_system -%}"
            + tool_turn +
            "{%- else -%}"
            "{{- '<|im_start|>' + message['role'] + '\\n' -}}{{- content(message) -}}"
            "{{- tool_calls(message, '<tool_call>\\n', '\\n</tool_call>', 'arguments') -}}"
            "{{- '<|im_end|>\\n' -}}"
            "{%- endif -%}"
            "{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


LLAMA3 = (_CONTENT + _TOOL_CALLS + _TOOLS_LIST +
          "{{- bos_token -}}"
          "{%- if tools -%}"
          "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nEnvironment: ipython\\n\\nYou have access to the "
          "following functions; to call one, respond with a JSON object {\"name\": function name, \"parameters\": "
          "arguments}:' -}}{{- tools_list() -}}{{- '<|eot_id|>' -}}"
          "{%- endif -%}"
          "{%- for message in messages -%}"
          "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] -%}"
          "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' -}}{{- content(message) -}}"
          "{{- tool_calls(message, '', '', 'parameters') -}}"
          "{{- '<|eot_id|>' -}}"
          "{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}")

PHI3 = (_CONTENT + _TOOL_CALLS + _TOOLS_LIST +
        "{%- if tools -%}{{- '<|system|>\\nAvailable functions:' -}}{{- tools_list() -}}{{- '<|end|>\\n' -}}"
        "{%- endif -%}"
        "{%- for message in messages -%}"
        "{{- '<|' + message['role'] + '|>\\n' -}}{{- content(message) -}}"
        "{{- tool_calls(message, '<tool_call>', '</tool_call>', 'arguments') -}}"
        "{{- '<|end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}")

BUILTIN_TEMPLATES = {
    "chatml": _chatml(None, tool_results_as_user=False),
    "qwen": _chatml("You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", tool_results_as_user=True),
    "llama3": LLAMA3,
    "phi3": PHI3,
}
# other spellings of the same formats (LLaMA-Factory's names among them)
ALIASES = {"qwen2": "qwen", "qwen2.5": "qwen", "qwen2_5": "qwen", "llama-3": "llama3", "llama3.1": "llama3",
           "phi": "phi3", "phi-3": "phi3"}


def builtin_name(value: str | None) -> str | None:
    """The built-in template `value` names (case-insensitive, aliases resolved), else None."""
    if not value:
        return None
    key = value.strip().lower()
    key = ALIASES.get(key, key)
    return key if key in BUILTIN_TEMPLATES else None


def names() -> str:
    return ", ".join(sorted(BUILTIN_TEMPLATES))


def template_text(value: str) -> str:
    """The Jinja text of `chat_template`: a built-in name's template, else the file's contents."""
    name = builtin_name(value)
    if name is not None:
        return BUILTIN_TEMPLATES[name]
    with open(value, encoding="utf-8") as f:
        return f.read()


def chat_template_hash(value: str | None) -> str | None:
    """What a stage output records as `chat_template_hash`: blake2b-256 of the template file's bytes, or of a
    built-in template's text; None without `chat_template`."""
    if not value:
        return None
    name = builtin_name(value)
    if name is None:
        from common.fsutil import file_blake2b

        return file_blake2b(value)
    return hashlib.blake2b(BUILTIN_TEMPLATES[name].encode(), digest_size=32).hexdigest()


def data_chat_template(meta: dict) -> str | None:
    """The chat template the packed data was rendered with (its meta.json's `chat_template`: a built-in name, or a
    file that still holds the bytes it had), for the exported model's tokenizer; None when the data used the
    tokenizer's own template (or the file changed since)."""
    value = meta.get("chat_template")
    if not value:
        return None
    name = builtin_name(value)
    if name is not None and not os.path.isfile(value):
        return BUILTIN_TEMPLATES[name]
    try:
        if chat_template_hash(value) != meta.get("chat_template_hash", chat_template_hash(value)):
            return None
        return template_text(value)
    except OSError:
        return None
