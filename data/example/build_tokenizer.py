"""Trains the example's byte-level BPE tokenizer (vocab 2048) on data/example/raw and saves it with the
ChatML template in data/example/tokenizer/. Deterministic; needs no download.

    python -m data.example.build_tokenizer
"""
from __future__ import annotations

from pathlib import Path

import orjson
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

HERE = Path(__file__).resolve().parent
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
VOCAB_SIZE = 2048


def corpus() -> list[str]:
    """Every string value of the raw example files, plus the template's fixed text."""
    texts: list[str] = [(HERE / "chatml.jinja").read_text()]

    def walk(node):
        if isinstance(node, str):
            texts.append(node)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for path in sorted((HERE / "raw").iterdir()):
        data = path.read_bytes()
        rows = [orjson.loads(line) for line in data.splitlines()] if path.suffix == ".jsonl" else orjson.loads(data)
        walk(rows)
    return texts


def build(out_dir: Path = HERE / "tokenizer") -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=32768,
    )
    fast.chat_template = (HERE / "chatml.jinja").read_text()
    fast.save_pretrained(out_dir)
    return fast


if __name__ == "__main__":
    t = build()
    print(f"saved {len(t)} tokens to {HERE / 'tokenizer'}")
