"""The names a config may give the attention kernel and the sequence-parallel backend, each written once here.

train/config/sections.py's allowed values (`attn_backend`, `sp_backend`) are these tuples, and the tables that implement them
are keyed by these names: train/attention/function.py's `BACKENDS` (in `auto`'s order) and train/attention/sequence_parallel.py's
`SP_BACKENDS` (the gather / ring backends); `ulysses` (train/attention/ulysses.py) exchanges heads around the packed attention
or around one of those. No torch here: the config imports this module.
"""
from __future__ import annotations

AUTO = "auto"

FLASH_VARLEN, TORCH_VARLEN, FLEX, SDPA = "flash_varlen", "torch_varlen", "flex", "sdpa"
ATTENTION_BACKENDS = (FLASH_VARLEN, TORCH_VARLEN, FLEX, SDPA)  # `auto`: the first that can run, in this order

TORCH, LLAMA3, ZIGZAG = "torch", "llama3", "zigzag"
RING_BACKENDS = (TORCH, LLAMA3, ZIGZAG)  # all-gathered K/V (any torch), ring-flash-attn's llama3 and zigzag rings
ULYSSES = "ulysses"

ATTN_BACKEND_CHOICES = (AUTO, *ATTENTION_BACKENDS)
SP_BACKEND_CHOICES = (AUTO, *RING_BACKENDS, ULYSSES)
