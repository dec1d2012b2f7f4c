"""Pipeline driver: `python -m data.pipeline [config.json] [--stages a,b] [key=value ...]`.

Runs the requested stages (default: the config's `stages`) in pipeline order, each through
`data.<stage>.run(cfg) -> report section`. The last line printed names the packed output directory.
`cli_main(run, stage)` gives every stage module the same `python -m data.<stage> --config X key=value` CLI.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import functools
import importlib
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from common.config import ConfigError, key_help_lines
from common.lock import LockHeldError, directory_lock
from data.config import STAGES, DataConfig, InputSpec, load_config
from data.executor import Executor, LocalExecutor
from data.io import LineMemoryError, remove_stale_temporaries, undecided_output_temporaries
from data.preflight import preflight, stages_option
from data.provenance import capture, check_provenance, record
from data.ratios import ratio_file_digest
from data.records import RecordError
from data.report import read_report, record_failure

DEFAULT_CONFIG = "configs/data/example.json"
EVAL_STAGES = ("merge", "tokenize", "pack")  # run a second time on the eval split (DataConfig.eval_config)
StageFn = Callable[..., dict]  # a stage's `run(cfg, executor=...)` -> its report section
DATA_PROCESS = Path(__file__).resolve().parents[1] / "data_process.sh"


@dataclasses.dataclass(frozen=True)
class Invocation:
    """The command line a run came from (its config and `key=value` overrides), to suggest complete commands."""
    config: str
    overrides: tuple[str, ...] = ()

    def command(self, stages: list[str]) -> str:
        """`sh data_process.sh CONFIG --stages a,b OVERRIDES`, to run from the current directory as printed (the
        script by a relative path from inside the repository, else absolute)."""
        script = os.path.relpath(DATA_PROCESS)
        script = str(DATA_PROCESS) if script.startswith("..") else script
        return shlex.join(["sh", script, self.config, "--stages", ",".join(stages), *self.overrides])


def keys_help() -> str:
    """Every data config key with its type, default and help (from the comments in data/config.py)."""
    def json_value(value) -> str:
        return orjson.dumps(value).decode()

    return "\n".join(["config keys (in the JSON file, or key=value on the command line; sections with dots: "
                      "merge.probability=0.2):", *key_help_lines(DataConfig, json_value), "",
                      "keys of each input (inputs: [{...}]):", *key_help_lines(InputSpec, json_value), "",
                      "Full reference: docs/DATA.md."])


def build_parser(prog: str, stage_option: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0], epilog=keys_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config_pos", nargs="?", metavar="config.json", help=f"data config (default {DEFAULT_CONFIG})")
    parser.add_argument("--config", help="data config (same as the positional argument)")
    if stage_option:
        parser.add_argument("--stages", help=f"comma-separated subset of {','.join(STAGES)}")
    return parser


def parse_args(argv: list[str], prog: str, stage_option: bool = True) -> tuple[argparse.Namespace, list[str]]:
    """Split argv into options and `key=value` overrides (which may come in any position)."""
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    rest = [a for a in argv if a not in overrides]
    args = build_parser(prog, stage_option).parse_args(rest)
    if args.config and args.config_pos:
        raise ConfigError(f"two configs given: {args.config_pos} and --config {args.config}")
    args.config = args.config or args.config_pos or DEFAULT_CONFIG
    return args, overrides


def load(args: argparse.Namespace, overrides: list[str], stages: list[str] | None,
         command: Callable[[list[str]], str] = stages_option) -> DataConfig:
    cfg = load_config(args.config, overrides)
    if stages is not None:
        unknown = [s for s in stages if s not in STAGES]
        if unknown:
            raise ConfigError(f"--stages: unknown stage(s) {unknown}; known: {list(STAGES)}")
        cfg.stages = stages
    cfg.validate()
    preflight(cfg, command)
    return cfg


def stage_outputs(cfg: DataConfig) -> dict[str, Path]:
    """What each stage writes and the next one reads."""
    return {"preprocess": cfg.canonical_path, "sample": cfg.sampled_path, "merge": cfg.merged_path,
            "tokenize": cfg.tokenized_dir, "pack": cfg.packed_dir}


class StaleInputError(ConfigError):
    """A stage of the run would read an output older than the last run of a stage before it."""


def check_stage_inputs(cfg: DataConfig, command: Callable[[list[str]], str] = stages_option) -> None:
    """Refuse a run in which a stage would read the output of a stage not in the run (its upstream) while that
    output predates the last run of an earlier stage: report.json lists the upstream under `stale` (an earlier
    stage re-ran since), or an earlier stage of this very run will. The error names the file and the complete
    command (every stage in between). The eval split's outputs (eval/report.json) are judged alike."""
    planned = [s for s in STAGES if s in cfg.stages]
    if not planned:
        return
    first, last = STAGES.index(planned[0]), STAGES.index(planned[-1])
    problems, stale_from = [], [first]
    chains = [(cfg, STAGES)] + ([(cfg.eval_config(), ("sample", *EVAL_STAGES))] if cfg.eval_size is not None else [])
    for config, chain in chains:
        stale = read_report(config.report_path).get("stale") or {}
        stale_from += [STAGES.index(s) for s in stale if STAGES.index(s) <= last]
        for stage in planned:
            upstream = chain[chain.index(stage) - 1] if stage in chain[1:] else None
            if upstream is None or upstream in planned:
                continue
            path = stage_outputs(config)[upstream]
            if upstream in stale:
                problems.append(f"{stage} reads {path}, which {upstream} wrote before the last run of an earlier "
                                f"stage (report.json lists {upstream} under `stale`)")
            elif first < STAGES.index(upstream):
                problems.append(f"{stage} reads {path}, which would be older than this run's {planned[0]} stage "
                                f"({upstream} is not in --stages)")
    if problems:
        raise StaleInputError(f"{problems[0]}: run the stages in between too: "
                              f"{command(list(STAGES[min(stale_from):last + 1]))}")


def run_stage(cfg: DataConfig, stage: str, executor: Executor, stage_fn: StageFn | None = None,
              label: str | None = None, command: Callable[[list[str]], str] = stages_option) -> dict:
    """Run one stage on `executor` and print a one-line summary of its report section (`[label]`, default the
    stage); `command` writes the command that re-runs stages (in the message of a full disk)."""
    fn = stage_fn or importlib.import_module(f"data.{stage}").run
    start = time.perf_counter()
    made_from = capture(cfg, stage)  # before it runs: what its output is made from
    try:
        section = fn(cfg, executor=executor)
    except OSError as exc:  # a full disk, a permission: the environment, not a bug
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        free = shutil.disk_usage(cfg.out).free if cfg.out.is_dir() else 0
        message = (f"{stage}: no space left on device writing under {cfg.out} ({free / 1e6:.1f} MB free); its "
                   f"previous output, if any, is unchanged and report.json lists it under `stale`. Free space, then "
                   f"re-run: {command([s for s in STAGES[STAGES.index(stage):] if s in cfg.stages])}")
        record_failure(cfg.report_path, stage, message)
        raise DiskFullError(message) from None
    record(cfg, stage, made_from)
    dropped = section.get("dropped") or {}
    extra = f" dropped={dict(dropped)}" if dropped else ""
    print(f"[{label or stage}] in={section.get('in')} out={section.get('out')}{extra} "
          f"({time.perf_counter() - start:.1f}s)", flush=True)
    if stage == "preprocess":  # where the file the user edits is, and what to run after editing it
        print(f"  ratio file: {cfg.ratio_file} (a sample_rate per category: edit it, then re-run from sample: "
              f"{command(list(STAGES[STAGES.index('sample'):]))})",
              flush=True)
    elif stage == "sample":
        print(f"  rates from the ratio file {cfg.ratio_file}", flush=True)
    return section


def clean_up(cfg: DataConfig) -> None:
    """Remove the temporaries of killed runs (writer process gone), the eval split's too, and say so in one line;
    say in another which temporaries of the older pid-only naming are kept because their pid runs."""
    configs = [cfg, cfg.eval_config()] if cfg.eval_dir.is_dir() else [cfg]
    removed = [item for c in configs for item in remove_stale_temporaries(c)]
    kept = [item for c in configs for item in undecided_output_temporaries(c)]
    if removed:
        mb = sum(size for _, size in removed) / 1e6
        print(f"[cleanup] removed {len(removed)} temporaries of killed runs ({mb:.1f} MB): "
              f"{', '.join(str(p) for p, _ in removed)}", flush=True)
    if kept:
        one = len(kept) == 1
        print(f"[cleanup] kept {len(kept)} {'temporary' if one else 'temporaries'} named by pid alone (the naming of "
              f"older versions) whose pid is running, so {'it' if one else 'they'} cannot be told from a live "
              f"writer's; delete {'it' if one else 'them'} if no run of an older version is writing there: "
              f"{', '.join(f'{p} (pid {pid})' for p, pid in kept)}", flush=True)


def run_stages(cfg: DataConfig, executor: Executor, stage_fn: Callable[[str], StageFn | None] = lambda _: None,
               command: Callable[[list[str]], str] = stages_option) -> dict[str, dict]:
    """Every stage of `cfg.stages` in pipeline order on `executor`, `stage_fn(stage)` running it (None: the
    module's `run`); with an eval split, merge, tokenize and pack run again on it right after the training data's
    (sections `"<stage> eval"`). Both engines go through here, so they run the same stages on the same configs."""
    eval_cfg = cfg.eval_config() if cfg.eval_size is not None else None
    sections = {}
    for stage in STAGES:
        if stage not in cfg.stages:
            continue
        sections[stage] = run_stage(cfg, stage, executor, stage_fn(stage), command=command)
        if eval_cfg is not None and stage in EVAL_STAGES:
            sections[f"{stage} eval"] = run_stage(eval_cfg, stage, executor, stage_fn(stage), label=f"{stage} eval",
                                                  command=command)
    return sections


def stale_input_warnings(cfg: DataConfig, command: Callable[[list[str]], str] = stages_option) -> list[str]:
    """Stages run without the sample stage after the ratio file was edited would pack the old sample: say so, with
    the complete command that samples again (every stage from sample to the run's last)."""

    later = [stage for stage in ("merge", "tokenize", "pack") if stage in cfg.stages]
    if "sample" in cfg.stages or not later:
        return []
    sampled_with = (read_report(cfg.report_path).get("sample") or {}).get("ratio_file_sha256")
    if sampled_with is None or sampled_with == ratio_file_digest(cfg.ratio_file):
        return []
    span = list(STAGES[STAGES.index("sample"):STAGES.index(later[-1]) + 1])
    return [f"the ratio file {cfg.ratio_file} changed after the sample stage ran: {', '.join(later)} use the old "
            f"sample; re-run from it: {command(span)}"]


def run_pipeline(cfg: DataConfig, stage_fn: Callable[[str], StageFn | None] = lambda _: None,
                 command: Callable[[list[str]], str] = stages_option) -> dict[str, dict]:
    """Every stage of `cfg.stages`, in pipeline order (`stage_fn` as in run_stages), on the config's engine, once
    no stage would read a stale input (`check_stage_inputs`) nor an output made from other inputs or settings than
    this run's (`provenance.check_provenance`); returns their report sections (first, `inputs`:
    warnings about inputs of earlier stages that changed since they ran). `command` writes the command that runs
    given stages (`Invocation.command` for a command line) in what the run suggests."""
    check_stage_inputs(cfg, command)
    unrecorded = check_provenance(cfg, command)
    clean_up(cfg)
    stale = stale_input_warnings(cfg, command) + unrecorded
    for warning in stale:
        print(f"WARNING: inputs: {warning}", file=sys.stderr, flush=True)
    if cfg.engine == "ray":
        from data.engine_ray import run_pipeline as run_on_ray

        sections = run_on_ray(cfg, functools.partial(run_stages, stage_fn=stage_fn, command=command))
    else:
        sections = run_stages(cfg, LocalExecutor(cfg.workers), stage_fn, command)
    return {"inputs": {"warnings": stale}, **sections} if stale else sections


def print_warnings(sections: dict[str, dict]) -> None:
    """The warnings the stages recorded in report.json (`warnings`), repeated after the last stage's output so
    they are the last thing a run says."""
    for stage, section in sections.items():
        for warning in section.get("warnings") or []:
            print(f"WARNING: {stage}: {warning}", file=sys.stderr, flush=True)


class DiskFullError(OSError):
    """A stage ran out of disk space (ENOSPC / EDQUOT); the message says where and what to re-run."""


def _guard(body: Callable[[], None]) -> None:
    """User errors (config, bad records, missing files, a full disk, an output directory in use) end with one clear
    line and exit code 2."""
    try:
        body()
    except (ConfigError, RecordError, FileNotFoundError, ValueError, DiskFullError, LockHeldError,
            LineMemoryError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def cli_main(stage_fn: StageFn, stage: str, argv: list[str] | None = None) -> None:
    """`python -m data.<stage> --config X key=value`: one stage (the config's other stages are not run)."""
    argv = sys.argv[1:] if argv is None else argv

    def body() -> None:
        args, overrides = parse_args(argv, f"python -m data.{stage}", stage_option=False)
        command = Invocation(args.config, tuple(overrides)).command
        cfg = load(args, overrides, [stage], command)
        with directory_lock(cfg.out):
            sections = run_pipeline(cfg, lambda _: stage_fn, command)  # this module's `run` (it may be `__main__`)
        print_warnings(sections)

    _guard(body)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv

    def body() -> None:
        args, overrides = parse_args(argv, "data_process.sh")
        stages = [s.strip() for s in args.stages.split(",") if s.strip()] if args.stages else None
        command = Invocation(args.config, tuple(overrides)).command
        cfg = load(args, overrides, stages, command)
        with directory_lock(cfg.out):
            sections = run_pipeline(cfg, command=command)
        print_warnings(sections)
        if "pack" in cfg.stages:
            if cfg.eval_size is not None:
                print(f"eval split: {cfg.eval_config().packed_dir}", flush=True)
            print(f"packed: {cfg.packed_dir}", flush=True)

    _guard(body)


if __name__ == "__main__":
    main()
