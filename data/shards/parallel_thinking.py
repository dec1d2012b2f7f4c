"""Parallel-R1 parallel thinking: per-token block/path ids from character spans, and structured position ids.

An assistant text may hold blocks ``<Parallel> … </Parallel>``, each with two or more ``<Path> … </Path>``
generated independently of each other, and ``<Summary> … </Summary>`` sections outside blocks.

Character regions of one block (``sep`` is whatever lies between two tags, usually a newline)::

    <Parallel> | sep <Path>…</Path> | sep <Path>…</Path> | sep </Parallel>
    shared      path 1               path 2               shared (sees every path)

- The ``<Parallel>`` tag is shared: every path sees it (as in Parallel-R1).
- Text inside a block but outside every path belongs to the path that FOLLOWS it, so each path owns its
  leading separator. A separator that had seen path 1 would otherwise pass it on to path 2 (Parallel-R1's
  own mask has that leak). Text after the last ``</Path>`` belongs with ``</Parallel>`` (path id 0).
- Every token of the block, tags included, carries the block id; path ids are 1..P on path tokens and 0 on
  the shared tags (and everywhere outside blocks).

Token rule: a token belongs to the region that holds its FIRST character. With the Qwen tokenizer ``>\\n``
is one token, so the ``>`` closing ``</Path>`` takes the following newline into the path it closes, and the
next path starts at ``<Path``. The first-character rule never moves characters of a path's content into a
later region; a token that would carry a path's first content character into another region (a tokenizer
merging across ``<Path>``) is rejected with StructureError instead of leaking.

Positions (Parallel-R1's rule, `position_ids`): let B be the position of the token just before the block's
first path token (the last token of the ``<Parallel>`` tag; in Parallel-R1, where the tag is one token, the
``<Parallel>`` token itself). Each path's first token is at B + 1 and its tokens count up from there. The first
token after the last path (the ``</Parallel>`` tag, or text before it) is at B + L + 1, L being the longest
path in tokens: the text after the block continues from the longest path. Elsewhere positions count up by 1.
(Parallel-R1's own position code leaves the tokens between its tags, e.g. the newline between two paths, at
position 0; here they are path tokens and are numbered with their path.)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

OPEN_BLOCK, CLOSE_BLOCK = "<Parallel>", "</Parallel>"
OPEN_PATH, CLOSE_PATH = "<Path>", "</Path>"
OPEN_SUMMARY, CLOSE_SUMMARY = "<Summary>", "</Summary>"
TAG_PATTERN = re.compile(r"</?(?:Parallel|Path|Summary)>")
MAX_ID = np.iinfo(np.int16).max


class StructureError(ValueError):
    """The parallel-thinking tags of a text (or its per-token ids) do not form valid blocks."""


@dataclass(frozen=True)
class PathSpan:
    """Character offsets (into the full text) of one path: its region starts at the end of the previous tag."""

    region_start: int
    content_start: int  # just after <Path>
    content_end: int  # at </Path>
    region_end: int  # just after </Path>


@dataclass(frozen=True)
class BlockSpan:
    start: int  # at <Parallel>
    open_end: int  # just after <Parallel>
    paths: tuple[PathSpan, ...]
    end: int  # just after </Parallel>


def _where(text: str, span_start: int, at: int) -> str:
    snippet = text[max(span_start, at - 30): at + 40].replace("\n", "\\n")
    return f"assistant char {at - span_start} (…{snippet}…)"


def parse_blocks(text: str, start: int = 0, end: int | None = None) -> list[BlockSpan]:
    """Blocks of `text[start:end]` in order; StructureError on unclosed, nested or stray tags or a 1-path block.

    ``<Summary>`` is checked too (closed, not nested, not inside a block) although it does not change the mask:
    a text with a broken summary is malformed data.
    """
    end = len(text) if end is None else end
    blocks: list[BlockSpan] = []
    block_at = path_at = summary_at = -1  # char offset of the currently open tag, -1 when closed
    open_end = region_start = content_start = -1
    paths: list[PathSpan] = []

    def fail(message: str, at: int) -> StructureError:
        return StructureError(f"{message} at {_where(text, start, at)}")

    def the(tag: str, opened_at: int) -> str:
        return f"the {tag} opened at assistant char {opened_at - start}"

    for match in TAG_PATTERN.finditer(text, start, end):
        tag, at = match.group(), match.start()
        if tag == OPEN_BLOCK:
            if path_at >= 0:
                raise fail(f"nested {OPEN_BLOCK} inside {the(OPEN_PATH, path_at)}", at)
            if block_at >= 0:
                raise fail(f"nested {OPEN_BLOCK} inside {the(OPEN_BLOCK, block_at)}", at)
            if summary_at >= 0:
                raise fail(f"{OPEN_BLOCK} inside {the(OPEN_SUMMARY, summary_at)}", at)
            block_at, open_end, region_start, paths = at, match.end(), match.end(), []
        elif tag == OPEN_PATH:
            if block_at < 0:
                raise fail(f"{OPEN_PATH} outside a {OPEN_BLOCK} block", at)
            if path_at >= 0:
                raise fail(f"nested {OPEN_PATH} inside {the(OPEN_PATH, path_at)}", at)
            path_at, content_start = at, match.end()
        elif tag == CLOSE_PATH:
            if block_at < 0:
                raise fail(f"{CLOSE_PATH} outside a {OPEN_BLOCK} block", at)
            if path_at < 0:
                raise fail(f"{CLOSE_PATH} without an open {OPEN_PATH}", at)
            paths.append(PathSpan(region_start, content_start, at, match.end()))
            path_at, region_start = -1, match.end()
        elif tag == CLOSE_BLOCK:
            if block_at < 0:
                raise fail(f"{CLOSE_BLOCK} without an open {OPEN_BLOCK}", at)
            if path_at >= 0:
                raise fail(f"{CLOSE_BLOCK} while {the(OPEN_PATH, path_at)} is unclosed", at)
            if len(paths) < 2:
                raise fail(f"{the(OPEN_BLOCK, block_at)} has {len(paths)} path(s), needs at least 2; closed", at)
            blocks.append(BlockSpan(block_at, open_end, tuple(paths), match.end()))
            block_at = -1
        elif tag == OPEN_SUMMARY:
            if block_at >= 0:
                raise fail(f"{OPEN_SUMMARY} inside {the(OPEN_BLOCK, block_at)}", at)
            if summary_at >= 0:
                raise fail(f"nested {OPEN_SUMMARY} inside {the(OPEN_SUMMARY, summary_at)}", at)
            summary_at = at
        else:  # CLOSE_SUMMARY
            if summary_at < 0:
                raise fail(f"{CLOSE_SUMMARY} without an open {OPEN_SUMMARY}", at)
            summary_at = -1
    for opened, tag in ((path_at, OPEN_PATH), (block_at, OPEN_BLOCK), (summary_at, OPEN_SUMMARY)):
        if opened >= 0:
            raise fail(f"unclosed {tag} (the assistant text ends before its closing tag); opened", opened)
    return blocks


def token_structure(text: str, offsets: np.ndarray, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-token (block_ids, path_ids), int16, for a rendered sequence.

    `offsets` [n, 2]: the tokenizer's character offsets into `text`; `spans`: character spans of the trained
    assistant texts (tags elsewhere, e.g. in the prompt, are ignored). Block ids count 1.. over the sequence.
    Raises StructureError (never an index error) for malformed tags or a tokenization that merges across them.
    """
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    n = len(offsets)
    block_ids = np.zeros(n, dtype=np.int16)
    path_ids = np.zeros(n, dtype=np.int16)
    blocks: list[BlockSpan] = []
    span_of_block: list[tuple[int, int]] = []
    previous_end = 0
    for span_start, span_end in sorted((int(a), int(b)) for a, b in spans):
        if not previous_end <= span_start <= span_end <= len(text):
            raise StructureError(f"assistant span ({span_start}, {span_end}) overlaps another span or lies outside "
                                 f"the text of length {len(text)}")
        previous_end = span_end
        found = parse_blocks(text, span_start, span_end)
        blocks.extend(found)
        span_of_block.extend([(span_start, span_end)] * len(found))
    if not blocks:
        return block_ids, path_ids
    if len(blocks) > MAX_ID or max(len(b.paths) for b in blocks) > MAX_ID:
        raise StructureError(f"too many blocks or paths for int16 ids ({len(blocks)} blocks)")

    # Region boundaries in char order, each with the (block, path) label of the text from there on.
    bounds, labels = [], []
    for b, block in enumerate(blocks, start=1):
        bounds.append(block.start), labels.append((b, 0))
        for p, path in enumerate(block.paths, start=1):
            bounds.append(path.region_start), labels.append((b, p))
        bounds.append(block.paths[-1].region_end), labels.append((b, 0))
        bounds.append(block.end), labels.append((0, 0))
    bounds_arr = np.asarray(bounds, dtype=np.int64)
    labels_arr = np.asarray(labels, dtype=np.int16)
    starts = offsets[:, 0]
    region = np.searchsorted(bounds_arr, starts, side="right") - 1  # equal bounds: the later label wins
    inside = region >= 0
    block_ids[inside] = labels_arr[region[inside], 0]
    path_ids[inside] = labels_arr[region[inside], 1]

    # The token holding a path's first content character must belong to that path (no cross-tag merges).
    order = np.argsort(starts, kind="stable")
    sorted_starts = starts[order]
    for b, (block, (span_start, _)) in enumerate(zip(blocks, span_of_block), start=1):
        for p, path in enumerate(block.paths, start=1):
            if path.content_start == path.content_end:
                continue
            k = np.searchsorted(sorted_starts, path.content_start, side="right") - 1
            if k < 0:
                continue
            t = order[k]
            if offsets[t, 1] > path.content_start and (block_ids[t], path_ids[t]) != (b, p):
                raise StructureError(
                    f"token {t} (chars {offsets[t, 0]}..{offsets[t, 1]}) merges text across the {OPEN_PATH} tag of "
                    f"path {p} of block {b} at {_where(text, span_start, path.content_start)}; "
                    "this tokenizer cannot isolate the paths"
                )
    validate_structure(block_ids, path_ids)
    return block_ids, path_ids


@dataclass(frozen=True)
class _Runs:
    """Maximal runs of tokens with the same nonzero (block, path), grouped by block."""

    start: np.ndarray  # per run: first token index
    end: np.ndarray  # per run: one past the last token index
    group_first: np.ndarray  # per block group: index of its first run
    group_last: np.ndarray  # per block group: index of its last run


def _path_runs(block_ids: np.ndarray, path_ids: np.ndarray) -> _Runs:
    """Runs of path tokens, checked: each block's paths are 1..P (P >= 2) in order, contiguous, one run each."""
    block = np.asarray(block_ids, dtype=np.int64)
    path = np.asarray(path_ids, dtype=np.int64)
    if block.shape != path.shape or block.ndim != 1:
        raise StructureError(f"block_ids {block.shape} and path_ids {path.shape} must be 1-D of the same length")
    n = len(block)
    in_path = path > 0
    if (path < 0).any() or (block < 0).any():
        raise StructureError("negative block or path id")
    if (in_path & (block == 0)).any():
        raise StructureError(f"token {int(np.flatnonzero(in_path & (block == 0))[0])} has a path id but no block id")
    empty = np.zeros(0, dtype=np.int64)
    if not in_path.any():
        return _Runs(empty, empty, empty, empty)
    same_as_prev = np.zeros(n, dtype=bool)
    same_as_prev[1:] = in_path[:-1] & (block[1:] == block[:-1]) & (path[1:] == path[:-1])
    run_start = np.flatnonzero(in_path & ~same_as_prev)
    last_of_run = np.zeros(n, dtype=bool)
    last_of_run[:-1] = in_path[:-1] & ~same_as_prev[1:]
    last_of_run[-1] = in_path[-1]
    run_end = np.flatnonzero(last_of_run) + 1
    run_block, run_path = block[run_start], path[run_start]

    new_group = np.ones(len(run_start), dtype=bool)
    new_group[1:] = run_block[1:] != run_block[:-1]
    group_first = np.flatnonzero(new_group)
    group_last = np.append(group_first[1:] - 1, len(run_start) - 1)
    group_block = run_block[group_first]
    unique_blocks, counts = np.unique(group_block, return_counts=True)
    if (counts > 1).any():
        dup = int(unique_blocks[counts > 1][0])
        raise StructureError(f"the paths of block {dup} are not contiguous (another block's paths lie between them)")
    expected = np.arange(len(run_start)) - np.repeat(group_first, group_last - group_first + 1) + 1
    bad = np.flatnonzero(run_path != expected)
    if len(bad):
        r = int(bad[0])
        raise StructureError(
            f"block {int(run_block[r])}: path {int(run_path[r])} at token {int(run_start[r])} where path "
            f"{int(expected[r])} was expected (paths must be 1..P in order, one contiguous run each)"
        )
    n_paths = group_last - group_first + 1
    if (n_paths < 2).any():
        g = int(np.flatnonzero(n_paths < 2)[0])
        raise StructureError(f"block {int(group_block[g])} has a single path; a block needs at least 2")
    gap = run_start[1:] != run_end[:-1]  # between consecutive runs
    within = ~new_group[1:]
    if (gap & within).any():
        r = int(np.flatnonzero(gap & within)[0]) + 1
        raise StructureError(
            f"block {int(run_block[r])}: token(s) outside every path between its paths at token {int(run_end[r - 1])}"
        )
    if (~gap & ~within).any():
        r = int(np.flatnonzero(~gap & ~within)[0]) + 1
        raise StructureError(
            f"block {int(run_block[r])} starts at token {int(run_start[r])} right after the last path of block "
            f"{int(run_block[r - 1])} with no token in between"
        )
    return _Runs(run_start, run_end, group_first, group_last)


def validate_structure(block_ids: np.ndarray, path_ids: np.ndarray) -> None:
    """Raise StructureError unless the ids satisfy what `position_ids` and the attention mask rely on."""
    _path_runs(block_ids, path_ids)


def position_ids(block_ids: np.ndarray, path_ids: np.ndarray) -> np.ndarray:
    """int64 positions of ONE packed sequence (starting at 0) under Parallel-R1's rule (see the module doc)."""
    runs = _path_runs(block_ids, path_ids)
    n = len(block_ids)
    step = np.ones(n, dtype=np.int64)  # position[i] - position[i-1]; position[-1] := -1
    if len(runs.start):
        length = runs.end - runs.start
        not_first = np.ones(len(runs.start), dtype=bool)
        not_first[runs.group_first] = False
        # path k >= 2 restarts at B + 1, one past the position B + len(k-1) of the previous path's last token
        step[runs.start[not_first]] = 1 - length[np.flatnonzero(not_first) - 1]
        longest = np.maximum.reduceat(length, runs.group_first)
        after = runs.end[runs.group_last]
        keep = after < n
        # the first token after the last path is at B + longest + 1; the last path's last token is at B + len(P)
        step[after[keep]] = (longest + 1 - length[runs.group_last])[keep]
    return np.cumsum(step) - 1
