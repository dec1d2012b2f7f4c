"""The error bad input raises, shared by the pipeline and the trainer's media loader (data/shards/decode.py decodes
the stored media with the checks the tokenize stage ran)."""
from __future__ import annotations


class RecordError(ValueError):
    """Bad input in one record: `str()` is `path:line: field: message`; `.reason` keys the skip counts."""

    def __init__(self, source: str, field: str, message: str, reason: str = "invalid_record"):
        super().__init__(source, field, message, reason)
        self.source = source
        self.field = field
        self.message = message
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.source}: {self.field}: {self.message}"
