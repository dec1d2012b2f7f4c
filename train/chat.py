"""Talk to a trained model: `python -m train.chat outputs/example/train/final`.

Each line read from stdin is a user turn; the model's answer (rendered with the model's chat template, the one the
data was packed with: train/run/export.py exports it with final/) is printed as `assistant: ...`. The conversation
keeps its history; `/reset` starts a new one, `/exit` (or end of input) ends. Greedy decoding by default
(`--temperature 0`); `--temperature T` samples (with `--top-p`, seeded by `--seed`). Works on piped input too:
`printf 'What is 2 + 3?\\n' | python -m train.chat DIR`.

A composite (image-text-to-text) export, such as the image example's Qwen2.5-VL, loads with its own class (the
trainer's choice, train/model/composite.py `auto_model_class`); its text turns work anywhere, and `/image PATH`
puts an image into the next user turn where the model's processor loads (its image processor needs torchvision:
.venv-vision).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.config import ConfigError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train.chat", description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="an exported model directory (a run's final/, or any HF model directory)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="longest answer in tokens (default 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling when --temperature > 0")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed")
    parser.add_argument("--system", default=None, help="a system message at the start of every conversation")
    parser.add_argument("--template", default=None,
                        help="a chat template for a model without one: a built-in name (chatml, llama3, phi3, qwen) "
                             "or a Jinja file")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        parser.error("--temperature must be >= 0 and --top-p in (0, 1]")
    return args


PROBE = "PackSFT probe answer"


def end_of_turn(tokenizer) -> str:
    """The text the chat template writes right after an assistant message's content (e.g. `<|im_end|>`): a probe
    conversation rendered, the marker taken up to the first whitespace or the next turn's start."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": PROBE}],
                                         tokenize=False)
    after = text[text.rindex(PROBE) + len(PROBE):].strip()
    marker = after.split()[0] if after else ""
    if not marker:
        raise ConfigError("the chat template writes nothing after an assistant message: cannot tell where an answer "
                          "ends; give --template")
    return marker


class Chat:
    """A model, its tokenizer and chat template, and one conversation's history."""

    def __init__(self, model_dir: str, template: str | None = None, system: str | None = None):
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            hint = (" (a LoRA run exports an adapter: chat with its merged/ model, lora_merge_on_save=true)"
                    if (path / "adapter_config.json").is_file() else "")
            raise ConfigError(f"{model_dir}: not a model directory (no config.json){hint}")
        import torch
        from transformers import AutoConfig, AutoTokenizer

        from data.shards.chat_templates import builtin_name, template_text, names
        from train.model.composite import auto_model_class, is_composite

        self.torch = torch
        config = AutoConfig.from_pretrained(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.processor, self.no_images = None, "a text model"
        if is_composite(config):  # its processor renders turns with images
            self.processor, self.no_images = export_processor(model_dir)
        if template:
            if not builtin_name(template) and not Path(template).is_file():
                raise ConfigError(f"--template: {template} is neither a file nor a built-in template name ({names()})")
            self.tokenizer.chat_template = template_text(template)
        if not self.tokenizer.chat_template:
            raise ConfigError(f"{model_dir}: the tokenizer has no chat template; give --template (a built-in name: "
                              f"{names()}, or a Jinja file)")
        self.end_of_turn = end_of_turn(self.tokenizer)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = auto_model_class(config).from_pretrained(model_dir).to(self.device).eval()
        self.system = system
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []
        self.images: list[str] = []  # for the next user turn

    def attach_image(self, path: str) -> None:
        """`/image PATH`: the image goes into the next user turn (ConfigError where this model takes none)."""
        if self.processor is None:
            raise ConfigError(f"/image: this model takes no images here: {self.no_images}")
        if not Path(path).is_file():
            raise ConfigError(f"/image: {path} is not a file")
        self.images.append(str(Path(path).resolve()))

    def reply(self, text: str, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0) -> str:
        """The model's answer to the user turn `text` (with the images attached since the last turn), appended to
        the history with it. A conversation with images is rendered by the processor, which puts each image's
        tokens in and returns its pixel values; a text one by the tokenizer."""
        if self.images:
            content = [*({"type": "image", "path": image} for image in self.images), {"type": "text", "text": text}]
            self.messages.append({"role": "user", "content": content})
            self.images = []
        else:
            self.messages.append({"role": "user", "content": text})
        with_images = any(isinstance(m["content"], list) for m in self.messages)
        render = self.processor if with_images else self.tokenizer
        inputs = render.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True, return_tensors="pt").to(self.device)
        eos = [i for i in (self.tokenizer.eos_token_id, self.tokenizer.convert_tokens_to_ids(self.end_of_turn))
               if isinstance(i, int) and i != self.tokenizer.unk_token_id]
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else \
            {"do_sample": False}
        with self.torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, stop_strings=[self.end_of_turn],
                                      tokenizer=self.tokenizer, eos_token_id=eos or None,
                                      pad_token_id=self.tokenizer.pad_token_id or (eos[0] if eos else 0), **sampling)
        new = out[0, inputs["input_ids"].shape[1]:]
        answer = self.tokenizer.decode(new, skip_special_tokens=False)
        answer = answer.split(self.end_of_turn)[0]
        for special in (self.tokenizer.eos_token, self.tokenizer.pad_token):
            if special:
                answer = answer.split(special)[0]
        answer = answer.strip()
        self.messages.append({"role": "assistant", "content": answer})
        return answer


def export_processor(model_dir: str):
    """(the processor of a composite export, or None; why there is none): its image processor needs torchvision,
    whose PyPI wheels load only beside PyPI's CUDA torch build (.venv-vision), not the CPU wheel of .venv."""
    from transformers import AutoProcessor

    if not (Path(model_dir) / "preprocessor_config.json").is_file():
        return None, f"{model_dir} holds no processor (preprocessor_config.json)"
    try:
        return AutoProcessor.from_pretrained(model_dir), ""
    except Exception as exc:  # noqa: BLE001 (ImportError, or torchvision's RuntimeError beside the CPU-only torch)
        first = str(exc).strip().splitlines()[0].split(". ")[0] if str(exc).strip() else type(exc).__name__
        return None, (f"its processor does not load in this environment ({type(exc).__name__}: {first}); images need "
                      "torchvision: run .venv-vision/bin/python -m train.chat (bash scripts/setup_vision.sh)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        chat = Chat(args.model_dir, args.template, args.system)
    except (ConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    chat.torch.manual_seed(args.seed)
    interactive = sys.stdin.isatty()
    if interactive:
        images = ", /image PATH: an image in your next turn" if chat.processor is not None else ""
        print(f"chatting with {args.model_dir} (/reset: a new conversation{images}, /exit or Ctrl-D: quit)",
              file=sys.stderr)
    while True:
        if interactive:
            print("user> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            chat.reset()
            print("(new conversation)", file=sys.stderr, flush=True)
            continue
        if text.strip().startswith("/image "):
            try:
                chat.attach_image(text.strip().removeprefix("/image ").strip())
                print(f"(image attached to your next turn: {chat.images[-1]})", file=sys.stderr, flush=True)
            except ConfigError as exc:
                print(f"error: {exc}", file=sys.stderr, flush=True)
            continue
        print(f"assistant: {chat.reply(text, args.max_new_tokens, args.temperature, args.top_p)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
