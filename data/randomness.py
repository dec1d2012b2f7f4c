"""Per-record randomness that any worker can compute on its own: a uniform draw from (seed, stream, record index,
copy), so that a decision about a record never depends on how many records came before it in one sequential
stream. Stages that read their input by ranges decide each range's records where they are read; the results do
not depend on the ranges, the worker count or the engine.

The draw is a counter-based hash (SplitMix64's finalizer over the four keys, chained), vectorized over numpy
arrays of record indices. Distinct streams give independent draws for the same record (merge's join draw,
sample's fractional choice, eval choice and output order).
"""
from __future__ import annotations

import numpy as np

MERGE_JOIN = 1  # does record i try to join the group before it
SAMPLE_FRACTION = 2  # the fractional copy of a category: the records with the smallest keys
SAMPLE_EVAL = 3  # the eval split: the records with the smallest keys of each category
SAMPLE_ORDER = 4  # sampled.jsonl's order: (record, copy) pairs sorted by key
PACK_PARTITION = 5  # the seed of pack's partition k (tie-breaking, row and in-row order): the key of index k
PACK_LEFTOVERS = 6  # the seed of pack's global pass over the rows the partitions released: the key of index 0
# pack's accounting check hashes what it compares (pack.SequenceTally): record indices, (index, length), uids
PACK_CHECK_RECORDS = 7
PACK_CHECK_LENGTHS = 8
PACK_CHECK_UIDS = 9
PACK_LAYER = 10  # the seed of pack's copy layer l >= 1 within a plan (layer 0 plans with the plan's own seed)
# pack's duplicate-row count hashes each row's sequences (their ordered source uids, or their tokenized row)
PACK_ROW_SEQUENCE = 11
PACK_ROW_UNNAMED = 12
PACK_ROW_KEY = 13

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer (a bijection of uint64 with good avalanche), in place on a uint64 array."""
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def record_keys(seed: int, stream: int, index, copy=0) -> np.ndarray:
    """uint64 keys, one per record index (an int or an array), uniform over [0, 2^64) and independent across
    `seed`, `stream`, `index` and `copy` (an int or an array broadcast with `index`)."""
    index = np.asarray(index, dtype=np.uint64)
    copy = np.asarray(copy, dtype=np.uint64)
    with np.errstate(over="ignore"):
        key = _mix(np.full(np.broadcast(index, copy).shape, np.uint64(seed & (2 ** 64 - 1)), dtype=np.uint64)
                   + _GOLDEN * np.uint64(stream + 1))
        key = _mix(key ^ (index * _GOLDEN + np.uint64(1)))
        key = _mix(key ^ (copy * _GOLDEN + np.uint64(2)))
    return key


def record_uniforms(seed: int, stream: int, index, copy=0) -> np.ndarray:
    """float64 draws in [0, 1) from `record_keys` (their top 53 bits)."""
    return (record_keys(seed, stream, index, copy) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
