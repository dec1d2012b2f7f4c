"""`stepwise: samples | tree` end to end on the reasoning + tool-use fixture with the Qwen3 tokenizer (a template that
drops the reasoning of earlier turns, so the steps' renders diverge): data pipeline -> packed shards -> Trainer.

- samples: sequence k is the chat template's own rendering of the messages up to assistant turn k, loss on that
  turn only, and its loss equals transformers' unpacked forward of each rendered step;
- tree: the same samples as prefix trees; training on the tree rows equals training on the samples rows (loss,
  per-category loss, gradients; fp32 on CPU, 1e-6) through the Trainer's start-up and one optimizer step under
  gradient accumulation; under every loss reduction the tree's batch trains the samples' (context, target) pairs
  with the same weights; and the tree mask matters (a plain causal mask differs);
- report.json: the tree run's counts are the samples run's, plus the tokens the trees saved.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import orjson
import pytest

from data.shards.dataset import Structure
import torch

from tests._train_helpers import write_config
from tests.conftest import fixture_path, tokenizer_dir

LINES = (10, 41)  # fixture records with 4 and 2 trained assistant turns (tool loops, a second user query)
MAX_LENGTH = 1024  # every step fits; the rows are few and short, so a step spans several micro-batches
IGNORE = -100
TOL = 1e-6


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    actual, expected = actual.double(), expected.double()
    scale = max(1.0, float(expected.abs().max()))
    err = float((actual - expected).abs().max())
    assert err <= TOL * scale, f"{what}: max abs diff {err:.3g} > {TOL} x {scale:.3g}"


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory):
    """The pipeline run on a few fixture records with stepwise samples and tree (Qwen3 tokenizer)."""
    root = tmp_path_factory.mktemp("stepwise")
    lines = fixture_path("data", "llamafactory_reason_tool_use_demo_50.jsonl").read_bytes().splitlines()
    subset = root / "subset.jsonl"
    subset.write_bytes(b"\n".join(lines[i] for i in LINES) + b"\n")
    return build_samples_and_tree(root, [{"path": str(subset), "format": "messages", "category_name": "reason_tool"}],
                                  tokenizer_dir("qwen3"), MAX_LENGTH)


def build_samples_and_tree(root, inputs: list[dict], tokenizer, max_length: int) -> dict:
    """{mode: DataConfig} of the data pipeline run on `inputs` with stepwise samples (every stage) and tree (tokenize
    and pack again on the samples run's merged.jsonl), under `root`/samples and `root`/tree."""
    from common.config import from_dict
    from data.config import DataConfig
    from data.pipeline import run_pipeline

    cfgs = {}
    for mode in ("samples", "tree"):
        raw = {"inputs": inputs, "output_dir": str(root / mode), "tokenizer_path": str(tokenizer), "num_workers": 1,
               "max_length": max_length, "stepwise": mode, "merge": {"probability": 0.0},
               "pack": {"max_length": max_length}}
        if mode == "tree":
            shutil.copytree(root / "samples", root / mode, ignore=shutil.ignore_patterns("tokenized", "packed"))
            raw["stages"] = ["tokenize", "pack"]
        cfg = from_dict(DataConfig, raw)
        cfg.validate()
        run_pipeline(cfg)
        cfgs[mode] = cfg
    return cfgs


@pytest.fixture(scope="module")
def qwen3():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir("qwen3"))


def _sequences(path):
    """[(uid, token fields)] of every sequence of a dataset, in order."""
    from data.shards.dataset import PackedDataset

    ds = PackedDataset(path)
    out = []
    for i in range(len(ds)):
        row = ds[i]
        bounds = np.concatenate([[0], np.cumsum(row["seq_lens"])])
        for k, uids in enumerate(ds.row_uids(i)):
            out.append((int(uids[0]), {f: row[f][bounds[k]:bounds[k + 1]] for f in ds.token_fields}))
    return out


# ---------------------------------------------------------------------------------------------- data
def test_report_counts_are_the_expansions(data_dirs):
    reports = {m: orjson.loads(cfg.report_path.read_bytes()) for m, cfg in data_dirs.items()}
    samples, tree = reports["samples"]["tokenize"], reports["tree"]["tokenize"]
    s_step, t_step = samples.pop("stepwise"), tree.pop("stepwise")
    assert samples == tree  # in/out, tokens, loss tokens, turns, categories, fidelity: the expansion's
    assert samples["in"] == samples["out"] == samples["trained_turns"] == 4 + 2
    assert s_step == {"mode": "samples", "records": 2, "samples": 6, "samples_kept": 6, "sequences": 6,
                      "sample_tokens": samples["tokens"], "tokens_stored": samples["tokens"], "tokens_saved": 0}
    assert t_step["sequences"] == 2 and t_step["sample_tokens"] == samples["tokens"]
    assert 0 < t_step["tokens_stored"] < samples["tokens"]
    assert t_step["tokens_saved"] == samples["tokens"] - t_step["tokens_stored"]
    from data.shards.dataset import PackedDataset

    packed = {m: PackedDataset(cfg.packed_dir) for m, cfg in data_dirs.items()}
    for column in ("row_n_loss_tokens", "row_n_trained_turns", "row_n_samples"):
        assert int(np.sum(getattr(packed["tree"], column))) == int(np.sum(getattr(packed["samples"], column)))
    assert int(np.sum(packed["tree"].row_n_tokens)) == t_step["tokens_stored"]
    assert "tree_spans" in packed["tree"].token_fields and "tree_spans" not in packed["samples"].token_fields
    stats = orjson.loads((data_dirs["tree"].packed_dir / "stats.json").read_bytes())
    assert stats["stepwise"] == t_step and stats["tokens"] == t_step["tokens_stored"]


def test_samples_are_the_templates_rendering_of_each_step(data_dirs, qwen3):
    """Sequence k of a record = apply_chat_template(messages up to assistant turn k), loss on turn k exactly."""
    from data.tokenize import stepwise_records, template_inputs

    records = {}
    for line in data_dirs["samples"].merged_path.read_bytes().splitlines():
        rec = orjson.loads(line)
        records[rec["meta"]["uid"]] = rec
    seqs = _sequences(data_dirs["samples"].tokenized_dir)
    header = qwen3.encode("<|im_start|>assistant\n", add_special_tokens=False)
    end = qwen3.convert_tokens_to_ids("<|im_end|>")
    step_of: dict[int, int] = {}
    previous: dict[int, list] = {}
    diverged = 0
    for uid, seq in seqs:
        k = step_of[uid] = step_of.get(uid, -1) + 1
        steps = stepwise_records(records[uid], "test")
        messages, kwargs = template_inputs(steps[k])
        for m in messages:  # the canonical record may hold JSON-string arguments; the stage parses them
            for call in m.get("tool_calls") or ():
                if isinstance(call["function"].get("arguments"), str):
                    call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        expected = qwen3.apply_chat_template(messages, tokenize=True, **kwargs)["input_ids"]
        assert seq["input_ids"].tolist() == list(expected), f"uid {uid} step {k}"
        ids = seq["input_ids"].tolist()
        starts = [i + len(header) for i in range(len(ids)) if ids[i:i + len(header)] == header]
        last_end = max(i for i, t in enumerate(ids) if t == end)
        trained = np.flatnonzero(seq["labels"] != IGNORE)
        assert trained.tolist() == list(range(starts[-1], last_end + 1)), f"uid {uid} step {k}: loss on turn k only"
        assert set(seq["turn_ids"][trained].tolist()) == {1}
        if k > 0:
            diverged += ids[:len(previous[uid])] != previous[uid]
        previous[uid] = ids
    assert sorted(step_of.values()) == [1, 3]
    # a step after a new user query re-renders the earlier turns without their reasoning (its render diverges from
    # the previous step's); a step inside a tool loop keeps it (the previous step is a prefix): both occur here
    assert 0 < diverged < 4, diverged


def test_tree_paths_are_the_samples(data_dirs):
    from data.shards.prefix_tree import tree_parents, tree_positions

    samples: dict[int, list] = {}
    for uid, seq in _sequences(data_dirs["samples"].tokenized_dir):
        samples.setdefault(uid, []).append(tuple(seq["input_ids"].tolist()))
    trees = _sequences(data_dirs["tree"].tokenized_dir)
    assert sorted(uid for uid, _ in trees) == sorted(samples)
    for uid, tree in trees:
        parent = tree_parents(tree["tree_spans"])
        depth = tree_positions(tree["tree_spans"])
        leaves = np.setdiff1d(np.arange(len(parent)), parent[parent >= 0])
        got = []
        for leaf in leaves:
            chain, x = [], int(leaf)
            while x >= 0:
                chain.append(x)
                x = int(parent[x])
            chain.reverse()
            assert depth[chain].tolist() == list(range(len(chain)))
            got.append(tuple(tree["input_ids"][chain].tolist()))
        assert sorted(got) == sorted(samples[uid])


# ---------------------------------------------------------------------------------------------- trainer
def _trainer(tmp, name, data_cfg, console=lambda *_: None, **values):
    from train.config.sections import load_config
    from train.trainer import Trainer

    model_config = tmp / "tiny_qwen_vocab.json"
    if not model_config.exists():
        model_config.write_text(json.dumps({
            "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 8192, "initializer_range": 0.1, "tie_word_embeddings": True,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "use_cache": False}))
    cfg = write_config(tmp / f"{name}.yaml", model_config=str(model_config),
                       tokenizer_path=str(tokenizer_dir("qwen3")), data_path=str(data_cfg.packed_dir),
                       output_dir=str(tmp / f"out_{name}"), lr=1e-3, max_grad_norm=0.0, loss_chunk_size=256,
                       attn_backend="sdpa", bf16=False, plot=False, max_steps=1, seed=7, save_steps=0,
                       log_backends=[], **values)
    return Trainer(load_config(cfg), console=console)


def _all_rows_batch(trainer, reduction: str):
    from train.steps.batch import make_batch, step_totals

    rows = list(range(len(trainer.dataset)))
    return make_batch([trainer.dataset[r] for r in rows], step_totals(trainer.dataset, rows), reduction,
                      structure=trainer.plan.data.structure)


def _weighted_targets(batch) -> list[tuple]:
    """Sorted (context tokens, target, category, weight) of every trained target of a micro-batch: the context is
    the token path that predicts the target (a tree token's ancestors and itself, else its sequence's prefix)."""
    from data.shards.prefix_tree import tree_parents

    ids = batch.input_ids[0].numpy()
    cu = batch.cu_seqlens.numpy()
    targets, weights, cats = batch.targets.numpy(), batch.weights.numpy(), batch.target_categories.numpy()
    out = []
    for lo, hi in zip(cu[:-1], cu[1:]):
        parent = (tree_parents(batch.tree_spans[lo:hi].numpy()) if batch.tree_spans is not None
                  else np.arange(-1, hi - lo - 1))
        for t in np.flatnonzero(targets[lo:hi] != IGNORE):
            chain, x = [], int(t)
            while x >= 0:
                chain.append(x)
                x = int(parent[x])
            out.append((tuple(ids[lo:hi][chain[::-1]].tolist()), int(targets[lo + t]), int(cats[lo + t]),
                        float(weights[lo + t])))
    return sorted(out)


def _tree_loss_under_plain_mask(trainer) -> float:
    from train.attention.function import AttentionContext

    batch = _all_rows_batch(trainer, "token")
    # tree positions, but every token sees every earlier token of its sequence: the structured kernel without spans
    attn = AttentionContext.for_micro_batch(batch.cu_seqlens, trainer.device, trainer.plan.attention.train,
                                            seq_ids=batch.seq_ids, block_ids=batch.block_ids, path_ids=batch.path_ids)
    with torch.no_grad():
        return float(trainer.model(batch.input_ids, batch.position_ids, batch.targets, batch.weights,
                                   batch.target_categories, attn)[0])


def _unpacked_reference(trainer, data_cfg) -> tuple[float, dict[int, float]]:
    """Token-mean loss (and per-category) of the samples by transformers' own unpacked forward of each sequence
    (eager attention, positions 0..n-1), the head applied in chunks to the trained positions."""
    total, count = 0.0, 0
    per_cat: dict[int, list[float]] = {}
    with torch.no_grad(), trainer.model.unpacked():
        lm = trainer.lm  # the transformers model, its own eager attention
        for _, seq in _sequences(data_cfg.tokenized_dir):
            ids = torch.from_numpy(seq["input_ids"].astype(np.int64))[None]
            hidden = lm.model(input_ids=ids).last_hidden_state[0]
            labels = torch.from_numpy(seq["labels"].astype(np.int64))
            where = torch.nonzero(labels[1:] != IGNORE).flatten()  # position t predicts label t + 1
            for chunk in where.split(256):
                logits = lm.lm_head(hidden[chunk]).float()
                losses = torch.nn.functional.cross_entropy(logits, labels[chunk + 1], reduction="none")
                total += float(losses.double().sum())
                count += len(chunk)
                for c, loss in zip(seq["category_ids"][(chunk + 1).numpy()].tolist(), losses.tolist()):
                    per_cat.setdefault(c, []).append(loss)
    return total / count, {c: float(np.mean(v)) for c, v in per_cat.items()}


def test_tree_rows_train_exactly_as_samples_rows(data_dirs, tmp_path):
    torch.set_num_threads(1)
    said: list[str] = []
    trainers = {m: _trainer(tmp_path, m, data_dirs[m], console=said.append, grad_accum=6, micro_batch_rows=1,
                            loss_reduction="token") for m in ("samples", "tree")}
    try:
        s, t = trainers["samples"], trainers["tree"]
        assert t.plan.data.structure is Structure.TREE and "tree_spans" in t.dataset.token_fields
        # the start-up self-check ran a branching tree of the data against transformers on its paths, and would
        # have failed under the plain causal kernels
        assert sum("tree = its paths" in line for line in said) == 1, said
        from train.model.self_check import compare_tree_with_reference, self_check_tree

        cut = self_check_tree(t.dataset)
        assert cut is not None and compare_tree_with_reference(t.model, *cut, t.plan.attention.train).ok
        assert not compare_tree_with_reference(t.model, *cut, t.plan.attention.packed).ok
        for (name, a), b in zip(s.model.named_parameters(), t.model.parameters()):
            assert torch.equal(a, b), f"the two trainers start from different weights ({name})"
        for tr in trainers.values():  # one step holds every row, in two or more real micro-batches
            plan = tr.sampler.plan(0)
            assert len(plan.step_rows) == len(tr.dataset), "a step must hold the whole data set"
            assert sum(not mb.filler for mb in plan.micro_batches) >= 2, "no gradient accumulation"

        # every reduction: the tree trains the samples' (context, target) pairs with the samples' weights; and a
        # tree under the plain causal mask would train something else
        for reduction in ("token", "turn", "sample"):
            a, b = (_weighted_targets(_all_rows_batch(tr, reduction)) for tr in (s, t))
            assert [x[:3] for x in a] == [x[:3] for x in b], reduction
            np.testing.assert_allclose([x[3] for x in b], [x[3] for x in a], rtol=1e-6, err_msg=reduction)
        ref_loss, ref_cats = _unpacked_reference(s, data_dirs["samples"])  # transformers' forward of each step
        assert abs(_tree_loss_under_plain_mask(t) - ref_loss) > 1e-3, "the tree mask changes nothing: no test"

        # one optimizer step of each (two micro-batches, gradient accumulation): loss, categories, gradients
        records, grads = {}, {}
        for mode, tr in trainers.items():
            grads[mode] = {}
            tr.grad_hook = lambda x, g=grads[mode]: g.update(
                {n: p.grad.detach().clone() for n, p in x.model.named_parameters() if p.grad is not None})
            records[mode] = tr.train_step(tr.sampler.plan(0))
        assert abs(records["tree"]["loss"] - records["samples"]["loss"]) <= TOL * max(1.0, ref_loss)
        assert abs(records["samples"]["loss"] - ref_loss) <= TOL * max(1.0, ref_loss)
        assert records["tree"]["loss_tokens"] == records["samples"]["loss_tokens"]
        cats = records["samples"]["category_loss"]
        assert cats.keys() == records["tree"]["category_loss"].keys() and cats
        for name, value in cats.items():
            assert abs(records["tree"]["category_loss"][name] - value) <= TOL * max(1.0, value), name
        names = {v: k for k, v in s.plan.data.categories.items()}
        for name, value in cats.items():
            assert abs(value - ref_cats[names[name]]) <= TOL * max(1.0, value), name
        assert grads["samples"].keys() == grads["tree"].keys() and grads["samples"]
        for name in grads["samples"]:
            _close(grads["tree"][name], grads["samples"][name], f"grad {name}")
    finally:
        for tr in trainers.values():
            tr.metrics.close()
        shutil.rmtree(tmp_path, ignore_errors=True)
