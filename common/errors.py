"""The one base of every error a PackSFT command ends with: `label: message` on one line and the exit status of its
kind (2: the command was given something it refuses before any work, a config or a model it does not train; 1: it
stopped during the work). `python -m train` and `python -m data.pipeline` catch this base once and print
`one_line()`: no error of PackSFT's own ends a command as a traceback."""
from __future__ import annotations


class PackSFTError(Exception):
    """A failure PackSFT names itself. Subclasses set `label` (what the line starts with) and `exit_code`."""

    label = "error"
    exit_code = 1

    def one_line(self) -> str:
        return f"{self.label}: {self}"
