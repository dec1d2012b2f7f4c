"""engine: ray gives the bytes of engine: local (one small Ray instance for the module, 2 CPUs), also when the
results come back out of order, when a worker is killed mid-stage, and for bad records."""
import dataclasses
import shutil
from pathlib import Path

import orjson
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -r requirements-ray.txt)")
pytestmark = [pytest.mark.timeout(300), pytest.mark.serial]  # a worker that cannot start is retried by Ray forever: fail instead

from data import engine_ray, pack, pipeline, preprocess, tokenize  # noqa: E402
from data.config import STAGES, load_config  # noqa: E402
from data.executor import LocalExecutor, Part  # noqa: E402
from data.records import RecordError  # noqa: E402
from data.shards.dataset import PackedDataset, ShardWriter  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

OUTPUTS = ("canonical.jsonl", "sampled.jsonl", "merged.jsonl", "tokenized", "packed", "report.json")


def fault_hooks(fault_dir: Path):
    """A Ray worker start-up hook (a closure, so Ray ships it by value: workers cannot import tests/) that wraps
    the tokenize range function to misbehave when the test arms it. `sleep`: a random delay per range (results
    finish out of order); `kill`: the first range to run after arming kills its worker process (os._exit, as an
    OOM kill would), once. Every range also leaves `node-<id>` naming the Ray node that ran it."""

    root = str(ROOT)

    def install():
        import os
        import random
        import sys
        import time

        sys.path.insert(0, root)  # the hook runs before Ray puts the driver's sys.path on the worker's
        from data import tokenize

        real = tokenize.tokenize_range

        def range_with_faults(task):
            import ray

            (fault_dir / f"node-{ray.get_runtime_context().get_node_id()}").touch()
            if (fault_dir / "sleep").exists():
                time.sleep(random.random() * 0.2)
            if (fault_dir / "kill").exists():
                try:
                    os.close(os.open(fault_dir / "killed", os.O_CREAT | os.O_EXCL))  # one attempt claims it
                except FileExistsError:
                    pass
                else:
                    os._exit(1)
            return real(task)

        tokenize.tokenize_range = range_with_faults

    return install


@pytest.fixture(scope="module")
def fault_dir(tmp_path_factory):
    """One Ray instance for the module (2 CPUs, no dashboard), shut down at the end: only if this module
    started it."""
    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process; these tests start their own instance")
    fault_dir = tmp_path_factory.mktemp("faults")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"},
                          "worker_process_setup_hook": fault_hooks(fault_dir)})
    yield fault_dir
    ray.shutdown()


def example_config(tmp_path, name, *overrides):
    """configs/data/example.json with absolute paths, its own copy of the ratio file, output in tmp_path/name."""
    raw = orjson.loads((ROOT / "configs/data/example.json").read_bytes())
    tmp_path.mkdir(parents=True, exist_ok=True)
    ratios = tmp_path / "ratios.json"  # preprocess writes it (every rate 1.0), as the example's first run does
    args = [f"output_dir={tmp_path / name}", f"ratio_path={ratios}", f"tokenizer_path={ROOT / raw['tokenizer_path']}",
            "inputs=" + orjson.dumps([{**spec, "path": str(ROOT / spec["path"])} for spec in raw["inputs"]]).decode()]
    cfg = load_config(ROOT / "configs/data/example.json", args + list(overrides))
    cfg.validate()
    return cfg


def tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def assert_same_outputs(local_dir: Path, ray_dir: Path, names=OUTPUTS):
    for name in names:
        a, b = local_dir / name, ray_dir / name
        if a.is_dir():
            assert tree(a) == tree(b), f"{name}/ differs"
        else:
            assert a.read_bytes() == b.read_bytes(), f"{name} differs"


def run_local_then_ray(tmp_path, *overrides, stages=None):
    """The same config run by both engines into the same output_dir (meta.json records it); the local output
    is moved to tmp_path/local first. Returns (local dir, ray dir)."""
    cfg = example_config(tmp_path, "out", "num_workers=2", *overrides)
    if stages:
        cfg.stages = stages
    pipeline.run_pipeline(cfg)
    shutil.move(cfg.out, tmp_path / "local")
    pipeline.run_pipeline(dataclasses.replace(cfg, engine="ray"))
    return tmp_path / "local", cfg.out


@pytest.fixture(scope="module")
def local_example(tmp_path_factory):
    """The whole local pipeline on the example config, once for the module."""
    tmp = tmp_path_factory.mktemp("local")
    cfg = example_config(tmp, "out", "num_workers=2")
    pipeline.run_pipeline(cfg)
    return cfg


def rerun_on_ray(local_cfg, tmp_path, stages):
    """Run `stages` with engine: ray over the local run's output_dir (meta.json records the path), assert the
    outputs are byte-identical to the local ones, then put the local run back."""
    snapshot = tmp_path / "local"
    shutil.copytree(local_cfg.out, snapshot)
    try:
        pipeline.run_pipeline(dataclasses.replace(local_cfg, engine="ray", stages=stages))
        assert_same_outputs(snapshot, local_cfg.out)
    finally:
        shutil.rmtree(local_cfg.out)
        shutil.copytree(snapshot, local_cfg.out)


def test_ray_output_is_byte_identical_to_local_with_results_out_of_order(fault_dir, local_example, tmp_path):
    (fault_dir / "sleep").touch()
    try:
        rerun_on_ray(local_example, tmp_path, list(STAGES))
    finally:
        (fault_dir / "sleep").unlink()
    report = orjson.loads(local_example.report_path.read_bytes())
    assert list(report) == list(STAGES)
    assert report["merge"]["dropped"]["merged_into_previous"] > 0  # pseudo-multiturn merging took place


def test_worker_killed_mid_tokenize_is_retried_and_output_identical(fault_dir, local_example, tmp_path):
    (fault_dir / "kill").touch()
    try:
        rerun_on_ray(local_example, tmp_path, ["tokenize", "pack"])
        assert (fault_dir / "killed").exists(), "the fault did not fire"
    finally:
        (fault_dir / "kill").unlink()
        (fault_dir / "killed").unlink(missing_ok=True)


def test_stage_module_cli_runs_its_stage_on_ray(fault_dir, local_example, tmp_path, capsys):
    """`python -m data.tokenize config.json engine=ray` (cli_main) runs that one stage on Ray, same bytes."""
    snapshot = tmp_path / "local"
    shutil.copytree(local_example.out, snapshot)
    config = tmp_path / "config.json"
    config.write_bytes(orjson.dumps(dataclasses.asdict(local_example)))
    try:
        pipeline.cli_main(tokenize.run, "tokenize", [str(config), "engine=ray"])
        assert_same_outputs(snapshot, local_example.out, ["tokenized"])
    finally:
        shutil.rmtree(local_example.out)
        shutil.copytree(snapshot, local_example.out)
    assert "[tokenize] in=348 out=348" in capsys.readouterr().out


def test_pack_on_ray_equals_local_for_any_worker_count(fault_dir, local_example, tmp_path, monkeypatch):
    """pack.run's one program on Ray and on 1 or 3 local processes: the same packed/, with several partitions
    (each planned by a worker, its rows released to the global pass) and several shards per partition."""
    monkeypatch.setattr(pack, "PARTITION_SEQUENCES", 64)  # read by the driver only
    cfg = dataclasses.replace(local_example, output_dir=str(tmp_path / "out"),
                              pack=dataclasses.replace(local_example.pack, shard_size_mb=1))
    shutil.copytree(local_example.out, cfg.out, ignore=shutil.ignore_patterns("packed"))
    outputs = {}
    for name, executor in (("local1", LocalExecutor(1)), ("local3", LocalExecutor(3)),
                           ("ray", engine_ray.RayExecutor(2))):
        pack.run(cfg, executor=executor)
        outputs[name] = tree(cfg.packed_dir)
    meta = orjson.loads(outputs["ray"]["meta.json"])
    assert len(meta["shards"]) > len(PackedDataset(cfg.tokenized_dir)) // 64  # a shard (at least) per partition
    assert outputs["ray"] == outputs["local1"] == outputs["local3"]


def test_chunk_map_yields_chunk_order_when_ray_does_not(fault_dir):
    """The driver's reorder buffer alone restores chunk order: Ray's preserve_order off, tasks of random length."""
    def sleepy_square(x):
        import random
        import time

        time.sleep(random.random() * 0.05)
        return x * x

    import ray.data

    context = ray.data.DataContext.get_current()
    preserve = context.execution_options.preserve_order
    context.execution_options.preserve_order = False
    try:
        out = list(engine_ray.RayExecutor(2, window=16).map(sleepy_square, iter(range(40))))
    finally:
        context.execution_options.preserve_order = preserve
    assert out == [x * x for x in range(40)]


@pytest.mark.parametrize("size, chunks, window", [("ranges", 40, 16), ("ranges", 3, None), ("records", 9, None),
                                                  ("records", 300, None), ("ranges", 5000, None)])
def test_ray_tasks_is_what_a_map_launches(fault_dir, size, chunks, window):
    """`ray_tasks` (the projection's count of Ray tasks) is what `RayExecutor.map` launches."""
    executor = engine_ray.RayExecutor(2, window=window)
    assert list(executor.map(abs, range(chunks), size=size)) == list(range(chunks))
    assert executor.tasks == engine_ray.ray_tasks(chunks, size, 2, window)
    assert executor.maps == [(size, chunks)]


def _written_parts(directory: Path, contents: list[bytes]) -> list[Part]:
    directory.mkdir()
    for k, content in enumerate(contents):
        (directory / f"part{k}").write_bytes(content)
    return [Part.written(directory / f"part{k}") for k in range(len(contents))]


@pytest.mark.parametrize("sizes", [[], [0], [5, 0, 3 << 20, 1, 0]])
def test_concatenate_writes_the_same_file_on_both_executors(fault_dir, tmp_path, sizes):
    """Local: the driver appends the parts; Ray: the workers copy each to its offset. The same bytes, the parts
    removed; a failure while the parts arrive leaves the previous output as it was and no temporary."""
    contents = [bytes([k % 251]) * size for k, size in enumerate(sizes)]
    for name, executor in (("local", LocalExecutor(2)), ("ray", engine_ray.RayExecutor(2, window=2))):
        parts = _written_parts(tmp_path / name, contents)
        out = tmp_path / f"{name}.out"
        executor.concatenate(out, iter(parts))
        assert out.read_bytes() == b"".join(contents)
        assert not any(Path(part.path).exists() for part in parts)

        def failing():
            yield from _written_parts(tmp_path / f"{name}-again", [b"new"] * 3)
            raise RecordError("later.jsonl:1", "line", "unreadable", "malformed_json")

        with pytest.raises(RecordError):
            executor.concatenate(out, failing())
        assert out.read_bytes() == b"".join(contents)
        assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == sorted(
            f"{n}.out" for n in ("local", "ray")[:1 + (name == "ray")])


def _fails_on_seven(x):
    if x == 7:
        raise ValueError("chunk 7")
    return x


def test_chunk_map_raises_the_first_error_in_chunk_order(fault_dir):
    """An error of the chunk source itself (the driver reading a later input) comes after the results of the
    chunks before it, so a worker's error in an earlier chunk is raised first, as in chunk order; results stream
    out of a window before the window ends."""
    def chunks(n):
        yield from range(n)
        raise RecordError("later.jsonl:1", "line", "unreadable", "malformed_json")

    out = []
    with pytest.raises(RecordError, match="later.jsonl:1"):
        for x in engine_ray.RayExecutor(2, window=4).map(_fails_on_seven, chunks(6)):
            out.append(x)
    assert out == list(range(6))
    with pytest.raises(ValueError, match="chunk 7"):
        list(engine_ray.RayExecutor(2, window=4).map(_fails_on_seven, chunks(10)))
    with pytest.raises(ValueError, match="chunk 7"):  # the source fails inside the window holding chunk 7
        list(engine_ray.RayExecutor(2, window=16).map(_fails_on_seven, chunks(10)))


BAD_CODE_RECORD = {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]}


def _with_bad_record(tmp_path):
    """The example's code.jsonl with a record of unknown role on line 3."""
    lines = (ROOT / "data/example/raw/code.jsonl").read_bytes().splitlines(True)
    bad = tmp_path / "code.jsonl"
    bad.write_bytes(b"".join(lines[:2] + [orjson.dumps(BAD_CODE_RECORD) + b"\n"] + lines[2:]))
    raw = orjson.loads((ROOT / "configs/data/example.json").read_bytes())
    inputs = [{**spec, "path": str(bad if spec["path"].endswith("code.jsonl") else ROOT / spec["path"])}
              for spec in raw["inputs"]]
    return "inputs=" + orjson.dumps(inputs).decode(), f"{bad}:3: messages[1].role: unknown role 'robot'"


def _error_of(cfg) -> str:
    with pytest.raises(RecordError) as info:
        pipeline.run_pipeline(cfg)
    return str(info.value)


def test_bad_record_gives_the_same_error_and_the_same_skip_count(fault_dir, tmp_path):
    inputs, where = _with_bad_record(tmp_path)
    # one worker: the local engine runs inline (a local Pool ended early by the error, forked from a process
    # that runs Ray's threads, can hang in Pool.terminate)
    cfg = example_config(tmp_path, "out", "num_workers=1", inputs)
    cfg.stages = ["preprocess"]
    local_error = _error_of(cfg)
    assert local_error.startswith(where)
    cfg.engine = "ray"
    assert _error_of(cfg) == local_error

    local_dir, ray_dir = run_local_then_ray(tmp_path / "skip", inputs, "on_error=skip", stages=["preprocess"])
    assert_same_outputs(local_dir, ray_dir, ["canonical.jsonl", "report.json"])
    assert orjson.loads((ray_dir / "report.json").read_bytes())["preprocess"]["dropped"] == {"unknown_role": 1}


def test_a_record_rejected_in_a_worker_raises_the_same_error(fault_dir, local_example, tmp_path, monkeypatch):
    """tokenize: the RecordError is made in the Ray worker and raised by the driver, as with local processes,
    naming the same merged.jsonl line although the worker read a byte range of ~1 record (500 bytes)."""
    monkeypatch.setattr(tokenize, "RANGE_BYTES", 500)
    cfg = example_config(tmp_path, "out", "num_workers=1", "max_length=300", "pack.max_length=300",
                         "overlong=error")  # one worker: see test_bad_record_gives_the_same_error...
    cfg.stages = ["tokenize"]
    # without the record of what merged.jsonl was made from (merge's budget was another max_length): a warning
    shutil.copytree(local_example.out, cfg.out, ignore=shutil.ignore_patterns("tokenized", "packed", "provenance.json"))
    local_error = _error_of(cfg)
    assert "tokens > max_length 300" in local_error and "merged.jsonl:" in local_error
    cfg.engine = "ray"
    assert _error_of(cfg) == local_error



def test_tokenize_rows_are_written_by_the_workers_not_the_driver(fault_dir, local_example, tmp_path, monkeypatch):
    """engine ray: the driver adds no tokenized row itself (the workers write a part per range, and the parts are
    re-cut into the writer's shards on the workers too), and tokenized/ has the bytes of the local run, also
    when shard boundaries fall inside parts (20 kB shards, 16 kB ranges of merged.jsonl). The driver reads no
    line of merged.jsonl: the workers read their byte ranges."""
    real_init = ShardWriter.__init__

    def small_shards(self, *args, max_shard_bytes=1 << 30, **kwargs):
        real_init(self, *args, max_shard_bytes=min(max_shard_bytes, 20_000), **kwargs)

    monkeypatch.setattr(ShardWriter, "__init__", small_shards)  # this process only: Ray workers are others
    monkeypatch.setattr(tokenize, "RANGE_BYTES", 16_000)  # ranges are cut by the driver
    cfg = example_config(tmp_path, "out", "num_workers=1")
    cfg.stages = ["tokenize"]
    shutil.copytree(local_example.out, cfg.out, ignore=shutil.ignore_patterns("tokenized", "packed"))
    pipeline.run_pipeline(cfg)
    shutil.move(cfg.tokenized_dir, tmp_path / "local")

    driver_rows, driver_reads = [], []

    def counted(method):
        def wrapper(self, *args, **kwargs):
            driver_rows.append(self.out_dir)
            return method(self, *args, **kwargs)
        return wrapper

    def reads_of_merged(path, *args, **kwargs):
        driver_reads.append(path)
        raise AssertionError(f"the driver read {path}")

    monkeypatch.setattr(ShardWriter, "add_row", counted(ShardWriter.add_row))
    monkeypatch.setattr(ShardWriter, "add_rows", counted(ShardWriter.add_rows))
    monkeypatch.setattr(tokenize, "read_lines", reads_of_merged)
    pipeline.run_pipeline(dataclasses.replace(cfg, engine="ray"))
    assert driver_rows == [] and driver_reads == []
    assert tree(cfg.tokenized_dir) == tree(tmp_path / "local")
    meta = orjson.loads((cfg.tokenized_dir / "meta.json").read_bytes())
    assert len(meta["shards"]) > 3 and meta["counts"]["rows"] == 348
    assert not list(cfg.out.glob(".tokenize*")), "parts or temp dirs left behind"


def _deep_bad_input(tmp_path, *extra_lines):
    """The example's code.jsonl 4 times (so byte ranges of a few hundred bytes cut it into many), with a record
    of unknown role deep in it and `extra_lines` (line number, bytes) put in before; returns (inputs override,
    path, line of the bad record)."""
    lines = (ROOT / "data/example/raw/code.jsonl").read_bytes().splitlines(True) * 4
    lines.insert(len(lines) - 3, orjson.dumps(BAD_CODE_RECORD) + b"\n")
    bad_line = len(lines) - 3
    for lineno, line in extra_lines:
        lines.insert(lineno - 1, line)
        bad_line += 1
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "code.jsonl"
    path.write_bytes(b"".join(lines))
    raw = orjson.loads((ROOT / "configs/data/example.json").read_bytes())
    inputs = [{**spec, "path": str(path if spec["path"].endswith("code.jsonl") else ROOT / spec["path"])}
              for spec in raw["inputs"]]
    return "inputs=" + orjson.dumps(inputs).decode(), path, bad_line


def test_input_byte_ranges_give_the_errors_and_skips_of_local(fault_dir, tmp_path, monkeypatch):
    """preprocess on Ray: workers read .jsonl byte ranges (here ~300 bytes: many per file); a bad record deep in
    a multi-range file gives the local `file:line` error, and under skip every record's `meta.source` line
    (canonical.jsonl) and every count are those of the local run."""
    from data.io import jsonl_byte_ranges

    monkeypatch.setattr(preprocess, "INPUT_RANGE_BYTES", 300)
    inputs, path, bad_line = _deep_bad_input(tmp_path / "error")
    assert len(list(jsonl_byte_ranges(str(path), 0, 300))) > 5
    cfg = example_config(tmp_path / "error", "out", "num_workers=1", inputs)
    cfg.stages = ["preprocess"]
    local_error = _error_of(cfg)
    assert local_error.startswith(f"{path}:{bad_line}: messages[1].role: unknown role 'robot'")
    cfg.engine = "ray"
    assert _error_of(cfg) == local_error

    inputs, path, bad_line = _deep_bad_input(tmp_path / "skip", (3, b"\n"), (9, b'{"messages": [\n'), (12, b"[1]\n"))
    local_dir, ray_dir = run_local_then_ray(tmp_path / "skip", inputs, "on_error=skip", stages=["preprocess"])
    assert_same_outputs(local_dir, ray_dir, ["canonical.jsonl", "report.json"])
    report = orjson.loads((ray_dir / "report.json").read_bytes())["preprocess"]
    assert report["dropped"] == {"malformed_json": 2, "unknown_role": 1}
    assert f'"source":"{path}:{bad_line + 1}"'.encode() in (ray_dir / "canonical.jsonl").read_bytes()


def test_dropped_sources_are_those_of_local(fault_dir, tmp_path, monkeypatch):
    """report.json's `dropped_at` under skip: the driver finds the lines that fail format detection at the start
    of a .jsonl before the workers report the bad lines of later byte ranges (~300 bytes here), of this input and
    of the next one; the sources listed, in input order and capped at DROPPED_AT_LIMIT, are the local ones."""
    from data.io import jsonl_byte_ranges
    from data.report import DROPPED_AT_LIMIT

    monkeypatch.setattr(preprocess, "INPUT_RANGE_BYTES", 300)
    code = (ROOT / "data/example/raw/code.jsonl").read_bytes().splitlines(True)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_bytes(b"{oops\n" + b'{"foo": 1}\n' + b"".join(line + b"[1]\n" for line in code[:45]))
    second.write_bytes(b"".join(code[:3]) + b"{oops\n" + orjson.dumps(BAD_CODE_RECORD) + b"\n" + b"[2]\n" * 80)
    assert len(list(jsonl_byte_ranges(str(first), 0, 300))) > 5
    raw = orjson.loads((ROOT / "configs/data/example.json").read_bytes())
    inputs = [{"path": [str(first), str(second)], "category_name": "code"}]
    inputs += [{**spec, "path": str(ROOT / spec["path"])} for spec in raw["inputs"] if "math" in spec["path"]]
    local_dir, ray_dir = run_local_then_ray(tmp_path, "inputs=" + orjson.dumps(inputs).decode(), "on_error=skip",
                                            f"ratio_path={tmp_path / 'code_math_ratios.json'}", stages=["preprocess"])
    assert_same_outputs(local_dir, ray_dir, ["canonical.jsonl", "report.json"])
    report = orjson.loads((ray_dir / "report.json").read_bytes())["preprocess"]
    n_malformed = 1 + 45 + 1 + 80
    assert report["dropped"] == {"malformed_json": n_malformed, "unknown_format": 1, "unknown_role": 1}
    assert n_malformed > DROPPED_AT_LIMIT
    malformed = [f"{first}:1"] + [f"{first}:{2 + 2 * k}" for k in range(1, 46)] + [f"{second}:4"]
    malformed += [f"{second}:{line}" for line in range(6, 86)]
    assert report["dropped_at"] == {"malformed_json": malformed[:DROPPED_AT_LIMIT],
                                    "unknown_format": [f"{first}:2"], "unknown_role": [f"{second}:5"]}


def test_parquet_row_groups_give_the_errors_and_skips_of_local(fault_dir, tmp_path):
    """preprocess on Ray: a .parquet input of a set format is read one row group per task by the workers; row
    indices (`path:row`) of errors and of every record's `meta.source`, and the counts, are the local ones."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"q": f"question {i}", "a": None if i == 37 else f"answer {i}"} for i in range(60)]
    path = tmp_path / "qa.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    assert preprocess._parquet_row_groups(str(path)) == [7] * 8 + [4]
    spec = {"path": str(path), "format": "prompt_response", "prompt_key": "q", "response_key": "a",
            "category_name": "qa"}
    overrides = ("inputs=" + orjson.dumps([spec]).decode(), f"ratio_path={tmp_path / 'qa_ratios.json'}")
    cfg = example_config(tmp_path, "out", "num_workers=1", *overrides)
    cfg.stages = ["preprocess"]
    local_error = _error_of(cfg)
    assert local_error.startswith(f"{path}:37: a: missing field 'a'")
    cfg.engine = "ray"
    assert _error_of(cfg) == local_error

    (tmp_path / "qa_ratios.json").unlink(missing_ok=True)
    local_dir, ray_dir = run_local_then_ray(tmp_path / "skip", *overrides, "on_error=skip", stages=["preprocess"])
    assert_same_outputs(local_dir, ray_dir, ["canonical.jsonl", "report.json"])
    assert orjson.loads((ray_dir / "report.json").read_bytes())["preprocess"]["dropped"] == {"missing_field": 1}
    assert f'"source":"{path}:59"'.encode() in (ray_dir / "canonical.jsonl").read_bytes()


def rerun_merge_on_ray(local_cfg, tmp_path) -> list[str]:
    """Only the merge stage with engine: ray over the local run: merged.jsonl and the report's merge section must
    equal the local ones (a rerun of merge alone marks the later sections stale); the local run is put back.
    Returns the names of the temp files left in output_dir."""
    snapshot = tmp_path / "local"
    shutil.copytree(local_cfg.out, snapshot)
    try:
        pipeline.run_pipeline(dataclasses.replace(local_cfg, engine="ray", stages=["merge"]))
        assert local_cfg.merged_path.read_bytes() == (snapshot / "merged.jsonl").read_bytes()
        report = orjson.loads(local_cfg.report_path.read_bytes())["merge"]
        assert report == orjson.loads((snapshot / "report.json").read_bytes())["merge"]
        return [p.name for p in local_cfg.out.glob(".*")]
    finally:
        shutil.rmtree(local_cfg.out)
        shutil.copytree(snapshot, local_cfg.out)


def test_merge_records_are_built_by_the_workers_not_the_driver(fault_dir, local_example, tmp_path, monkeypatch):
    """engine ray: the driver builds no merged record (it links the groups the workers decide in their ranges, and
    concatenates the parts they write), and merged.jsonl has the local bytes."""
    from data import merge

    built = []
    real = merge.merge_records
    monkeypatch.setattr(merge, "merge_records", lambda group: built.append(len(group)) or real(group))
    left = rerun_merge_on_ray(local_example, tmp_path)
    assert built == []
    assert left == [], "parts or temp files left behind"


@pytest.mark.parametrize("range_bytes", [1, 3000])
def test_merge_groups_straddling_range_boundaries_give_the_local_bytes(fault_dir, local_example, tmp_path,
                                                                       monkeypatch, range_bytes):
    """Ranges of one record (1 byte: every merged group straddles) or a few records: groups that start in one
    range and run on into the next ones are linked by the driver and written whole by one worker."""
    from data import merge

    monkeypatch.setattr(merge, "MERGE_RANGE_BYTES", range_bytes)
    lines = local_example.sampled_path.read_bytes().count(b"\n")
    merged = orjson.loads(local_example.report_path.read_bytes())["merge"]
    assert lines > 50 and merged["in"] - merged["out"] > 10  # many groups of several records
    rerun_merge_on_ray(local_example, tmp_path)


def test_preprocess_and_sample_lines_are_written_by_the_workers(fault_dir, tmp_path, monkeypatch):
    """preprocess and sample on Ray, over many byte ranges (~2 KB) and with rates that copy and subsample
    (2.5, 0.4, 0): the driver writes no sampled.jsonl line itself (the workers write parts it appends, on either
    engine) and both files, the ratio file and the report equal the local ones."""
    from data import sample

    ratios = tmp_path / "ratios.json"
    raw = orjson.loads((ROOT / "configs/data/example.json").read_bytes())
    categories = [{"category_id": i, "category_name": spec["category_name"]} for i, spec in enumerate(raw["inputs"], 1)]
    for cat, rate in zip(categories, [2.5, 0.4, 0, 1.3, 1]):
        cat["sample_rate"] = rate
    ratios.write_bytes(orjson.dumps({"categories": categories}))
    monkeypatch.setattr(preprocess, "INPUT_RANGE_BYTES", 2000)
    monkeypatch.setattr(sample, "RANGE_BYTES", 2000)
    written = []
    real = sample.sampled_line
    monkeypatch.setattr(sample, "sampled_line", lambda *a: written.append(a) or real(*a))
    cfg = example_config(tmp_path, "out", "num_workers=2", f"ratio_path={ratios}")
    cfg.stages = ["preprocess", "sample"]
    pipeline.run_pipeline(cfg)
    shutil.move(cfg.out, tmp_path / "local")
    local_ratios = ratios.read_bytes()
    pipeline.run_pipeline(dataclasses.replace(cfg, engine="ray"))
    assert written == []
    assert ratios.read_bytes() == local_ratios
    assert_same_outputs(tmp_path / "local", cfg.out, ["canonical.jsonl", "sampled.jsonl", "report.json"])
    report = orjson.loads((cfg.out / "report.json").read_bytes())["sample"]
    assert report["added"]["copies"] > 0 and report["dropped"]["rate_zero"] > 0
    assert cfg.canonical_path.stat().st_size > 20 * 2000  # many ranges
    assert [p.name for p in cfg.out.glob(".*")] == [], "parts or temp files left behind"



def test_local_pools_start_from_a_fork_server_beside_a_ray_driver(fault_dir):
    """The local engine in a process that runs a Ray driver (as this module does) forks no worker from it: a child
    forked from Ray's threads can hang. The module's local runs went through that path."""
    from data.executor import pool_start_method

    assert ray.is_initialized() and pool_start_method() == "forkserver"
