"""Image conversations, data side: LLaMA-Factory / OpenAI image records, token ids exactly those of transformers'
processor, masks, errors and counts, the shards' image store and the micro-batch's ImageBatch.

Tests marked `vision` need torchvision + Pillow (.venv-vision, scripts/setup_vision.sh; `pytest -m vision`); the
others (record conversion, the shard format with opaque image bytes, the text path never importing them) run in
the plain .venv.
"""
import base64
import json
import subprocess
import sys

import numpy as np
import orjson
import pytest

from common.config import ConfigError
from data import pipeline
from data.config import InputSpec
from data.preprocess import convert_row, detect_format
from data.records import RecordError
from data.shards.dataset import PackedDataset, ShardFormatError, ShardWriter, StoredMedia
from tests.conftest import ROOT, fixture_path

IMAGE_PAD = 151655  # <|image_pad|> of the Qwen2.5-VL processor fixture


def mm(*parts):
    return fixture_path("multimodal", *parts)


def demo_records():
    return json.loads(mm("mllm_demo.json").read_text())


def convert(raw, base=None):
    spec = InputSpec(path=["x.jsonl"])
    fmt, spec = detect_format(raw, spec, "x.jsonl:1")
    return convert_row(raw, spec, fmt, "x.jsonl:1", str(base or mm()))[0]


# ---------------------------------------------------------------------------------------------- records (no PIL)
def test_llamafactory_and_openai_image_records_give_the_same_canonical_record():
    base = mm()
    lf = convert(demo_records()[0])
    assert lf["images"] == [str(base / "mllm_demo_data" / "1.jpg")] * 2  # absolute, relative to the data file
    assert lf["messages"][0]["content"] == "<image>Who are they?"
    openai = {"messages": [
        {"role": "user", "content": [{"type": "image", "image": "mllm_demo_data/1.jpg"},
                                     {"type": "text", "text": "Who are they?"}]},
        {"role": "assistant", "content": "They're Kane and Gretzka from Bayern Munich."},
        {"role": "user", "content": [{"type": "text", "text": "What are they doing?"},
                                     {"type": "image_url", "image_url": {"url": "mllm_demo_data/1.jpg"}}]},
        {"role": "assistant", "content": "They are celebrating on the soccer field."}]}
    assert convert(openai) == lf
    bare = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
                         {"role": "assistant", "content": "Hello"}], "images": ["mllm_demo_data/2.jpg"]}
    assert convert(bare)["images"] == [str(base / "mllm_demo_data" / "2.jpg")]
    uri = "data:image/jpeg;base64," + base64.b64encode(b"xyz").decode()
    parts = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}]},
                          {"role": "assistant", "content": "ok"}]}
    assert convert(parts)["images"] == [uri]
    sharegpt = {"conversations": [{"from": "human", "value": "<image>Hi"}, {"from": "gpt", "value": "Yo"}],
                "images": ["mllm_demo_data/3.jpg"]}
    assert convert(sharegpt)["images"] == [str(base / "mllm_demo_data" / "3.jpg")]


@pytest.mark.parametrize("raw, field, reason", [
    ({"messages": [{"role": "user", "content": "<image>Hi"}, {"role": "assistant", "content": "Yo"}],
      "images": ["mllm_demo_data/nope.jpg"]}, "images[0]", "missing_image"),
    ({"messages": [{"role": "user", "content": "<image><image>Hi"}, {"role": "assistant", "content": "Yo"}],
      "images": ["mllm_demo_data/1.jpg"]}, "images", "image_count_mismatch"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<image>Yo"}],
      "images": ["mllm_demo_data/1.jpg"]}, "messages[1].content", "image_placement"),
    ({"messages": [{"role": "user", "content": "<image>Hi"}, {"role": "assistant", "content": "Yo"}],
      "images": ["https://example.com/a.jpg"]}, "images[0]", "bad_image"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "Yo"}]},
     "images", "image_count_mismatch"),
])
def test_bad_image_records_name_the_field_and_reason(raw, field, reason):
    with pytest.raises(RecordError) as info:
        convert(raw)
    assert (info.value.field, info.value.reason) == (field, reason)
    assert str(info.value).startswith(f"x.jsonl:1: {field}: ")


# ---------------------------------------------------------------------------------------------- shards (no PIL)
def _seq(ids):
    ids = np.asarray(ids, dtype=np.int32)
    return {"input_ids": ids, "labels": np.where(ids > 5, ids, -100).astype(np.int32),
            "category_ids": np.zeros_like(ids, dtype=np.int16), "turn_ids": (ids > 5).astype(np.int16)}


def test_image_store_round_trips_copies_and_checks_image_bytes(tmp_path):
    a, b, c = (StoredMedia("image", bytes([k]) * (10 + k), (1, 2, 2 + k), 1 + k) for k in range(3))
    with ShardWriter(tmp_path / "src", kind="tokenized", media=True, max_shard_bytes=200) as w:
        w.add_row([_seq([1, 7, 7, 8])], media=[[a, b]])
        w.add_row([_seq([1, 9])])  # a text-only sequence among image ones
        w.add_row([_seq([1, 2, 6, 6])], media=[[c]])
        w.close()
    src = PackedDataset(tmp_path / "src", verify="full")
    assert src.meta["counts"]["images"] == 3 and src.meta["counts"]["image_bytes"] == 10 + 11 + 12
    assert src.row_media(0) == [[a, b]] and src.row_media(1) == [[]] and src.row_media(2) == [[c]]
    both = src.gather([2, 0])
    assert both["image_data"] == [c.data, a.data, b.data]
    assert both["image_grid_thw"].tolist() == [list(c.grid), list(a.grid), list(b.grid)]
    # a packed row of two sequences, and the bulk copy of the tokenize stage's shard re-cut
    with ShardWriter(tmp_path / "packed", media=True) as w:
        w.add_row([src.row_tokens(2), src.row_tokens(0)], media=[src.row_media(2)[0], src.row_media(0)[0]])
        w.close()
    packed = PackedDataset(tmp_path / "packed", verify="full")
    assert packed.row_media(0) == [[c], [a, b]] and packed[0]["image_data"] == [c.data, a.data, b.data]
    with ShardWriter(tmp_path / "copy", kind="tokenized", media=True, max_shard_bytes=40) as w:
        w.add_rows(src, 0, 3)
        w.close()
    copy = PackedDataset(tmp_path / "copy", verify="full")
    assert [copy.row_media(i) for i in range(3)] == [src.row_media(i) for i in range(3)]
    assert copy.meta["counts"]["images"] == 3 and len(copy.meta["shards"]) > 1
    # one byte of an image changed: its row is refused (the row checksum covers the images)
    data = tmp_path / "packed" / packed.meta["shards"][0]["files"]["media_data"]["file"]
    raw = bytearray(data.read_bytes())
    raw[11] ^= 1
    data.chmod(0o644)
    data.write_bytes(bytes(raw))
    with pytest.raises(ShardFormatError, match="row 0 .*corrupt"):
        PackedDataset(tmp_path / "packed")[0]
    with pytest.raises(ValueError, match="without a media store"):
        ShardWriter(tmp_path / "text").add_row([_seq([1, 7])], media=[[a]])


def _shard_sizes(ds: PackedDataset) -> list[int]:
    return [sum(info["bytes"] for kind, info in shard["files"].items() if kind in ("tokens", "media_data"))
            for shard in ds.meta["shards"]]


def _assert_cut_by_the_writers_rule(ds: PackedDataset, max_bytes: int, greedy: bool = True) -> None:
    """Shards of token records and image bytes each within the bound (or one row alone); `greedy`: each but the
    last closed only because the next row would have passed it (pack closes a shard at the end of each plan too)."""
    nbytes = ds.row_nbytes().tolist()
    sizes, rows = _shard_sizes(ds), [shard["rows"] for shard in ds.meta["shards"]]
    assert sum(sizes) == sum(nbytes) and sum(rows) == len(ds)
    first = 0
    for k, (size, n) in enumerate(zip(sizes, rows)):
        assert size == sum(nbytes[first:first + n])
        assert size <= max_bytes or n == 1
        if greedy and k + 1 < len(sizes):
            assert size + nbytes[first + n] > max_bytes
        first += n


def test_shard_size_counts_the_images_bytes(tmp_path, monkeypatch):
    """`pack.shard_size_mb` bounds a shard's token records and image bytes together on every path that cuts
    shards: the writer row by row, its bulk copy, tokenize's plan over its parts and pack's plans (partitions and
    the global pass; 1 and 3 workers byte-identical). Images are ~200x the tokens here, as in real image data."""
    from data import pack
    from data.tokenize import ShardPlan
    from tests.data.test_pack_roundtrip import config

    monkeypatch.setattr(pack, "PARTITION_SEQUENCES", 32)
    rng = np.random.default_rng(3)
    fields = ["input_ids", "labels", "category_ids", "turn_ids"]
    mib = 1 << 20
    with ShardWriter(tmp_path / "tokenized", token_fields=fields, kind="tokenized", media=True,
                     max_shard_bytes=mib) as w:
        for i in range(150):
            ids = rng.integers(6, 500, int(rng.integers(20, 200)))
            images = [StoredMedia("image", rng.bytes(int(rng.integers(100_000, 400_000))), (1, 4, 4), 4)
                      for _ in range(int(rng.integers(0, 3)))]
            w.add_row([_seq(ids)], record_indices=[i], uids=[[i]], media=[images])
        w.close({"tokenizer_path": "/tok", "tokenizer_hash": "abc", "max_length": 256, "categories": {"0": "c"}})
    src = PackedDataset(tmp_path / "tokenized", verify="full")
    assert (src.row_nbytes() > src.row_n_tokens * src.dtype.itemsize).sum() > 50
    assert len(src.meta["shards"]) > 10
    _assert_cut_by_the_writers_rule(src, mib)
    with ShardWriter(tmp_path / "copy", token_fields=fields, kind="tokenized", media=True, max_shard_bytes=mib) as w:
        w.add_rows(src, 0, 70)
        w.add_rows(src, 70, len(src))
        w.close()
    assert _shard_sizes(PackedDataset(tmp_path / "copy")) == _shard_sizes(src)
    # tokenize's plan: parts of 40 rows cut from their totals, the per-row sizes read only where a cut falls
    with ShardWriter(tmp_path / "unused", token_fields=fields, kind="tokenized", media=True,
                     max_shard_bytes=mib) as w:
        plan = ShardPlan(w)
        for first in range(0, len(src), 40):
            part = tmp_path / f"part_{first}"
            with ShardWriter(part, token_fields=fields, kind="tokenized", media=True) as pw:
                pw.add_rows(src, first, first + 40)
                pw.close()
            counts = PackedDataset(part).meta["counts"]
            plan.add(str(part), counts["rows"], counts["tokens"], counts["image_bytes"])
        w.abort()
    assert [sum(seg.end - seg.start for seg in shard) for shard in plan.shards] == [
        shard["rows"] for shard in src.meta["shards"]]
    outputs = {}
    for workers in (1, 3):
        cfg = config(tmp_path)  # pack.shard_size_mb=1
        cfg.num_workers = workers
        pack.run(cfg)
        outputs[workers] = {p.name: p.read_bytes() for p in cfg.packed_dir.iterdir()}
    assert outputs[1] == outputs[3]
    packed = PackedDataset(cfg.packed_dir, verify="full")
    assert packed.meta["counts"]["image_bytes"] == src.meta["counts"]["image_bytes"]
    assert len(packed.meta["shards"]) > 10
    _assert_cut_by_the_writers_rule(packed, mib, greedy=False)


def test_text_pipeline_never_imports_pil_or_torchvision():
    """(transformers itself may import PIL where it is installed: the trainer's modules are not checked)"""
    code = ("import sys; import data.pipeline, data.preprocess, data.merge, data.tokenize, data.pack, data.media, "
            "train.steps.batch; bad = [m for m in ('PIL', 'torchvision') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_without_torchvision_an_image_record_says_how_to_set_it_up(tmp_path, monkeypatch):
    """(where .venv-vision is built, the message is the prefix instead: the next test)"""
    try:
        import torchvision  # noqa: F401
        pytest.skip("torchvision loads here (.venv-vision)")
    except Exception:
        pass
    from data.shards import processor
    from data.shards.processor import load_processor

    monkeypatch.setattr(processor, "VISION_VENV", tmp_path / ".venv-vision")  # not built

    with pytest.raises(ConfigError, match="scripts/setup_vision.sh"):
        load_processor(str(mm("qwen2_5_vl_processor")))


def test_without_torchvision_the_hint_is_the_prefix_when_the_image_environment_exists(tmp_path, monkeypatch):
    try:
        import torchvision  # noqa: F401
        pytest.skip("torchvision loads here (.venv-vision)")
    except Exception:
        pass
    from data.shards import processor as images

    processor = str(fixture_path("multimodal", "qwen2_5_vl_processor"))
    venv = tmp_path / ".venv-vision"
    monkeypatch.setattr(images, "VISION_VENV", venv)
    with pytest.raises(ConfigError, match=r"scripts/setup_vision.sh") as absent:
        images.load_processor(processor)
    assert "PACKSFT_VENV" not in str(absent.value)
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    with pytest.raises(ConfigError, match=r"the image environment is built \(.*\): run the command with the prefix "
                                          r"`PACKSFT_VENV=.venv-vision`, e.g. `PACKSFT_VENV=.venv-vision sh "
                                          r"data_process.sh CONFIG`"):
        images.load_processor(processor)


# ---------------------------------------------------------------------------------------------- the real processor
def _processor():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(mm("qwen2_5_vl_processor")))


def _reference(processor, record, **kwargs):
    """transformers alone: the processor's chat template on image parts, then processor(text, images)."""
    from PIL import Image

    messages = []
    for msg in record["messages"]:
        if "<image>" in msg["content"]:
            pieces = msg["content"].split("<image>")
            content = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
            for text in pieces[1:]:
                content += [{"type": "image"}] + ([{"type": "text", "text": text}] if text else [])
            msg = {**msg, "content": content}
        messages.append(msg)
    text = processor.apply_chat_template(messages, tokenize=False)
    images = [Image.open(mm(path)).convert("RGB") for path in record["images"]]
    return processor(text=[text], images=images, **kwargs)


def write_config(tmp_path, inputs, **extra):
    cfg = {"inputs": inputs, "output_dir": str(tmp_path / "out"),
           "tokenizer_path": str(mm("qwen2_5_vl_processor")), "max_length": 4096, "num_workers": 1, **extra}
    path = tmp_path / "config.json"
    path.write_bytes(orjson.dumps(cfg))
    return path


@pytest.mark.vision
def test_example_tokenizes_to_the_processors_ids_with_exact_masks(tmp_path, monkeypatch):
    """configs/data/example_vision.json (LLaMA-Factory's demo records and images from ../shared/fixtures) end to
    end: ids, grids and pixel values as transformers' processor gives them, masks from the answers alone."""
    from data.shards.media import MediaLoader
    from train.steps.batch import StepTotals, make_batch

    mm("mllm_demo.json")  # skips (fails in CI) without the fixtures
    processor = _processor()
    example = json.loads((ROOT / "configs" / "data" / "example_vision.json").read_text())
    limits = {"size": {"shortest_edge": 3136, "longest_edge": example["image_max_pixels"]}}
    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository root
    pipeline.main(["configs/data/example_vision.json", f"output_dir={tmp_path / 'out'}"])
    tokenized = PackedDataset(tmp_path / "out" / "tokenized", verify="full")
    merged = [orjson.loads(line) for line in (tmp_path / "out" / "merged.jsonl").read_bytes().splitlines()]
    records = demo_records()
    assert len(tokenized) == len(records) == 6
    for i in range(len(tokenized)):
        row = tokenized[i]
        uid = merged[int(row["record_index"][0])]["meta"]["uid"]
        ref = _reference(processor, records[uid], **limits)
        assert row["input_ids"].tolist() == ref["input_ids"][0]  # ids exactly the processor's
        assert row["image_grid_thw"].tolist() == ref["image_grid_thw"].tolist()
        assert [len(d) for d in row["image_data"]] == [mm(p).stat().st_size for p in records[uid]["images"]]
        labels, turns = row["labels"], row["turn_ids"]
        assert not (labels[row["input_ids"] == IMAGE_PAD] != -100).any()
        answers = [m["content"] for m in records[uid]["messages"] if m["role"] == "assistant"]
        trained = [processor.tokenizer.decode(row["input_ids"][turns == k]) for k in range(1, turns.max() + 1)]
        assert trained == [a + "<|im_end|>" for a in answers]
        assert (labels != -100).tolist() == (turns > 0).tolist()
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["tokenize"]["images"] == {"images": 8, "image_tokens": int(sum(
        (tokenized[i]["input_ids"] == IMAGE_PAD).sum() for i in range(6))),
        "image_bytes": sum(mm(p).stat().st_size for r in records for p in r["images"])}
    packed = PackedDataset(tmp_path / "out" / "packed", verify="full")
    assert packed.meta["counts"]["images"] == 8 and packed.meta["media"]["processor_path"]
    stats = json.loads((tmp_path / "out" / "packed" / "stats.json").read_text())
    assert stats["images"] == 8
    # the micro-batch: pixel values of the rows' images, in the order of their token runs, as the processor gives
    import torch

    rows = [packed[i] for i in range(len(packed))]
    batch = make_batch(rows, StepTotals(10 ** 6, 10 ** 6, 10 ** 6), "token", media=MediaLoader.of(packed.meta))
    images = batch.media
    grids = np.concatenate([r["image_grid_thw"] for r in rows])
    image_grid_thw = torch.cat([inputs["image_grid_thw"] for _, inputs in images.items])
    assert image_grid_thw.tolist() == grids.tolist() and len(images) == 8 and images.kinds == {"image"}
    order = [merged[int(k)]["meta"]["uid"] for r in rows for k in r["record_index"]]
    want = [_reference(processor, records[uid], **limits)["pixel_values"] for uid in order]
    assert torch.equal(torch.cat([inputs["pixel_values"] for _, inputs in images.items]), torch.cat(want))
    assert int((batch.input_ids == IMAGE_PAD).sum()) == int(image_grid_thw.prod(-1).sum()) // 4
    # online packing of tokenized/ carries the images of its rows the same way
    from train.steps.online import open_train_dataset

    online = open_train_dataset(str(tmp_path / "out" / "tokenized"), 2048, seed=0)
    rows = [online[i] for i in range(len(online))]
    batch = make_batch(rows, StepTotals(10 ** 6, 10 ** 6, 10 ** 6), "token", media=MediaLoader.of(online.meta))
    pads = sum(int((tokenized[i]["input_ids"] == IMAGE_PAD).sum()) for i in range(len(tokenized)))
    assert len(batch.media) == 8 and int((batch.input_ids == IMAGE_PAD).sum()) == pads


@pytest.mark.vision
def test_pixel_limits_override_the_processor_and_long_image_records_are_dropped_not_cut(tmp_path):
    processor = _processor()
    limit = 56 * 56 * 4  # 4 merged patches at most
    size = {"shortest_edge": 3136, "longest_edge": limit}
    refs = [_reference(processor, record, size=size)["input_ids"][0] for record in demo_records()]
    cap = sorted(len(ids) for ids in refs)[len(refs) // 2]  # about half the records are longer
    config = write_config(tmp_path, [{"path": str(mm("mllm_demo.json"))}], image_max_pixels=limit, max_length=cap,
                          overlong="truncate")
    pipeline.main([str(config), "--stages", "preprocess,sample,merge,tokenize"])
    tokenized = PackedDataset(tmp_path / "out" / "tokenized")
    merged = [orjson.loads(line) for line in (tmp_path / "out" / "merged.jsonl").read_bytes().splitlines()]
    for i in range(len(tokenized)):
        row = tokenized[i]
        ref = refs[merged[int(row["record_index"][0])]["meta"]["uid"]]
        assert row["input_ids"].tolist() == ref
        assert (row["image_grid_thw"].prod(-1) * 14 * 14 <= limit).all()
    report = json.loads((tmp_path / "out" / "report.json").read_text())["tokenize"]
    longer = sum(len(ids) > cap for ids in refs)
    assert longer and report["dropped"] == {"overlong": longer} and report["truncated"] == 0


@pytest.mark.vision
def test_image_errors_stop_or_are_counted_and_image_records_are_never_merged(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "img").mkdir()
    (data / "img" / "ok.jpg").write_bytes(mm("mllm_demo_data", "2.jpg").read_bytes())
    (data / "img" / "broken.jpg").write_bytes(b"not a jpeg")
    good = {"messages": [{"role": "user", "content": "<image>Who?"}, {"role": "assistant", "content": "Him."}],
            "images": ["img/ok.jpg"]}
    text = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    rows = [good, text, {**good, "images": ["img/broken.jpg"]}, text,
            {**good, "images": ["img/missing.jpg"]}, {**good, "images": []}, good, text]
    (data / "mixed.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    config = write_config(tmp_path, [{"path": str(data / "mixed.jsonl")}], merge={"probability": 1.0})
    with pytest.raises(SystemExit):  # the missing image stops preprocess, naming file, line and field
        pipeline.main([str(config)])
    assert f"{data / 'mixed.jsonl'}:5: images[0]: image file {data / 'img' / 'missing.jpg'} does not exist" \
        in capsys.readouterr().err
    pipeline.main([str(config), "on_error=skip"])
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["preprocess"]["dropped"] == {"image_count_mismatch": 1, "missing_image": 1}
    assert report["merge"]["blocked"].get("media", 0) >= 2  # joins next to an image record refused
    assert report["tokenize"]["dropped"] == {"bad_image": 1}
    assert report["tokenize"]["images"]["images"] == 2
    merged = [orjson.loads(line) for line in (tmp_path / "out" / "merged.jsonl").read_bytes().splitlines()]
    assert all(len(r["meta"].get("uids", [0])) == 1 for r in merged if r.get("images"))
    with pytest.raises(SystemExit):  # the unreadable image stops tokenize, naming the record and its input line
        pipeline.main([str(config), "on_error=error", "--stages", "tokenize"])
    err = capsys.readouterr().err
    assert f"(from {data / 'mixed.jsonl'}:3): images[0]: unreadable image" in err
