"""Video and audio conversations through the pipeline and the trainer's media loader, per processor of
data/processors.py (Qwen2.5-VL, Qwen3-VL, Qwen2-Audio, Qwen2.5-Omni). Needs .venv-vision (torchvision, PyAV,
soundfile).

    .venv-vision/bin/python benchmarks/bench_media.py [--copies 4] [--out benchmarks/results/media.json]

For each processor, `--copies` copies of the six video / audio demo records of ../shared/fixtures/multimodal/
(mllm_av_demo.json: H.264 + AAC mp4, VP9 WebM, 16 kHz WAV, 22.05 kHz stereo FLAC, 44.1 kHz MP3; the records with a
kind the processor does not take are dropped, `on_error: skip`) go through preprocess .. pack with num_workers=1:

- tokenize: the stage's wall time (`python -m data.pipeline --stages tokenize`: process start and processor load
  included), media tokens per second of it and seconds of media per second of it;
- storage: the shards' bytes per minute of video and of audio (the files as read, what the shards keep), against the
  processor's tensors for the same items (float32 pixel_values_videos / input_features, what storing decoded
  features would keep);
- rebuild: CPU time (one torch thread, `time.process_time`) of the media loader on one packed row holding all the
  kept records (a micro-batch), per kind, against reading the same tensors back from .npy files (np.load), the
  alternative of storing features;
- the step it feeds: CPU time of a forward and backward of the example's tiny random-init model of that processor
  (configs/model/tiny_*.json: hidden 64, 2 layers, towers of width 32) on each of the micro-batch's conversations
  with those tensors, the composite's own forward per conversation (a real checkpoint's step is far longer).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
AV = ROOT.parent / "shared" / "fixtures" / "multimodal"
CASES = {"qwen2_5_vl": {}, "qwen3_vl": {}, "qwen2_audio": {}, "qwen2_5_omni": {"video_fps": 2.0}}
TINY_MODELS = {"qwen2_5_vl": ("tiny_qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
               "qwen3_vl": ("tiny_qwen3_vl", "Qwen3VLForConditionalGeneration"),
               "qwen2_audio": ("tiny_qwen2_audio", "Qwen2AudioForConditionalGeneration"),
               "qwen2_5_omni": ("tiny_qwen2_5_omni_thinker", "Qwen2_5OmniThinkerForConditionalGeneration")}


def step_cpu_seconds(name: str, processor_dir: Path, rows: list[dict], items: list) -> float:
    """CPU time of a forward + backward of the tiny model on each conversation (its ids and its items' tensors)."""
    import torch
    import transformers

    config_name, class_name = TINY_MODELS[name]
    config = transformers.AutoConfig.from_pretrained(str(ROOT / "configs" / "model" / f"{config_name}.json"))
    torch.manual_seed(0)
    model = getattr(transformers, class_name)._from_config(config, dtype=torch.float32)
    processor = transformers.AutoProcessor.from_pretrained(str(processor_dir))
    total = 0.0
    for ids, sequence in zip(rows, items):
        ids = torch.as_tensor(ids, dtype=torch.long)[None]
        inputs = {"input_ids": ids, "labels": ids}
        if hasattr(processor, "create_mm_token_type_ids"):
            inputs["mm_token_type_ids"] = torch.as_tensor(processor.create_mm_token_type_ids(ids.tolist()))
        for key in {k for item in sequence.items for k in item.inputs}:
            inputs[key] = torch.cat([torch.as_tensor(item.inputs[key]) for item in sequence.items
                                     if key in item.inputs])
        inputs.update(sequence.rope)
        start = time.process_time()
        model(**inputs).loss.backward()
        total += time.process_time() - start
        model.zero_grad(set_to_none=True)
    return total


def run_pipeline(config: Path, stages: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "data.pipeline", str(config), "--stages", stages], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def measure(name: str, keys: dict, tmp: Path, copies: int) -> dict:
    import torch

    from data.processors import write_processor
    from data.shards.dataset import PackedDataset
    from data.shards.media import MediaLoader, SequenceMedia

    processor = write_processor(name, tmp / f"proc_{name}")
    records = json.loads((AV / "mllm_av_demo.json").read_text())
    data = tmp / f"{name}.jsonl"
    with open(data, "w") as f:
        for _ in range(copies):
            for record in records:
                absolute = {k: [str(AV / p) for p in record[k]] for k in ("videos", "audios") if k in record}
                f.write(json.dumps({**record, **absolute}) + "\n")
    out = tmp / name
    config = tmp / f"{name}.json"
    config.write_text(json.dumps({
        "inputs": [{"path": str(data), "category_name": "av"}], "output_dir": str(out),
        "tokenizer_path": str(processor), "max_length": 1 << 20, "num_workers": 1, "on_error": "skip",
        "image_root": [str(AV / "mllm_av_demo_data")], "category_loss_warning": 1.0, **keys}))
    run_pipeline(config, "preprocess,sample,merge")
    tokenize_s = run_pipeline(config, "tokenize")
    run_pipeline(config, "pack")
    report = json.loads((out / "report.json").read_text())["tokenize"]
    packed = PackedDataset(out / "packed")
    counts = packed.meta["counts"]
    media_tokens = sum(counts[f"{k}_tokens"] for k in ("video", "audio"))
    media_seconds = (counts["video_millis"] + counts["audio_millis"]) / 1000
    # one micro-batch: every packed row's sequences (max_length 1M: all of them in one row)
    sequences = [seq for i in range(len(packed)) for seq in packed[i]["media"]]
    loader = MediaLoader.of(packed.meta)
    torch.set_num_threads(1)
    loader(sequences[:1])  # processor load and first-call set-up, not timed
    cpu = {"video": 0.0, "audio": 0.0}
    feature_bytes = {"video": 0, "audio": 0}
    stored_bytes = {"video": 0, "audio": 0}
    saved, items = [], []
    omni = loader.processor.interleaves_audio_in_video
    for seq in sequences:
        seq_items = []
        for stored in seq:
            start = time.process_time()
            item = loader.item(stored)
            cpu[stored.kind] += time.process_time() - start
            seq_items.append(item)
            arrays = {k: v.numpy() for k, v in item.inputs.items() if hasattr(v, "numpy")}
            feature_bytes[stored.kind] += sum(a.nbytes for a in arrays.values())
            stored_bytes[stored.kind] += len(stored.data)
            for k, a in arrays.items():
                path = tmp / f"feat_{len(saved)}.npy"
                np.save(path, a)
                saved.append(path)
        rope = {"use_audio_in_video": any(item.audio_in_video for item in seq_items)} if omni else {}
        items.append(SequenceMedia(seq_items, rope))
    start = time.process_time()
    for path in saved:
        np.load(path)
    load_features_s = time.process_time() - start
    for path in saved:
        path.unlink()
    row = packed[0] if len(packed) == 1 else None
    ids = np.split(row["input_ids"], np.cumsum(row["seq_lens"])[:-1]) if row is not None else []
    step_s = step_cpu_seconds(name, processor, ids, items) if row is not None else None
    minutes = {"video": counts["video_millis"] / 60000, "audio": counts["audio_millis"] / 60000}
    per_minute = {kind: {"stored_bytes": stored_bytes[kind] / minutes[kind] if minutes[kind] else None,
                         "feature_bytes": feature_bytes[kind] / minutes[kind] if minutes[kind] else None}
                  for kind in ("video", "audio")}
    return {"processor": name, "settings": keys, "records_kept": report["out"], "records_dropped": report["dropped"],
            "videos": counts["videos"], "audios": counts["audios"], "videos_with_audio": counts["videos_with_audio"],
            "media_tokens": media_tokens, "media_seconds": media_seconds, "tokenize_wall_s": tokenize_s,
            "media_tokens_per_s": media_tokens / tokenize_s, "media_seconds_per_s": media_seconds / tokenize_s,
            "per_minute": per_minute, "rebuild_cpu_s": cpu, "load_features_cpu_s": load_features_s,
            "tiny_model_step_cpu_s": step_s,
            "sequences_in_micro_batch": len(sequences)}


def table(results: list[dict]) -> str:
    def mb(x):
        return "–" if x is None else f"{x / 1e6:,.2f} MB"

    lines = ["| processor | kept / dropped records | media tokens | media s | tokenize wall | media tokens/s | "
             "media s/s | video stored / features per min | audio stored / features per min | "
             "rebuild CPU per micro-batch: video + audio (loader) | np.load of the features | tiny model fwd+bwd |",
             "|---|---|---:|---:|---:|---:|---:|---|---|---|---:|---:|"]
    for r in results:
        pm = r["per_minute"]
        lines.append(
            f"| {r['processor']} {r['settings'] or ''} | {r['records_kept']} / {sum(r['records_dropped'].values())} "
            f"| {r['media_tokens']:,} | {r['media_seconds']:.1f} | {r['tokenize_wall_s']:.1f} s | "
            f"{r['media_tokens_per_s']:,.0f} | {r['media_seconds_per_s']:.2f} | {mb(pm['video']['stored_bytes'])} / "
            f"{mb(pm['video']['feature_bytes'])} | {mb(pm['audio']['stored_bytes'])} / "
            f"{mb(pm['audio']['feature_bytes'])} | {r['rebuild_cpu_s']['video']:.2f} + "
            f"{r['rebuild_cpu_s']['audio']:.2f} s ({r['sequences_in_micro_batch']} sequences) | "
            f"{r['load_features_cpu_s']:.3f} s | {r['tiny_model_step_cpu_s']:.2f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--processors", default=",".join(CASES))
    parser.add_argument("--out", default=None, help="write the results as JSON here too")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.processors.split(","):
            results.append(measure(name, CASES[name], Path(tmp), args.copies))
            print(json.dumps(results[-1]), flush=True)
    import torch
    import transformers

    header = (f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
              f"transformers {transformers.__version__}, --copies {args.copies}")
    print(header)
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps({"header": header, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
