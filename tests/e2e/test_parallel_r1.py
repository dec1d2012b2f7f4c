"""End to end on the real Parallel-R1 cold-start data: data pipeline in structure mode -> packed shards -> trainer.

configs/data/parallel_r1.json runs every stage on ../shared/fixtures/data/parallel_r1_gsm8k_sft_train.parquet
(341 rows, one with an unclosed <Summary>) with the Qwen2.5 tokenizer; configs/train/parallel_r1.yaml trains the
tiny Qwen2 of configs/model/tiny_qwen2_qwen_vocab.json on the packed output.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import orjson
import pytest

from data.shards.dataset import Structure
import torch

from tests._train_helpers import in_project_root
from tests.conftest import ROOT, fixture_path, tokenizer_dir

DATA_CONFIG = ROOT / "configs" / "data" / "parallel_r1.json"
TRAIN_CONFIG = ROOT / "configs" / "train" / "parallel_r1.yaml"
N_ROWS = 341
TAG_PAIRS = (("<Parallel>", "</Parallel>"), ("<Path>", "</Path>"), ("<Summary>", "</Summary>"))
IGNORE_INDEX = -100
MALFORMED_UID = 327  # the one row with unbalanced tags (an unclosed <Summary>), checked from the raw text below


def _raw_outputs() -> list[str]:
    import pyarrow.parquet as pq

    path = fixture_path("data", "parallel_r1_gsm8k_sft_train.parquet")
    return [row["output"] for row in pq.read_table(path, columns=["output"]).to_pylist()]


def _malformed(text: str) -> bool:
    """Unbalanced tags, decided from the raw text alone (independent of data.shards.parallel_thinking)."""
    return any(text.count(open_tag) != text.count(close_tag) for open_tag, close_tag in TAG_PAIRS)


@pytest.fixture(scope="module")
def raw_outputs() -> list[str]:
    return _raw_outputs()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir("qwen2_5_instruct"))


@pytest.fixture(scope="module")
def pipeline_cfg(tmp_path_factory):
    """The whole pipeline run once with the shipped config (on_error: skip), output in a temp dir."""
    fixture_path("data", "parallel_r1_gsm8k_sft_train.parquet")
    tokenizer_dir("qwen2_5_instruct")
    from data.config import load_config
    from data.pipeline import run_pipeline

    out = tmp_path_factory.mktemp("parallel_r1") / "data"
    with in_project_root():
        cfg = load_config(DATA_CONFIG, [f"output_dir={out}", "num_workers=1"])
        cfg.validate()
        run_pipeline(cfg)
    return cfg


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _sequences_by_uid(path) -> dict[int, dict[str, np.ndarray]]:
    """uid -> token fields of its (single-record) sequence, over every row of an indexed dataset."""
    from data.shards.dataset import PackedDataset

    ds = PackedDataset(path)
    out = {}
    for i in range(len(ds)):
        row = ds[i]
        bounds = np.concatenate([[0], np.cumsum(row["seq_lens"])])
        for k, uids in enumerate(ds.row_uids(i)):
            assert len(uids) == 1, "merge probability is 0: one record per sequence"
            lo, hi = int(bounds[k]), int(bounds[k + 1])
            out[int(uids[0])] = {f: row[f][lo:hi] for f in ds.token_fields}
    return out


# ---------------------------------------------------------------------------------------------- (a) accounting
def test_pipeline_accounts_for_every_row(pipeline_cfg, raw_outputs):
    assert len(raw_outputs) == N_ROWS
    assert [i for i, text in enumerate(raw_outputs) if _malformed(text)] == [MALFORMED_UID]
    report = orjson.loads(pipeline_cfg.report_path.read_bytes())
    for stage in ("preprocess", "sample", "merge", "tokenize", "pack"):
        assert stage in report, f"report.json has no {stage!r} section: {sorted(report)}"
        section = report[stage]
        assert (section["in"], section["out"], section["dropped"]) == (N_ROWS, N_ROWS, {}), (stage, section)
    # the malformed row is kept (as plain text) and counted, not dropped
    assert report["tokenize"]["structure_kept_plain"] == 1
    assert report["pack"]["trace"]["every_record_once"] is True

    from data.shards.dataset import PackedDataset

    packed = PackedDataset(pipeline_cfg.packed_dir)
    assert {"block_ids", "path_ids"} <= set(packed.token_fields)
    assert sorted(int(u) for u in packed.all_uids) == list(range(N_ROWS))
    assert int(np.sum(packed.row_n_seqs)) == N_ROWS


def test_malformed_row_is_plain_text_and_the_others_structured(pipeline_cfg, raw_outputs, tokenizer):
    by_uid = _sequences_by_uid(pipeline_cfg.packed_dir)
    assert sorted(by_uid) == list(range(N_ROWS))
    for uid, text in enumerate(raw_outputs):
        seq = by_uid[uid]
        n_blocks = text.count("<Parallel>")
        if _malformed(text):
            assert not seq["block_ids"].any() and not seq["path_ids"].any(), f"uid {uid}: malformed but structured"
            trained = _decode(tokenizer, seq["input_ids"][seq["labels"] != IGNORE_INDEX])
            assert text in trained, f"uid {uid}: the malformed record's text is not trained as plain text"
        else:
            assert int(seq["block_ids"].max()) == n_blocks, f"uid {uid}: {n_blocks} blocks in the raw text"


def test_on_error_error_names_the_malformed_record(pipeline_cfg, tmp_path):
    from data import tokenize
    from data.config import load_config
    from data.records import RecordError

    shutil.copy(pipeline_cfg.merged_path, tmp_path / "merged.jsonl")
    lines = pipeline_cfg.merged_path.read_bytes().splitlines()
    line = 1 + next(i for i, raw in enumerate(lines) if orjson.loads(raw)["meta"]["uid"] == MALFORMED_UID)
    with in_project_root():
        cfg = load_config(DATA_CONFIG, [f"output_dir={tmp_path}", "on_error=error", "num_workers=1"])
        cfg.stages = ["tokenize"]
        cfg.validate()
        with pytest.raises(RecordError) as info:
            tokenize.run(cfg)
    message = str(info.value)
    assert f"merged.jsonl:{line} (from ../shared/fixtures/data/parallel_r1_gsm8k_sft_train.parquet:{MALFORMED_UID}): " \
           "structure:" in message, message  # names the raw row too
    assert "<Summary>" in message, message
    assert not (tmp_path / "tokenized").exists(), "a failed tokenize stage must not leave an output"


# ---------------------------------------------------------------------------------------------- (b) ids
def test_block_and_path_ids_decode_to_the_tagged_text(pipeline_cfg, raw_outputs, tokenizer):
    """For the records of the first packed rows: the tokens of block b / path p decode to exactly the raw text
    between that block's (path's) tags, found in the raw parquet text with a regex."""
    from data.shards.dataset import PackedDataset

    packed = PackedDataset(pipeline_cfg.packed_dir)
    checked = 0
    for i in range(2):
        row = packed[i]
        bounds = np.concatenate([[0], np.cumsum(row["seq_lens"])])
        for k, uids in enumerate(packed.row_uids(i)):
            text = raw_outputs[int(uids[0])]
            if _malformed(text) or "<Parallel>" not in text:
                continue
            lo, hi = int(bounds[k]), int(bounds[k + 1])
            ids, block, path = row["input_ids"][lo:hi], row["block_ids"][lo:hi], row["path_ids"][lo:hi]
            raw_blocks = re.findall(r"<Parallel>(.*?)</Parallel>", text, flags=re.S)
            assert int(block.max()) == len(raw_blocks)
            for b, raw_block in enumerate(raw_blocks, start=1):
                in_block = np.flatnonzero(block == b)
                assert np.all(np.diff(in_block) == 1), f"block {b} is not contiguous"
                decoded = _decode(tokenizer, ids[in_block])
                # a tokenizer may fuse the closing '>' with the next newline: only whitespace may trail
                assert decoded.startswith("<Parallel>" + raw_block + "</Parallel>"), decoded
                assert decoded[len("<Parallel>" + raw_block + "</Parallel>"):].strip() == ""
                raw_paths = re.findall(r"<Path>(.*?)</Path>", raw_block, flags=re.S)
                assert int(path[in_block].max()) == len(raw_paths) >= 2
                for p, raw_path in enumerate(raw_paths, start=1):
                    path_text = _decode(tokenizer, ids[(block == b) & (path == p)])
                    match = re.fullmatch(r"(\s*)<Path>(.*)</Path>(\s*)", path_text, flags=re.S)
                    assert match is not None, f"block {b} path {p}: {path_text!r}"
                    assert match.group(2) == raw_path
                shared = _decode(tokenizer, ids[(block == b) & (path == 0)])
                assert shared.startswith("<Parallel>") and "</Parallel>" in shared, shared
            checked += 1
    assert checked >= 4, "too few structured records in the first packed rows"


# ---------------------------------------------------------------------------------------------- (c) trainer
def _first_step_losses(cfg) -> dict[str, float]:
    """Loss of step 1's micro-batch at the trainer's initial weights (same model, same rows) with the Parallel-R1
    position ids and/or attention mask switched on: `structured` (both), `positions_only`, `mask_only`, `plain`."""
    from train.attention.function import AttentionContext
    from train.steps.batch import make_batch
    from train.trainer import Trainer

    trainer = Trainer(cfg, console=lambda *_: None)
    try:
        plan = trainer.sampler.plan(0)
        assert len(plan.micro_batches) == 1
        rows = [trainer.dataset[r] for r in plan.micro_batches[0].rows]
        structured = make_batch(rows, plan.totals, cfg.steps.loss_reduction, structure=Structure.PARALLEL_THINKING)
        plain = make_batch(rows, plan.totals, cfg.steps.loss_reduction)
        assert not torch.equal(structured.position_ids, plain.position_ids)
        ids = {k: getattr(structured, k) for k in ("seq_ids", "block_ids", "path_ids")}
        variants = {"structured": (structured, ids), "positions_only": (structured, {}),
                    "mask_only": (plain, ids), "plain": (plain, {})}
        losses = {}
        with torch.no_grad():
            for name, (batch, mask_ids) in variants.items():
                kernels = trainer.plan.attention.train if mask_ids else trainer.plan.attention.packed  # the mask, or none
                attn = AttentionContext(cu_seqlens=batch.cu_seqlens, max_seqlen=batch.max_seqlen,
                                        kernels=kernels, **mask_ids)
                weighted, _, _ = trainer.model(batch.input_ids, batch.position_ids, batch.targets,
                                               batch.weights, batch.target_categories, attn)
                losses[name] = float(weighted)
    finally:
        trainer.metrics.close()
    return losses


def test_trainer_trains_with_structured_attention(pipeline_cfg, tmp_path):
    out = tmp_path / "train"
    args = [f"data_path={pipeline_cfg.packed_dir}", f"output_dir={out}", "max_steps=3"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-m", "train", str(TRAIN_CONFIG), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    from train.config.sections import load_config
    from train.metrics import read_log

    log = read_log(out)
    assert [r["step"] for r in log] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 and r["loss_tokens"] > 0 for r in log), log
    assert (out / "final" / "config.json").is_file()

    # The logged step-1 loss is the one with the Parallel-R1 positions AND mask: a trainer missing either (or both)
    # logs one of the other variants, each measurably different (the runs are deterministic on CPU).
    with in_project_root():
        cfg = load_config(TRAIN_CONFIG, [*args[:1], f"output_dir={tmp_path / 'probe'}", "max_steps=3"])
        losses = _first_step_losses(cfg)
    tolerance = 1e-5
    for name in ("positions_only", "mask_only", "plain"):
        assert abs(losses[name] - losses["structured"]) > 100 * tolerance, losses
    assert log[0]["loss"] == pytest.approx(losses["structured"], abs=tolerance), (log[0]["loss"], losses)
