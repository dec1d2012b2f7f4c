"""The ratio file the user edits to weight categories: `{"categories": [{category_id, category_name, size,
sample_rate}]}`. Preprocess writes it (sizes refreshed, the user's ids and rates kept), sample reads its rates,
the pipeline tells from its digest that it was edited after sampling."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import orjson

from common.config import closest_key_hint
from common.fsutil import atomic_write_bytes
from data.records import MAX_CATEGORY_ID

MAX_SAMPLE_RATE = 1000  # a larger rate is a typo (1e15 copies would exhaust memory), not a weighting
RATIO_FILE_KEYS = ("categories",)
RATIO_ENTRY_KEYS = ("category_id", "category_name", "size", "sample_rate")
UNTRACKED = "untracked"  # category 0


def _check_known_keys(obj: dict, known: tuple[str, ...], where: str) -> None:
    """A key the ratio file does not define is a typo (`sample_rat`) that would silently run at the default and
    vanish on the next rewrite: an error naming the closest key."""
    for key in obj:
        if key not in known:
            raise ValueError(f"{where}: unknown key {key!r}{closest_key_hint(key, known)} (known: {list(known)})")


def read_ratio_file(path: str | Path) -> list[dict]:
    """The ratio JSON `{"categories": [{category_id, category_name, size, sample_rate}]}`; [] if absent.
    Ids and names must be unique; id 0 is reserved for `untracked`; no other key is allowed (a typo is an error,
    so that the rewrite of the file never drops what the user wrote)."""
    try:
        data = orjson.loads(Path(path).read_bytes())
    except FileNotFoundError:
        return []
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON: {exc}") from None
    if isinstance(data, dict):
        _check_known_keys(data, RATIO_FILE_KEYS, str(path))
    cats = data.get("categories") if isinstance(data, dict) else None
    if not isinstance(cats, list):
        raise ValueError(f"{path}: expected {{\"categories\": [...]}}")
    seen_ids, seen_names = set(), set()
    for i, cat in enumerate(cats):
        where = f"{path}: categories[{i}]"
        if isinstance(cat, dict):
            name = cat.get("category_name")
            _check_known_keys(cat, RATIO_ENTRY_KEYS,
                              f"{path}: entry {name!r} (categories[{i}])" if isinstance(name, str) else where)
        if not isinstance(cat, dict) or not isinstance(cat.get("category_name"), str):
            raise ValueError(f"{where}: needs category_name (a string)")
        cid = cat.get("category_id")
        if isinstance(cid, bool) or not isinstance(cid, int) or not 0 <= cid <= MAX_CATEGORY_ID:
            raise ValueError(f"{where}: category_id must be an integer in 0..{MAX_CATEGORY_ID} (stored as int16), "
                             f"got {cid!r}")
        if (cid == 0) != (cat["category_name"] == UNTRACKED):
            raise ValueError(f"{where}: category_id 0 is reserved for {UNTRACKED!r}")
        if cid in seen_ids or cat["category_name"] in seen_names:
            raise ValueError(f"{where}: duplicate category id {cid} or name {cat['category_name']!r}")
        rate = cat.get("sample_rate", 1.0)
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= MAX_SAMPLE_RATE:
            raise ValueError(f"{where} ({cat['category_name']!r}): sample_rate must be a number in 0..{MAX_SAMPLE_RATE} "
                             f"(copies of each record), got {rate!r}")
        seen_ids.add(cid)
        seen_names.add(cat["category_name"])
    return cats


def check_ratio_names(ratio_cats: list[dict], data_names: Iterable[str], ratio_path: str | Path) -> None:
    """Every entry of the ratio file must name a category of the data (matched by name, never by id): an entry
    that matches nothing is a renamed or removed category whose rate would silently apply to nothing.
    `untracked` (id 0, managed by the pipeline) may be absent from the data."""
    names = set(data_names)
    orphans = [c for c in ratio_cats if c["category_name"] not in names and c["category_name"] != UNTRACKED]
    if orphans:
        listed = ", ".join(f"{c['category_name']!r} (id {c['category_id']}, sample_rate {c.get('sample_rate', 1.0)})"
                           for c in orphans)
        one = len(orphans) == 1
        raise ValueError(f"{ratio_path}: {'entry' if one else 'entries'} {listed} {'matches' if one else 'match'} no "
                         f"category of the data (categories: {sorted(names)}); categories are matched by name: put back the data's "
                         "name if you renamed one, delete the entry if the category is gone")


def merge_ratio_categories(existing: list[dict], ids: dict[str, int], sizes: dict[str, int]) -> list[dict]:
    """Refresh sizes; keep every existing id and sample_rate; new categories (already given ids) get rate 1.0.
    Categories absent from this data keep their entry with size 0. Sorted by id."""
    by_name = {c["category_name"]: dict(c) for c in existing}
    for name, cid in ids.items():
        if name not in by_name:
            by_name[name] = {"category_id": cid, "category_name": name, "size": 0, "sample_rate": 1.0}
    out = []
    for cat in sorted(by_name.values(), key=lambda c: c["category_id"]):
        cat["size"] = sizes.get(cat["category_name"], 0)
        cat.setdefault("sample_rate", 1.0)
        out.append({"category_id": cat["category_id"], "category_name": cat["category_name"],
                    "size": cat["size"], "sample_rate": cat["sample_rate"]})
    return out


def write_ratio_file(path: str | Path, categories: list[dict]) -> None:
    atomic_write_bytes(path, orjson.dumps({"categories": categories}, option=orjson.OPT_INDENT_2) + b"\n")


def ratio_file_digest(path) -> str | None:
    """sha256 of the ratio file as sampling read it (None when there is none): later stages run on their own can
    tell that it was edited since (data.pipeline.stale_input_warnings)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except FileNotFoundError:
        return None
