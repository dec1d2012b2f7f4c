"""A cheap lower bound on the number of tokens of a text, so an over-long record is rejected before the chat
template and the tokenizer see it (encoding a 50 MB message takes ~50 s and ~10 GB of offsets).

Every token of a tokenizer stands for at most `max_token_bytes` bytes of (normalized) input, and the tokenizers
this applies to cover every input byte with a token, so a text of b UTF-8 bytes has at least
ceil(b / max_token_bytes) tokens. The bound is only offered when that holds by construction: a BPE model that
encodes every character (byte-level, or with byte fallback: never dropped, never fused into one unknown token), a normalizer and
pre-tokenizer that never delete text (Unicode normalization, lowercasing, string replacements by non-empty
strings; splits that keep what they split on). Otherwise `TokenBound.of(tokenizer)` is None and records are
measured by encoding them, as before.
"""
from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import dataclass
from typing import Any

WHITESPACE = tuple(c for c in map(chr, range(0x3001)) if c.isspace())  # what str.split() splits on (<= U+3000)
UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
NORMALIZERS = (*UNICODE_FORMS, "Lowercase", "Prepend", "Replace", "Sequence")
PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts", "Sequence")
# Unicode normalization of a piece and of the text around it can differ where they meet (a combining mark
# composing across the boundary): a few bytes per piece, subtracted from a piece's count
BOUNDARY_SLACK_BYTES = 8


def _components(spec: dict | None, key: str) -> list[dict]:
    """A normalizer or pre-tokenizer spec flattened (Sequence members in order)."""
    if spec is None:
        return []
    if spec["type"] == "Sequence":
        return [c for member in spec[key] for c in _components(member, key)]
    return [spec]


def _never_deletes(spec: dict | None, allowed: tuple[str, ...], key: str) -> bool:
    for part in _components(spec, key):
        if part["type"] not in allowed or part.get("behavior") == "Removed":
            return False
        if part["type"] == "Replace" and ("String" not in part["pattern"] or not part["content"]):
            return False  # a regex may match a long run and replace it with less
    return True


def _token_input_bytes(token: str, byte_level: bool) -> int:
    """Input bytes a vocabulary entry stands for at most: one per character of a byte-level token, else its UTF-8
    length (a metaspace `▁`, 3 bytes, stands for a 1-byte space; a `<0xAB>` byte-fallback token for 1 byte)."""
    return len(token) if byte_level else len(token.encode("utf-8"))


@dataclass(frozen=True)
class TokenBound:
    max_token_bytes: int
    normalizer: Any  # the tokenizer's normalizer (None: none); the bound counts normalized bytes
    unicode_forms: tuple[str, ...] | None  # the normalizer's steps when all are Unicode forms (a fast check)

    @classmethod
    def of(cls, tokenizer) -> "TokenBound | None":
        backend = tokenizer.backend_tokenizer
        spec = json.loads(backend.to_str())
        model = spec["model"]
        if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
            return None
        byte_level = any(p["type"] == "ByteLevel" for p in _components(spec.get("pre_tokenizer"), "pretokenizers"))
        if not (byte_level or model.get("byte_fallback")):
            return None  # unknown characters are dropped, or a run of them fused into one token
        if not (_never_deletes(spec.get("normalizer"), NORMALIZERS, "normalizers")
                and _never_deletes(spec.get("pre_tokenizer"), PRE_TOKENIZERS, "pretokenizers")):
            return None
        longest = max((_token_input_bytes(t, byte_level) for t in model["vocab"]), default=1)
        added = max((len(t["content"].encode("utf-8")) for t in spec.get("added_tokens") or []), default=1)
        steps = [part["type"] for part in _components(spec.get("normalizer"), "normalizers")]
        forms = tuple(steps) if all(step in UNICODE_FORMS for step in steps) else None
        return cls(max(longest, added, 1), backend.normalizer, forms)

    def _normalized(self, text: str) -> str:
        """The text the model sees; `unicodedata.is_normalized` skips the tokenizer's normalizer (~0.1 s a MB: it
        tracks alignments) for text that is already in every form it applies."""
        if self.normalizer is None or (self.unicode_forms is not None and
                                       all(unicodedata.is_normalized(form, text) for form in self.unicode_forms)):
            return text
        return self.normalizer.normalize_str(text)

    def _tokens(self, n_bytes: int) -> int:
        return math.ceil(max(n_bytes, 0) / self.max_token_bytes)

    def text_tokens(self, text: str) -> int:
        """At least this many tokens encode `text` (exactly the text given to the tokenizer)."""
        return self._tokens(len(self._normalized(text).encode("utf-8")))

    def piece_tokens(self, text: str) -> int:
        """At least this many tokens encode any text holding `text`'s non-whitespace characters in order (what the
        conservation check guarantees of a trained turn's content in the render: templates trim and reformat
        whitespace)."""
        normalized = self._normalized(text)
        spaces = sum(normalized.count(w) * len(w.encode("utf-8")) for w in WHITESPACE)
        return self._tokens(len(normalized.encode("utf-8")) - spaces - BOUNDARY_SLACK_BYTES)
