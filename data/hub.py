"""Local directory or Hugging Face Hub id, for the data pipeline's and the trainer's tokenizer and model paths."""
from __future__ import annotations

import functools
import re
from pathlib import Path

from data.config import ConfigError, relative_note

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_FILES = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]  # configs and tokenizers, not the weights


@functools.lru_cache(maxsize=None)
def pretrained_dir(name: str, key: str) -> Path:
    """A local directory as is; else a Hugging Face Hub id (`org/name`), resolved to its local snapshot of config
    and tokenizer files (from the cache when offline). The weights are fetched later by from_pretrained."""
    path = Path(name)
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{key}: {name} is a file; give the directory that holds it (or a Hub id org/name)")
        return path
    if not _HUB_ID.fullmatch(name) or name.startswith("."):
        raise ConfigError(f"{key}: {name} does not exist (a local directory, or a Hugging Face Hub id org/name)"
                          f"{relative_note(name)}")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(name, allow_patterns=_HUB_FILES))
    except LocalEntryNotFoundError as exc:
        offline = " (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else ""
        raise ConfigError(
            f"{key}: {name} is not a local directory, and the Hugging Face Hub is unreachable{offline} with no cached "
            f"copy: download it where the Hub is reachable (hf download {name}) or give a local "
            f"directory ({type(exc).__name__})"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{key}: {name} is neither a local directory nor a Hugging Face Hub model id (not found, or gated: log in "
            "with hf auth login)"
        ) from None
    except OSError as exc:  # network errors after retries
        raise ConfigError(f"{key}: {name} is not a local directory, and the Hugging Face Hub failed: {exc}") from None
