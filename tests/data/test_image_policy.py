"""Images from anywhere, and decompression bombs: an image path must resolve (after symlinks) under its data file's
directory or a configured `image_root`, else it is a bad record naming file:line, the field and the path; an image
of more than `image_pixel_limit` pixels is a bad record too, found from its header before anything is decoded."""
from __future__ import annotations

import json
import os

import orjson
import pytest

from common.config import ConfigError
from data import pipeline
from data.config import DataConfig, InputSpec
from data.media import resolve_media
from data.shards.decode import DEFAULT_PIXEL_LIMIT, decode_image
from data.shards.media import MediaLoader
from data.records import RecordError
from data.report import read_report
from tests.conftest import ROOT

Image = pytest.importorskip("PIL.Image")


def _png(path, size, mode="L") -> bytes:
    """A PNG of one colour: a 12000x12000 one is ~20 KB on disk and 18 MB in memory as mode "1"."""
    Image.new(mode, size).save(path, format="PNG")
    return path.read_bytes()


@pytest.fixture
def layout(tmp_path):
    """data/ holding the data file and img/a.png; elsewhere/b.png beside it; data/link.png -> elsewhere/b.png."""
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    (data / "img").mkdir(parents=True)
    elsewhere.mkdir()
    _png(data / "img" / "a.png", (8, 8))
    _png(elsewhere / "b.png", (8, 8))
    os.symlink(elsewhere / "b.png", data / "link.png")
    return data, elsewhere


def test_image_paths_resolve_under_the_data_files_directory_or_an_image_root(layout):
    data, elsewhere = layout
    base = str(data)
    assert resolve_media("image", "img/a.png", base, "d.jsonl:1", "images[0]") == str(data / "img" / "a.png")
    assert resolve_media("image", str(data / "img" / "a.png"), base, "d.jsonl:1", "images[0]") == str(data / "img" / "a.png")
    assert resolve_media("image", "data:image/png;base64,AAAA", base, "d.jsonl:1", "images[0]").startswith("data:")
    outside = [("../elsewhere/b.png", elsewhere / "b.png", ""), (str(elsewhere / "b.png"), elsewhere / "b.png", ""),
               (f"file://{elsewhere / 'b.png'}", elsewhere / "b.png", ""),
               ("link.png", elsewhere / "b.png", f" (via {data / 'link.png'})"),
               ("/etc/passwd", "/etc/passwd", "")]
    for ref, real, via in outside:
        with pytest.raises(RecordError) as info:
            resolve_media("image", ref, base, "d.jsonl:3", "images[1]")
        exc = info.value
        assert (exc.source, exc.field, exc.reason) == ("d.jsonl:3", "images[1]", "image_outside_root")
        assert str(exc) == (f"d.jsonl:3: images[1]: image {ref} resolves to {real}{via}, which is not under the data "
                            f"file's directory {data}: add the directory holding the images to image_root in the "
                            "data config to read them")
    # an image root admits what lies under it (symlinks resolved there too), nothing else
    roots = (str(elsewhere),)
    for ref in ("../elsewhere/b.png", str(elsewhere / "b.png"), f"file://{elsewhere / 'b.png'}", "link.png"):
        assert resolve_media("image", ref, base, "d.jsonl:1", "images[0]", roots) == os.path.abspath(
            os.path.join(base, ref.removeprefix("file://")))
    with pytest.raises(RecordError, match=r"not under the data file's directory .* nor under image_root "):
        resolve_media("image", "/etc/passwd", base, "d.jsonl:1", "images[0]", roots)
    # a sibling whose name starts like the root is not under it
    (data.parent / "data2").mkdir()
    _png(data.parent / "data2" / "c.png", (8, 8))
    with pytest.raises(RecordError, match="image_outside_root|not under"):
        resolve_media("image", "../data2/c.png", base, "d.jsonl:1", "images[0]")


def _config(tmp_path, data, **kw) -> str:
    rows = [{"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "A."}],
             "images": [ref]} for ref in ("img/a.png", "../elsewhere/b.png", "img/a.png")]
    (data / "d.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    path = tmp_path / "c.json"
    path.write_bytes(orjson.dumps({"inputs": [{"path": str(data / "d.jsonl"), "category_name": "v"}],
                                   "output_dir": str(tmp_path / "out"), "tokenizer_path": "unused",
                                   "stages": ["preprocess"], "num_workers": 1, **kw}))
    return str(path)


def test_preprocess_stops_on_an_image_outside_or_counts_it_under_skip(layout, tmp_path, capsys):
    """Through the pipeline: the error names file:line, the field and the path; `on_error: skip` counts it in
    report.json (`dropped`, `dropped_at`); `image_root` admits it."""
    data, elsewhere = layout
    config = _config(tmp_path, data)
    with pytest.raises(SystemExit) as exit_info:
        pipeline.main([config])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {data / 'd.jsonl'}:2: images[0]: image ../elsewhere/b.png resolves to {elsewhere / 'b.png'}, which "
        f"is not under the data file's directory {data}: add the directory holding the images to image_root in the "
        "data config to read them")
    assert not (tmp_path / "out" / "canonical.jsonl").exists()
    pipeline.main([config, "on_error=skip"])
    section = read_report(tmp_path / "out" / "report.json")["preprocess"]
    assert (section["out"], section["dropped"]) == (2, {"image_outside_root": 1})
    assert section["dropped_at"] == {"image_outside_root": [f"{data / 'd.jsonl'}:2"]}
    pipeline.main([config, f"image_root={elsewhere}"])
    records = [orjson.loads(line) for line in (tmp_path / "out" / "canonical.jsonl").read_bytes().splitlines()]
    assert [r["images"] for r in records] == [[str(data / "img" / "a.png")], [str(elsewhere / "b.png")],
                                              [str(data / "img" / "a.png")]]


def test_image_config_keys_are_checked(tmp_path):
    cfg = DataConfig(inputs=[InputSpec(path=[str(ROOT / "data/example/raw/math.jsonl")])], output_dir=str(tmp_path),
                     tokenizer_path="unused", stages=["sample"], image_root=[str(tmp_path / "nope")])
    with pytest.raises(ConfigError, match=f"^image_root: {tmp_path / 'nope'} is not a directory$"):
        cfg.validate()
    cfg.image_root, cfg.image_pixel_limit = [], 0
    with pytest.raises(ConfigError, match=r"^image_pixel_limit must be a positive number of pixels \(null: no "
                                          r"bound\), got 0$"):
        cfg.validate()
    assert DataConfig(inputs=[], output_dir="o", tokenizer_path="t").image_pixel_limit == DEFAULT_PIXEL_LIMIT


def test_an_image_over_the_pixel_limit_is_refused_from_its_header_before_decoding(tmp_path, monkeypatch):
    """A 12000x12000 PNG of ~20 KB (144M pixels: 432 MB as RGB, 2.8 GB RSS through the processor) is a bad record
    before PIL decodes a pixel; one at the limit decodes."""
    bomb = _png(tmp_path / "bomb.png", (12000, 12000), mode="1")
    assert len(bomb) < 100_000
    from PIL import ImageFile

    decoded = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self.size) or real_load(self))
    with pytest.raises(RecordError) as info:
        decode_image(bomb, "merged.jsonl:4 (from d.jsonl:9)", "images[0]")
    assert (info.value.field, info.value.reason) == ("images[0]", "image_too_large")
    assert str(info.value) == (
        "merged.jsonl:4 (from d.jsonl:9): images[0]: image of 12000x12000 = 144,000,000 pixels exceeds "
        "image_pixel_limit=89,478,485 (read from its header, not decoded): downscale it, or raise image_pixel_limit "
        "in the data config")
    assert decoded == []
    small = _png(tmp_path / "small.png", (10, 10))
    assert decode_image(small, "s", "images[0]", pixel_limit=100).size == (10, 10)
    assert set(decoded) == {(10, 10)}  # this one is decoded (the probe sees decoding)
    with pytest.raises(RecordError, match="image of 10x10 = 100 pixels exceeds image_pixel_limit=99 "):
        decode_image(small, "s", "images[0]", pixel_limit=99)


def test_the_trainer_decodes_under_the_limit_tokenize_used():
    """meta.json's `images.pixel_limit` reaches the trainer's loader; a dataset from before the key gets the
    default (PIL's bound, which applied then)."""
    meta = {"images": {"processor_path": "p", "min_pixels": None, "max_pixels": None, "pixel_limit": 1234}}
    assert MediaLoader.of(meta).processor.settings.image_pixel_limit == 1234
    del meta["images"]["pixel_limit"]
    assert MediaLoader.of(meta).processor.settings.image_pixel_limit == DEFAULT_PIXEL_LIMIT


@pytest.mark.vision
def test_tokenize_stops_on_a_pixel_bomb_or_counts_it_under_skip(tmp_path, capsys):
    """Through the pipeline with the real processor: a record whose image is over the limit stops tokenize with
    its merged.jsonl line and raw line, or under skip is dropped as `image_too_large`; meta.json records the limit."""
    from tests.conftest import fixture_path

    processor = fixture_path("multimodal", "qwen2_5_vl_processor")
    data = tmp_path / "data"
    data.mkdir()
    _png(data / "ok.png", (64, 64), mode="RGB")
    _png(data / "bomb.png", (12000, 12000), mode="1")
    rows = [{"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "A."}],
             "images": [name]} for name in ("ok.png", "bomb.png", "ok.png")]
    (data / "d.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"inputs": [{"path": str(data / "d.jsonl"), "category_name": "v"}],
                                  "output_dir": str(tmp_path / "out"), "tokenizer_path": str(processor),
                                  "num_workers": 1, "max_length": 1024, "image_max_pixels": 200704,
                                  "stages": ["preprocess", "sample", "merge", "tokenize"]}))
    with pytest.raises(SystemExit):
        pipeline.main([str(config)])
    err = capsys.readouterr().err
    assert (f"(from {data / 'd.jsonl'}:2): images[0]: image of 12000x12000 = 144,000,000 pixels exceeds "
            "image_pixel_limit=89,478,485 (read from its header, not decoded)") in err
    pipeline.main([str(config), "on_error=skip"])
    section = read_report(tmp_path / "out" / "report.json")["tokenize"]
    assert (section["out"], section["dropped"]) == (2, {"image_too_large": 1})
    meta = orjson.loads((tmp_path / "out" / "tokenized" / "meta.json").read_bytes())
    assert meta["media"]["image_pixel_limit"] == 89_478_485
