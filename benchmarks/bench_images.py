"""Images in the shards: encoded bytes vs preprocessed patches (size and load time per image), and the tokenize
stage on image records (images/s, shard bytes per image). Needs .venv-vision (torchvision + Pillow).

    .venv-vision/bin/python benchmarks/bench_images.py [--copies 50] [--repeats 5] [--out results/images.json]

Storage: for each image (the fixture's three JPEGs, 300x~170, and the same upscaled to 1280x720 / 1920x1080 and
re-encoded at JPEG quality 90, the size of a typical photo or screenshot) under the Qwen2.5-VL processor fixture's
default limits: its encoded bytes and its `pixel_values` (float32, what the vision tower takes) as stored; load
time per image on one torch thread, best of --repeats, from files in the page cache: (a) encoded: read the bytes, decode (PIL) and
run the image processor, what `data.shards.media.MediaLoader` does per micro-batch; (b) patches: np.load of the stored
float32 array and `torch.from_numpy`.

Tokenize stage: `--copies` copies of the six LLaMA-Factory demo records (8 images each copy), and a fifth of them,
through preprocess .. pack with num_workers=1 (one process); the tokenize stage's wall time (`python -m data.pipeline
--stages tokenize`: process start, tokenizer and processor load included) of both, the marginal images/s between
them (start-up excluded), and the packed shards' bytes per image (the images' bytes + their index entries).
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
MM = ROOT.parent / "shared" / "fixtures" / "multimodal"
PROCESSOR = MM / "qwen2_5_vl_processor"


def images(tmp: Path) -> list[tuple[str, Path]]:
    from PIL import Image

    out = [(f"fixture {p.name}", p) for p in sorted((MM / "mllm_demo_data").glob("*.jpg"))]
    base = Image.open(MM / "mllm_demo_data" / "3.jpg").convert("RGB")
    for w, h in ((1280, 720), (1920, 1080)):
        path = tmp / f"up_{w}x{h}.jpg"
        base.resize((w, h), Image.BICUBIC).save(path, quality=90)
        out.append((f"3.jpg upscaled {w}x{h}", path))
    return out


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def storage(tmp: Path, repeats: int) -> list[dict]:
    import torch
    from transformers import AutoProcessor

    from data.shards.decode import decode_image

    processor = AutoProcessor.from_pretrained(str(PROCESSOR))
    torch.set_num_threads(1)  # one core, as each tokenize worker (and the noise of a shared machine kept out)
    rows = []
    for name, path in images(tmp):
        data = path.read_bytes()
        pixels = processor.image_processor(images=[decode_image(data, name, "image")], return_tensors="pt")
        patches = pixels["pixel_values"].numpy()
        npy = tmp / f"{path.stem}.npy"
        np.save(npy, patches)

        def encoded():
            raw = path.read_bytes()
            processor.image_processor(images=[decode_image(raw, name, "image")], return_tensors="pt")

        def preprocessed():
            torch.from_numpy(np.load(npy))

        encoded(), preprocessed()  # warm-up: first calls initialise torch's kernels

        rows.append({"image": name, "grid_thw": pixels["image_grid_thw"][0].tolist(),
                     "encoded_bytes": len(data), "patch_bytes": int(patches.nbytes),
                     "ratio": round(patches.nbytes / len(data), 1),
                     "load_encoded_ms": round(best(encoded, repeats) * 1e3, 2),
                     "load_patches_ms": round(best(preprocessed, repeats) * 1e3, 2)})
    return rows


def tokenize_stage(tmp: Path, copies: int) -> dict:
    small, large = tokenize_run(tmp / "small", max(1, copies // 5)), tokenize_run(tmp / "large", copies)
    marginal = (large["images"] - small["images"]) / (large["tokenize_s"] - small["tokenize_s"])
    return {"small": small, "large": large, "marginal_images_per_s": round(marginal, 1)}


def tokenize_run(tmp: Path, copies: int) -> dict:
    tmp.mkdir()
    records = json.loads((MM / "mllm_demo.json").read_text())
    data = tmp / "records.jsonl"
    with open(data, "w") as f:
        for _ in range(copies):
            for rec in records:
                rec = {**rec, "images": [str(MM / p) for p in rec["images"]]}
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    out = tmp / "out"
    config = tmp / "config.json"
    config.write_text(json.dumps({"inputs": [{"path": str(data)}], "output_dir": str(out),
                                  "tokenizer_path": str(PROCESSOR), "max_length": 8192, "num_workers": 1}))
    subprocess.run([sys.executable, "-m", "data.pipeline", str(config), "--stages", "preprocess,sample,merge"],
                   cwd=ROOT, check=True, capture_output=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "data.pipeline", str(config), "--stages", "tokenize"], cwd=ROOT, check=True,
                   capture_output=True)
    tokenize_s = time.perf_counter() - start
    subprocess.run([sys.executable, "-m", "data.pipeline", str(config), "--stages", "pack"], cwd=ROOT, check=True,
                   capture_output=True)
    meta = json.loads((out / "packed" / "meta.json").read_text())
    n_images = meta["counts"]["images"]
    files = [f for shard in meta["shards"] for kind, f in shard["files"].items() if kind in ("images", "image_data")]
    image_store = sum(f["bytes"] for f in files)
    token_bytes = sum(shard["files"]["tokens"]["bytes"] for shard in meta["shards"])
    return {"records": copies * len(records), "images": n_images, "tokenize_s": round(tokenize_s, 2),
            "images_per_s": round(n_images / tokenize_s, 1), "records_per_s": round(copies * len(records) / tokenize_s, 1),
            "shard_image_bytes_per_image": round(image_store / n_images), "image_tokens": meta["counts"]["image_tokens"],
            "token_record_bytes": round(token_bytes / meta["counts"]["tokens"], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as tmp:
        result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version(),
                  "storage": storage(Path(tmp), args.repeats), "tokenize": tokenize_stage(Path(tmp), args.copies)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
