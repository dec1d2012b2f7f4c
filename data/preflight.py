"""Checks run before any stage: what would otherwise fail (or silently succeed) after minutes of work.

- `max_length` must leave room for a conversation: the chat template's fixed overhead (an empty user turn and
  an empty assistant turn, rendered and encoded) is measured on the real tokenizer.
- A stage must use the tokenizer (and chat template) of the earlier stages whose output it reads: pack reads
  tokenized/ (its meta.json records both hashes), tokenize reads merged.jsonl (the merge section of report.json
  records them when merge counted tokens). A different one is refused with the stages to re-run.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from common.config import ConfigError
from common.fsutil import tokenizer_hash
from data.shards.chat_templates import chat_template_hash
from data.config import DataConfig
from data.report import read_report
from data.shards.dataset import ShardFormatError, read_meta


def template_overhead(tokenizer, enable_thinking: bool | None = None) -> int:
    """Tokens of the smallest conversation: one empty user turn and one empty assistant turn."""
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    messages = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return len(tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids)


def check_max_length(cfg: DataConfig, tokenizer) -> None:
    overhead = template_overhead(tokenizer, cfg.enable_thinking)
    if cfg.max_length <= overhead:
        raise ConfigError(
            f"max_length={cfg.max_length} leaves no room for a conversation: the chat template of "
            f"{cfg.chat_template or cfg.tokenizer_path} alone takes {overhead} tokens (an empty user and assistant "
            f"turn); set max_length above {overhead}"
        )


def tokenizer_identity(cfg: DataConfig) -> dict:
    """The hashes a stage output records: tokenizer files, and the chat template file when one is set."""
    return {
        "tokenizer_hash": tokenizer_hash(cfg.tokenizer_path),
        "chat_template_hash": chat_template_hash(cfg.chat_template),
    }


def _compare(recorded: dict, current: dict, what: str, cfg: DataConfig, rerun: str) -> None:
    """`rerun`: the command that re-runs the stages from the one that made `what`."""
    for key in ("tokenizer_hash", "chat_template_hash"):
        if key in recorded and recorded[key] != current[key]:
            name = "tokenizer" if key == "tokenizer_hash" else "chat template"
            raise ConfigError(
                f"tokenizer_path: {what} was made with another {name} ({key} {str(recorded[key])[:12]}…, from "
                f"{recorded.get('tokenizer_path', '?')}) than the config's {cfg.tokenizer_path}"
                f"{f' + {cfg.chat_template}' if cfg.chat_template else ''} ({str(current[key])[:12]}…): re-run "
                f"from that stage with this tokenizer ({rerun}), or set tokenizer_path/chat_template back"
            )


def check_tokenizer_consistency(cfg: DataConfig, command: Callable[[list[str]], str]) -> None:
    """Refuse to run tokenize / pack on the output of earlier stages made with another tokenizer (`command`: the
    command that runs given stages, for the message)."""
    if not Path(cfg.tokenizer_path).is_dir():
        return  # pack-only without the tokenizer: nothing to compare (pack itself does not tokenize)
    current = tokenizer_identity(cfg)
    if "pack" in cfg.stages and "tokenize" not in cfg.stages:
        try:
            meta = read_meta(cfg.tokenized_dir)
        except ShardFormatError:
            return  # the pack stage reports a missing or unreadable tokenized/ itself
        _compare(meta, current, str(cfg.tokenized_dir), cfg, command(["tokenize", "pack"]))
    if "tokenize" in cfg.stages and "merge" not in cfg.stages:
        merge = read_report(cfg.report_path).get("merge") or {}
        if merge.get("tokenizer_hash"):
            _compare(merge, current, f"{cfg.merged_path} (merge counted its tokens)", cfg,
                     command(["merge", "tokenize", "pack"]))


def stages_option(stages: list[str]) -> str:
    """`--stages a,b`: what to re-run, where the command line that ran is not known (a call from Python; the
    pipeline's command line gives `pipeline.Invocation.command`)."""
    return f"--stages {','.join(stages)}"


def preflight(cfg: DataConfig, command: Callable[[list[str]], str] = stages_option) -> None:
    """Every check that needs the tokenizer or earlier outputs, before the first stage runs (`command`: the command
    that runs given stages, for the messages)."""
    if "tokenize" in cfg.stages:
        from data.chat_template import load_chat_tokenizer

        check_max_length(cfg, load_chat_tokenizer(cfg.tokenizer_path, cfg.chat_template, cfg.render_timeout))
    check_tokenizer_consistency(cfg, command)
