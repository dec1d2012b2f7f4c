"""The export of a finished run: `final/` in Hugging Face format (safetensors + config + tokenizer, with the chat
template the data was rendered with, and a composite's processor files), loadable with `from_pretrained`; with LoRA
the adapter (train/model/lora.py) and, with lora_merge_on_save, the merged model in `final/merged/`. A model with
inf / nan weights is never exported."""
from __future__ import annotations

from pathlib import Path

from data.shards.chat_templates import data_chat_template
from train.checkpoint import CheckpointError, export_directory, from_main
from train.model.composite import copy_processor_files, processor_dir
from train.nonfinite import nonfinite_tensors
from train.run.setup import Run


def export(run: Run, out_dir: Path) -> Path:
    """Collective: every rank gives its part of the state; rank 0 writes `out_dir`. A refusal or a write error (a
    full disk) stops every rank with rank 0's message."""
    state = run.engine.export_state(run.mesh.is_main)  # collective
    error = None
    if run.mesh.is_main:
        try:
            refuse_nonfinite(run, out_dir, state)
            _write(run, out_dir, state)
        except CheckpointError as exc:
            error = str(exc)
    error = from_main(error)  # also the barrier after rank 0's write
    if error:
        raise CheckpointError(error)
    return out_dir


def refuse_nonfinite(run: Run, out_dir: Path, state: dict | None) -> None:
    """A model with inf / nan weights is never exported (`state` None: LoRA, whose export reads the model)."""
    tensors = state.items() if state is not None else run.lm.state_dict().items()
    bad, total = nonfinite_tensors(tensors)
    if bad:
        names = ", ".join(name.removeprefix("lm.") for name in bad[:5]) + (", ..." if len(bad) > 5 else "")
        raise CheckpointError(
            f"export directory {out_dir}: refused: {len(bad)} of {total} tensors hold inf or nan ({names}): the "
            "training diverged; nothing was written. Lower lr and resume from a checkpoint before the divergence"
        )


def _write(run: Run, out_dir: Path, state: dict | None) -> None:
    prefix = "lm."
    lm_state = None if state is None else {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    tok_path = run.checked.tokenizer_path  # checked at start (train/preflight.py)
    tokenizer = None
    if tok_path:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tok_path)
        tokenizer.chat_template = data_chat_template(run.dataset.meta) or tokenizer.chat_template  # the data's
    processor = processor_dir(run.lm.config, run.cfg.model.model_path, tok_path)  # a composite's image processor
    if run.cfg.lora.lora_rank > 0:
        from train.model.lora import save_lora

        save_lora(run.lm, out_dir, merge=run.cfg.lora.lora_merge_on_save, tokenizer=tokenizer, is_main=True,
                  state_dict=lm_state, processor_dir=processor)
        return
    run.lm.config.use_cache = True  # generation wants the cache; training turned it off
    try:
        with export_directory(out_dir) as tmp:
            run.lm.save_pretrained(tmp, state_dict=lm_state, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if processor is not None:
                copy_processor_files(processor, tmp)
    finally:
        run.lm.config.use_cache = False
