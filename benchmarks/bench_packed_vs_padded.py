"""Packed rows vs the same samples padded (OpenSFT's "traditional" layout): tokens/s, tokens processed, peak memory.

The SAME samples are trained in two layouts, one optimizer step per packed row in both:
- packed: the row is one varlen micro-batch through the trainer's path (train.steps.batch.make_batch, the registered
  "packsft" attention: SDPA per packed sequence on CPU, flash-attn varlen on CUDA, train.model.packed.PackedCausalLM
  with the chunked weighted loss);
- padded: the row's samples, `--padded-batch` per micro-batch (gradients accumulated over the row's micro-batches),
  each padded to the longest sample of its micro-batch (`--pad-to longest`) or to the row length (`--pad-to
  max_length`, the OpenSFT way), transformers' "sdpa" causal attention with the padding mask and the plain HF loss
  over the full logits (`labels=`, `num_items_in_batch=` the step's loss tokens, i.e. the same token mean).

Both start from the same random weights; the token-mean loss over all the samples before any update is printed
for both layouts and must agree (1e-4 relative in fp32): the layouts train the same thing. Throughput counts real
(non-pad) tokens over forward + backward + AdamW step, warmup steps excluded, best of `--repeats` passes over the
rows; each layout runs in a fresh subprocess whose peak is reported (CPU: peak RSS; CUDA: max_memory_allocated).

    python -m benchmarks.bench_packed_vs_padded --rows 8 --pad-to longest --out benchmarks/results/packed_vs_padded.md
    python -m benchmarks.bench_packed_vs_padded --device cuda --dtype bf16 --shape qwen2.5-0.5b --synthetic \
        --row-length 16384 --rows 8 --out benchmarks/results/packed_vs_padded.md

With a dataset directory, `--row-length` larger than its rows merges consecutive rows (whole rows, greedily) into
one benchmark row of at most that many tokens; `--synthetic` packs lognormal sample lengths into such rows.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_memory import SHAPES, machine_description, write_atomic_append  # noqa: E402

LAYOUTS = ("packed", "padded")
IGNORE_INDEX = -100


# ---------------------------------------------------------------------------------------------- rows
def _synthetic_rows(n_rows: int, row_length: int, mean_length: float, sigma: float, vocab: int, seed: int):
    """`n_rows` rows of greedily packed samples; sample lengths lognormal (median `mean_length`), the first ~30%
    of each sample a prompt (no loss), the rest one trained turn."""
    rng = np.random.default_rng(seed)
    rows, current, used = [], [], 0
    while len(rows) < n_rows:
        n = int(np.clip(rng.lognormal(np.log(mean_length), sigma), 16, row_length))
        if used + n > row_length:
            rows.append(current)
            current, used = [], 0
        current.append(n)
        used += n
    out = []
    for lengths in rows:
        ids, labels, cats, turns = [], [], [], []
        for n in lengths:
            tok = rng.integers(3, vocab, size=n)
            prompt = max(1, int(0.3 * n))
            lab = tok.copy()
            lab[:prompt] = IGNORE_INDEX
            turn = np.zeros(n, dtype=np.int64)
            turn[prompt:] = 1
            ids.append(tok)
            labels.append(lab)
            cats.append(np.ones(n, dtype=np.int64))
            turns.append(turn)
        out.append(dict(input_ids=np.concatenate(ids), labels=np.concatenate(labels),
                        category_ids=np.concatenate(cats), turn_ids=np.concatenate(turns),
                        seq_lens=np.asarray(lengths, dtype=np.int64)))
    return out, 2


def _dataset_rows(path: str, n_rows: int, row_length: int | None):
    """The first `n_rows` benchmark rows of a packed dataset: consecutive dataset rows merged (whole) while the
    total stays within `row_length` (default: the dataset's own row length, one dataset row each)."""
    from data.shards.dataset import PackedDataset

    ds = PackedDataset(path)
    limit = row_length or int(ds.meta.get("max_length") or int(np.max(ds.row_n_tokens)))
    groups, current, used = [], [], 0
    for i in range(len(ds)):
        n = int(ds.row_n_tokens[i])
        if n > limit:
            raise SystemExit(f"{path}: row {i} has {n} tokens, more than --row-length {limit}")
        if current and used + n > limit:
            groups.append(current)
            current, used = [], 0
            if len(groups) == n_rows:
                break
        current.append(i)
        used += n
    if current and len(groups) < n_rows:
        groups.append(current)
    if len(groups) < n_rows:
        raise SystemExit(f"{path}: only {len(groups)} rows of <= {limit} tokens, --rows {n_rows} asked")
    keys = ("input_ids", "labels", "category_ids", "turn_ids", "seq_lens")
    rows = []
    for g in groups:
        r = ds.gather(g)
        rows.append({k: np.asarray(r[k]).astype(np.int64) for k in keys})
    num_categories = max([0, *ds.categories]) + 1
    return rows, num_categories, limit


def _totals(rows):
    """StepTotals of some rows, counted the way the shards count them (labels on positions > 0 of a sequence)."""
    from train.steps.batch import StepTotals

    n_loss = n_turns = n_samples = 0
    for r in rows:
        bounds = np.concatenate([[0], np.cumsum(r["seq_lens"])])
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            lab, turn = r["labels"][lo:hi], r["turn_ids"][lo:hi]
            k = int((lab[1:] != IGNORE_INDEX).sum())
            n_loss += k
            n_samples += k > 0
            n_turns += len(np.unique(turn[turn > 0]))
    return StepTotals(n_loss, n_turns, n_samples)


def _samples(row):
    bounds = np.concatenate([[0], np.cumsum(row["seq_lens"])])
    return [(row["input_ids"][lo:hi], row["labels"][lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]


def padded_micro_batches(row, per_batch: int, pad_to: str, row_length: int, pad_id: int):
    """The row's samples in micro-batches of `per_batch`, right-padded: (input_ids, attention_mask, labels)
    int64 [B, L] each, L = longest sample of the micro-batch or `row_length`."""
    import torch

    samples = _samples(row)
    out = []
    for k in range(0, len(samples), per_batch):
        group = samples[k:k + per_batch]
        length = row_length if pad_to == "max_length" else max(len(ids) for ids, _ in group)
        ids = np.full((len(group), length), pad_id, dtype=np.int64)
        mask = np.zeros((len(group), length), dtype=np.int64)
        labels = np.full((len(group), length), IGNORE_INDEX, dtype=np.int64)
        for j, (tok, lab) in enumerate(group):
            ids[j, :len(tok)], mask[j, :len(tok)], labels[j, :len(lab)] = tok, 1, lab
        out.append(tuple(torch.from_numpy(a) for a in (ids, mask, labels)))
    return out


# ---------------------------------------------------------------------------------------------- child
def _model_config_path(spec: dict, tmp: str) -> str:
    if spec["shape"] == "config":
        return spec["model_config"]
    from transformers import Qwen2Config

    cfg = Qwen2Config(**SHAPES[spec["shape"]], max_position_embeddings=max(spec["row_length"], 32768))
    cfg.save_pretrained(tmp)
    return str(Path(tmp) / "config.json")


def run_layout(spec: dict) -> dict:
    """Loss check + timed training of one layout in this process."""
    import torch

    import train.attention.function  # noqa: F401  (registers "packsft")
    from train.attention.function import AttentionContext
    from train.plan.attention import layer_kinds, packed_kernels
    from train.steps.batch import make_batch
    from transformers import AutoConfig

    from train.config.sections import from_keys
    from train.model.packed import PackedCausalLM, build_lm
    from train.plan.memory_plan import MemoryPlan

    cuda = spec["device"] == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    rows, num_categories, row_length = _load_rows(spec)
    layout = spec["layout"]
    all_totals = _totals(rows)

    with tempfile.TemporaryDirectory() as tmp:
        cfg = from_keys({"data_path": spec["data"] or "-", "output_dir": tmp,
                         "model_config": _model_config_path(spec, tmp), "loss_chunk_size": spec["chunk_size"],
                         "attn_backend": spec["attn_backend"]})
        torch.manual_seed(spec["seed"])
        model_config = AutoConfig.from_pretrained(cfg.model.model_config)
        lm = build_lm(cfg, model_config, dtype, MemoryPlan(checkpointing=spec["checkpointing"]))  # same seed: same weights
    if layout == "padded":
        lm.set_attn_implementation("sdpa")
        model = lm.to(device)
    else:
        model = PackedCausalLM(lm, cfg.steps.loss_chunk_size, num_categories).to(device)
        probe = torch.empty((1, 1, 0, 1), device=device, dtype=dtype)
        kernels = packed_kernels(cfg.model.attn_backend, probe, [features for features, _ in layer_kinds(lm)])
    model.train()
    pad_id = lm.config.pad_token_id if lm.config.pad_token_id is not None else 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    # what the process holds with the model loaded, before any step (libraries, weights, the rows)
    baseline = torch.cuda.memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def packed_loss(row, totals):
        batch = make_batch([row], totals, "token")
        attn = AttentionContext(cu_seqlens=batch.cu_seqlens.to(device), max_seqlen=batch.max_seqlen,
                                kernels=kernels)
        weighted, _, _ = model(batch.input_ids.to(device), batch.position_ids.to(device),
                               batch.targets.to(device), batch.weights.to(device),
                               batch.target_categories.to(device), attn)
        return weighted, int(batch.input_ids.numel())

    def padded_losses(row, totals):
        n_items = torch.tensor(totals.n_loss_tokens, device=device)
        for ids, mask, labels in padded_micro_batches(row, spec["padded_batch"], spec["pad_to"], row_length, pad_id):
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device),
                        use_cache=False, num_items_in_batch=n_items)
            yield out.loss, int(ids.numel())

    def row_step(row, train: bool, totals=None):
        """Forward (+ backward) of one row's micro-batches; returns (loss, tokens incl. padding)."""
        totals = totals or _totals([row])
        pieces = [packed_loss(row, totals)] if layout == "packed" else padded_losses(row, totals)
        loss_sum, processed = 0.0, 0
        for loss, n in pieces:
            if train:
                loss.backward()
            loss_sum += float(loss.detach())
            processed += n
        return loss_sum, processed

    # loss check: token mean over every sample of every row, before any update
    with torch.no_grad():
        initial_loss = sum(row_step(r, False, all_totals)[0] for r in rows)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def train_row(row):
        _, processed = row_step(row, True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return processed

    for k in range(spec["warmup"]):
        train_row(rows[k % len(rows)])
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
    pass_seconds, processed = [], 0
    for _ in range(spec["repeats"]):
        sync()
        t0 = time.perf_counter()
        processed = sum(train_row(r) for r in rows)
        sync()
        pass_seconds.append(time.perf_counter() - t0)
    real = int(sum(r["input_ids"].shape[0] for r in rows))
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    best = min(pass_seconds)
    return dict(layout=layout, initial_loss=initial_loss, loss_tokens=all_totals.n_loss_tokens,
                samples=int(sum(len(r["seq_lens"]) for r in rows)), real_tokens=real, processed_tokens=processed,
                pass_seconds=pass_seconds, tokens_per_s=real / best, peak_bytes=int(peak),
                baseline_bytes=int(baseline),
                n_params=sum(p.numel() for p in model.parameters()), row_length=row_length)


def _load_rows(spec: dict):
    if spec["synthetic"]:
        vocab = SHAPES[spec["shape"]]["vocab_size"] if spec["shape"] != "config" else json.loads(
            Path(spec["model_config"]).read_text())["vocab_size"]
        rows, ncat = _synthetic_rows(spec["rows"], spec["row_length"], spec["mean_length"], spec["sigma"], vocab,
                                     spec["seed"])
        return rows, ncat, spec["row_length"]
    return _dataset_rows(spec["data"], spec["rows"], spec["row_length"])


def child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    if spec["device"] == "cpu" and spec["threads"]:
        import torch

        torch.set_num_threads(spec["threads"])
    print("RESULT " + json.dumps(run_layout(spec)), flush=True)


# --------------------------------------------------------------------------------------------- parent
def measure(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return dict(error=f"timeout after {timeout:.0f} s")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-4:]
    return dict(error=f"exit {proc.returncode}: {' | '.join(tail)[:400]}")


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f}"


def comparison_table(packed: dict, padded: dict, device: str) -> list[str]:
    mem = "peak GPU memory allocated (GiB)" if device == "cuda" else "peak RSS (GiB)"

    def extra(res):
        return res["peak_bytes"] - res["baseline_bytes"]

    rows = [
        ("real tokens / s (best pass)", f"{packed['tokens_per_s']:.0f}", f"{padded['tokens_per_s']:.0f}",
         packed["tokens_per_s"] / padded["tokens_per_s"]),
        ("seconds per pass (best)", f"{min(packed['pass_seconds']):.2f}", f"{min(padded['pass_seconds']):.2f}",
         min(packed["pass_seconds"]) / min(padded["pass_seconds"])),
        ("tokens processed per pass (incl. padding)", f"{packed['processed_tokens']}",
         f"{padded['processed_tokens']}", packed["processed_tokens"] / padded["processed_tokens"]),
        (mem, _gib(packed["peak_bytes"]), _gib(padded["peak_bytes"]), packed["peak_bytes"] / padded["peak_bytes"]),
        ("peak above the model-loaded baseline (GiB)", _gib(extra(packed)), _gib(extra(padded)),
         extra(packed) / max(1, extra(padded))),
    ]
    out = ["| metric | packed | padded | packed / padded |", "|---|---:|---:|---:|"]
    out += [f"| {name} | {a} | {b} | {r:.2f} |" for name, a, b, r in rows]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="outputs/example/packed", help="packed dataset directory (sh data_process.sh)")
    ap.add_argument("--synthetic", action="store_true", help="random samples with lognormal lengths instead")
    ap.add_argument("--rows", type=int, default=8, help="benchmark rows (one optimizer step each)")
    ap.add_argument("--row-length", type=int, default=None,
                    help="tokens per packed row (dataset: default its own; synthetic: default 2048)")
    ap.add_argument("--mean-length", type=float, default=600.0, help="synthetic: median sample length")
    ap.add_argument("--sigma", type=float, default=0.8, help="synthetic: lognormal sigma of sample lengths")
    ap.add_argument("--shape", choices=["config", *sorted(SHAPES)], default="config",
                    help="config: --model-config; else a Qwen2-shaped random model (benchmarks.bench_memory.SHAPES)")
    ap.add_argument("--model-config", default="configs/model/tiny_qwen2.json")
    ap.add_argument("--padded-batch", type=int, default=1, help="samples per padded micro-batch")
    ap.add_argument("--pad-to", choices=["longest", "max_length"], default="longest",
                    help="longest sample of the micro-batch, or the row length (OpenSFT's max_length padding)")
    ap.add_argument("--layouts", default="packed,padded")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: bf16 weights (as under DeepSpeed)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--attn-backend", choices=["auto", "sdpa", "flash_varlen"], default="auto",
                    help="packed layout's backend (auto: flash-attn varlen on CUDA when installed)")
    ap.add_argument("--chunk-size", type=int, default=4096, help="packed layout's loss chunk (tokens)")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing in both layouts")
    ap.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes over the rows; the best one counts")
    ap.add_argument("--threads", type=int, default=0, help="CPU: torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rtol", type=float, default=None, help="loss check tolerance (default 1e-4 fp32, 2e-2 bf16)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per layout")
    ap.add_argument("--out", type=Path, default=None, help="append the markdown section to this file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        child_main(args.child)
        return 0

    import torch

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but CUDA is not available")
    layouts = [x for x in args.layouts.split(",") if x]
    if any(x not in LAYOUTS for x in layouts) or not layouts:
        ap.error(f"--layouts: comma-separated of {LAYOUTS}")
    row_length = args.row_length or (2048 if args.synthetic else None)
    spec = dict(data=None if args.synthetic else args.data, synthetic=args.synthetic, rows=args.rows,
                row_length=row_length, mean_length=args.mean_length, sigma=args.sigma, shape=args.shape,
                model_config=args.model_config, padded_batch=args.padded_batch, pad_to=args.pad_to,
                dtype=args.dtype, device=device, attn_backend=args.attn_backend, chunk_size=args.chunk_size,
                checkpointing=args.checkpointing, warmup=args.warmup, repeats=args.repeats, threads=args.threads,
                seed=args.seed)
    _load_rows(spec)  # bad --data / --rows fail here, before any child starts
    command = "python -m benchmarks.bench_packed_vs_padded " + shlex.join(sys.argv[1:] if argv is None else argv)
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_before = os.getloadavg()
    results = {}
    for layout in layouts:
        res = measure(dict(spec, layout=layout), args.timeout)
        results[layout] = res
        if "error" in res:
            print(f"{layout}: {res['error']}", flush=True)
        else:
            print(f"{layout}: {res['tokens_per_s']:.0f} real tok/s, passes "
                  f"{', '.join(f'{s:.2f}' for s in res['pass_seconds'])} s, {res['processed_tokens']} tokens "
                  f"processed, peak {_gib(res['peak_bytes'])} GiB, step-0 loss {res['initial_loss']:.6f}", flush=True)
    load_after = os.getloadavg()
    if any("error" in r for r in results.values()):
        return 1

    lines = [f"\n## {args.pad_to} padding, {args.shape if args.shape != 'config' else args.model_config}, "
             f"{args.dtype}, {device}, {started}\n"]
    lines.append(f"Command: `{command}`  ")
    lines.append(f"Machine: {machine_description(device)}; load average (1/5/15 min) "
                 f"{' '.join(f'{x:.2f}' for x in load_before)} before, {' '.join(f'{x:.2f}' for x in load_after)} "
                 "after  ")
    first = next(iter(results.values()))
    source = "synthetic lognormal samples" if args.synthetic else f"`{args.data}`"
    lines.append(f"Data: {source}, {args.rows} rows of <= {first['row_length']} tokens, {first['samples']} samples, "
                 f"{first['real_tokens']} real tokens, {first['loss_tokens']} loss tokens; "
                 f"model {first['n_params'] / 1e6:.2f}M parameters; padded: {args.padded_batch} sample(s) per "
                 f"micro-batch, padded to {args.pad_to}; one AdamW step per row in both layouts; "
                 f"{args.warmup} warmup steps, best of {args.repeats} passes"
                 + ("; activation checkpointing" if args.checkpointing else "") + ".\n")
    ok = True
    if len(results) == 2:
        packed, padded = results["packed"], results["padded"]
        lines += comparison_table(packed, padded, device)
        rtol = args.rtol if args.rtol is not None else (1e-4 if args.dtype == "fp32" else 2e-2)
        rel = abs(packed["initial_loss"] - padded["initial_loss"]) / abs(padded["initial_loss"])
        ok = rel <= rtol
        lines.append(f"\nLoss check (token mean over the same samples, step 0): packed "
                     f"{packed['initial_loss']:.7f}, padded {padded['initial_loss']:.7f}, relative difference "
                     f"{rel:.1e} ({'OK' if ok else 'FAILED'}, tolerance {rtol:g}).")
        lines.append("Per-pass seconds: " + "; ".join(
            f"{k} {', '.join(f'{s:.2f}' for s in r['pass_seconds'])}" for k, r in results.items()))
    section = "\n".join(lines) + "\n"
    if args.out:
        write_atomic_append(args.out, section)
    print(section)
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
