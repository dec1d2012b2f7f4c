"""The whole GPU check in one unattended run, most valuable first, inside a time budget (scripts/gpu_check.sh).

A lent GPU machine gives about 15 minutes a session and one command of at most 10 (BENCHMARKS.md), so everything
runs from one command and nothing waits for a person. Phases, in order (what the last H100 run left unmeasured):

1. `tests`: every `gpu`-marked test of tests/ (pytest -m gpu), pass / fail / skip per test with its reason, while
   the packed 32K rows are built on the CPU;
2. `train_32k_large`: bench_train_gpu, the Qwen2.5-1.5B shape at 32K rows, the fused step (`torch_varlen` + Liger +
   the compiled loss) with `gradient_checkpointing: auto` (the memory plan's first k layers) and then with every
   layer checkpointed (`+ckpt`, the previous run's setting, on the same machine); each run profiles one more step
   with torch.profiler into `<out>/profile.txt`;
3. `long_rows`: bench_long_rows, the Llama-3-8B shape (bf16 base frozen, rank-16 adapters on every linear layer:
   its full fine-tuning state does not fit one GPU) on a 512K-token row with checkpointing + tiled MLP + offload
   (then 256K, 128K while no longer row was measured), and each option's tokens/s and peak memory at 32K.

`--second`: the second command (its own budget of DEFAULT_BUDGET: the first one's phases fill theirs), the phases
issue 42 added after those runs, while the 32K rows are built on the CPU:

4. `trees`: stepwise prefix trees (issue 44): the reasoning + tool-use fixture's records as `stepwise: tree` rows and
   as `samples` rows (bench_stepwise --prepare: the same trained targets), each trained by bench_train_gpu on the
   Qwen2.5-0.5B shape at 32K rows: tree rows through the structured attention (FlexAttention on CUDA), samples rows
   through the varlen kernel (`torch_varlen`); tokens/s and trained tokens/s, tree over samples;
5. `moe`: a Qwen3-30B-A3B shape (hidden 2048, 128 experts top-8, moe_intermediate 768, vocabulary 151936; MOE_LAYERS
   decoder layers of its 48) at 32K rows on one GPU, bf16: the experts as one grouped GEMM per projection
   (`+moe_grouped_mm`) and as the per-expert loop (`+moe_loop`), tokens/s and MFU on ACTIVE parameters; then TRL's
   SFTTrainer on the same rows and shape (bench_trl --model-config), with PackSFT's checkpointing choice. One
   process has no expert parallelism: the experts run as transformers' module, whose `experts_implementation` the
   variants' `moe_kernel` sets (grouped_mm / eager).

`--legacy` appends what the previous runs measured: the 0.5B shape at 32K per backend, both shapes at 128K rows,
TRL's SFTTrainer on the same sequences (bench_trl) and a profile of the target furthest from its goal; they share
what the default phases leave of the budget.
Each phase ends by its own deadline (a share of the budget, leaving every later phase its floor), so a slow phase
cannot starve the rest; whatever a phase measured before its deadline is kept. After every phase
`<out>/gpu_check.json` (versions, every phase's results) and `<out>/gpu_check.md` (the tables) are rewritten
atomically; `<out>/gpu_check.log` has all output, `<out>/gpu_tests.log` pytest's, `<out>/profile.txt` the profiles,
`<out>/long_rows.md` the long-row tables, `<out>/moe.md`, `<out>/trees.md` the second command's. Without CUDA the GPU phases are recorded as skipped and the tests phase
runs (every gpu test skips): the CPU check. `--smoke` runs every phase on the CPU with the example's tiny model
(TRL with SDPA only: FlexAttention has no backward on the CPU; `train_128k` is recorded as skipped: its smoke runs
would be train_32k_small's again); with `--second` the trees phase on 3 fixture records at 4K rows with a tiny Qwen2
of the Qwen vocabulary (SDPA; tree rows through the structured SDPA mask) and the moe phase with a tiny qwen3_moe
(SMOKE_MOE) on the example's 2K rows, TRL on SDPA. `--no-caps` lifts every phase deadline and per-run timeout (a hang guard of
NO_CAPS_TIMEOUT stays): each phase runs to its end, so what it records does not depend on the machine's load (the
CPU smoke test, tests/project/test_gpu_check.py); the caps are sized for the GPU machine's time limits.

    bash scripts/gpu_check.sh $OUT                # on the GPU machine (installs the carried wheels first)
    bash scripts/gpu_check.sh $OUT/second --second   # the second 10-minute command: trees, moe
    python -m benchmarks.gpu_check --out /tmp/gc  # anywhere
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import math
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_train_gpu import write_atomic  # noqa: E402

SHAPE_SMALL, SHAPE_LARGE = "qwen2.5-0.5b", "qwen2.5-1.5b"
TARGETS = {  # (shape, row length) -> (metric, goal): issue 33's targets, one H100 80GB
    (SHAPE_LARGE, 32768): ("mfu", 0.40),
    (SHAPE_SMALL, 32768): ("tokens_per_s", 100_000.0),
    (SHAPE_SMALL, 131072): ("tokens_per_s", 60_000.0),
}
SMOKE_TARGETS = {("example-tiny", 2048): ("tokens_per_s", float("inf"))}  # --smoke: the example's tiny model
VERSIONED = ("torch", "transformers", "accelerate", "triton", "liger_kernel", "trl", "datasets", "orjson",
             "flash_attn", "ring_flash_attn", "deepspeed", "peft")
OUTCOMES = "PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS"
TEST_LINE = re.compile(rf"^(tests/\S+::\S+)\s+({OUTCOMES})")  # pytest -v
XDIST_LINE = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] ({OUTCOMES}) (tests/\S+::\S+)")  # pytest -v -n N
SKIP_LINE = re.compile(r"^SKIPPED \[\d+\] (\S+?):(\d+): (.*)$")


@dataclass
class Phase:
    name: str
    cap: float  # seconds at most
    floor: float  # seconds kept for it while earlier phases run


# Caps and floors from the runs of 2026-11-27: the gpu tests took 78 s on the H100 (8 workers), a 1.5B benchmark
# process 60 s besides its steps (imports, random init on the CPU), the compiled loss ~5 s more; an 8B long-row
# process builds its model on the GPU (estimated from FLOPs, not measured: a 256K-row step under a minute).
PHASES = [Phase("tests", 90, 60), Phase("train_32k_large", 190, 110), Phase("long_rows", 250, 150)]
# --legacy, after those: what the runs of 2026-11-27 measured (0.5B per backend, 128K rows, TRL, a profile)
LEGACY_PHASES = [Phase("train_32k_small", 150, 90), Phase("train_128k", 160, 90), Phase("trl", 90, 40),
                 Phase("profile", 50, 20)]
DEFAULT_BUDGET = 540.0  # seconds: a 10-minute command less the wheels' install and a margin
TRAIN_PHASES = ("train_32k_small", "train_32k_large", "train_128k")
FUSED = "torch_varlen+liger+compile_loss"  # the fastest step measured on the H100 (Liger's kernels, compiled loss)
# bench_long_rows runs of the long_rows phase: (row lengths, options, steps, fallback). The 512K row first (the
# issue's goal: ALST's single-GPU record for an 8B model), then shorter rows as fallbacks, each run only while no
# longer row was measured, and every option's cost at 32K. The offload's pinned copies of a 512K row (and of a 384K
# one: torch rounds each layer's 3 GiB up to 4) are 128 GiB, more than the 128 GiB machine has free (bench_long_rows
# then records the row as not run, with those numbers): 256K is the longest row it can offload.
MATRIX = "ckpt,ckpt+tiled,ckpt+offload,ckpt+tiled+offload"
LONG_ROW_RUNS = [("524288", "ckpt+tiled+offload", 1, False), ("262144", "ckpt+tiled+offload", 1, True),
                 ("32768", MATRIX, 2, False), ("131072", "ckpt+tiled+offload", 1, True)]
LONG_ROW_FLAGS = ["--shape", "llama3-8b", "--layers", "0", "--bf16", "--lora", "16", "--device", "cuda",
                  "--sequence", "2048", "--trained", "128", "--timeout", "240"]
SMOKE_LONG_ROW_RUNS = [("2048", "ckpt+tiled+offload", 1, False), ("1536", "ckpt+tiled+offload", 1, True),
                       ("1024", "ckpt,ckpt+tiled+offload", 2, False)]  # two options: the CPU check's time
SMOKE_LONG_ROW_FLAGS = ["--shape", "example-tiny", "--layers", "0", "--lora", "4", "--device", "cpu",
                        "--sequence", "256", "--trained", "32", "--threads", "1", "--timeout", "120"]
SMOKE_SKIPPED = {"train_128k": "--smoke: bench_train_gpu runs the example's 2K rows and tiny model whatever the "
                               "length and shape, the runs of train_32k_small again"}

# --second (its own command and budget): the stepwise trees first (their data is built in seconds while the 32K rows
# pack in the background, ~40-80 s on the GPU machine's CPU), then the MoE shape: two PackSFT processes and TRL's,
# each building a ~1.9B-parameter model on the CPU first (the 1.5B shape's process took 60 s besides its steps).
SECOND_PHASES = [Phase("trees", 180, 110), Phase("moe", 400, 250)]
MOE_LAYERS = 2
QWEN3_30B_A3B = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936,
                     hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_hidden_layers=48, decoder_sparse_step=1, mlp_only_layers=[],
                     max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False, use_cache=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
# --smoke: the same family at the example data's scale (its tokenizer has fewer than 2,048 ids)
SMOKE_MOE = dict(QWEN3_30B_A3B, vocab_size=2048, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_hidden_layers=2, max_position_embeddings=4096)
MOE_BACKEND = "torch_varlen+compile_loss"  # the fused step less Liger (its SwiGLU patch is the dense MLP's)
TREES_SHAPE = SHAPE_SMALL
SMOKE_TREES = {"records": 3, "max_length": 4096, "model_config": "configs/model/tiny_qwen2_qwen_vocab.json"}

NO_CAPS_TIMEOUT = 3600.0  # --no-caps: seconds a run may take, a guard against a hang only
HEAVY_TEST_FILES = ("test_function_backends.py", "test_packed_options.py")  # trainer steps, compiles: run last


def gpu_test_files(tests_dir: Path) -> list[str]:
    """Every test file with a `gpu` mark, the ones that build trainers and compile last."""
    files = sorted(p for p in tests_dir.rglob("test_*.py") if "mark.gpu" in p.read_text())
    files.sort(key=lambda p: p.name in HEAVY_TEST_FILES)
    return [str(p.relative_to(ROOT)) for p in files]


class Check:
    def __init__(self, out: Path, budget: float, fixtures: Path, work: Path, steps: int, smoke: bool,
                 legacy: bool = False, caps: bool = True, second: bool = False):
        self.out, self.fixtures, self.work, self.steps, self.smoke = out, fixtures, work, steps, smoke
        self.caps = caps
        self.phases = SECOND_PHASES if second else PHASES + (LEGACY_PHASES if legacy else [])
        self.lengths = (32768, 131072) if legacy else (32768,)
        self.targets = SMOKE_TARGETS if smoke else TARGETS
        self.bench_flags = ["--smoke"] if smoke else []
        self.floor_scale = min(1.0, budget / DEFAULT_BUDGET)  # a shorter budget shrinks every floor alike
        self.start = time.time()
        self.end = self.start + budget
        self.log = open(out / "gpu_check.log", "a", buffering=1)
        self.report: dict = {"date": dt.date.today().isoformat(), "budget_s": budget if caps else None,
                             "caps": caps, "command": "second" if second else "first", "phases": {}}
        self.tables: dict[str, str] = {}

    # ---------------------------------------------------------------------------------------- plumbing
    def say(self, text: str) -> None:
        line = f"[gpu_check {time.time() - self.start:6.1f}s] {text}"
        print(line, flush=True)
        self.log.write(line + "\n")

    def deadline(self, name: str) -> float:
        """This phase's end: its cap, and never into the floors of the phases after it (of its own group: the
        --legacy phases run on what the default ones leave). --no-caps: none (inf)."""
        if not self.caps:
            return math.inf
        legacy = {p.name for p in LEGACY_PHASES}
        later = [p for p in self.phases[[p.name for p in self.phases].index(name) + 1:]
                 if (p.name in legacy) == (name in legacy)]
        cap = next(p.cap for p in self.phases if p.name == name)
        return min(time.time() + cap, self.end - self.floor_scale * sum(p.floor for p in later))

    def limits(self, timeout: float, deadline: float) -> list[str]:
        """A benchmark's flags bounding its runs: each at most `timeout` seconds, none past `deadline`; --no-caps:
        the hang guard only."""
        if not self.caps:
            return ["--timeout", str(NO_CAPS_TIMEOUT)]
        return ["--timeout", str(timeout), "--deadline", str(deadline)]

    def run(self, cmd: list[str], deadline: float, log_path: Path) -> tuple[int | None, float]:
        """Run `cmd` in the repo root until `deadline`, its output into `log_path` and then the main log.
        (returncode, seconds); returncode None when it was stopped at the deadline (its whole process group)."""
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                   PYTHONUNBUFFERED="1")
        self.say("$ " + " ".join(cmd))
        t0 = time.time()
        with open(log_path, "a") as sink:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code: int | None = proc.wait(timeout=max(1.0, deadline - time.time()) if self.caps else None)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
        self.log.write(log_path.read_text(errors="replace"))
        if code is None:
            self.say(f"stopped at the phase's deadline after {time.time() - t0:.0f} s")
        return code, time.time() - t0

    def save(self) -> None:
        self.report["elapsed_s"] = round(time.time() - self.start, 1)
        write_atomic(self.out / "gpu_check.json", json.dumps(self.report, indent=1) + "\n")
        header = (f"# GPU check, {self.report['date']}\n\nMachine: {self.report.get('machine', '?')}. "
                  f"Versions: {self.report.get('versions', {})}\n\n")
        write_atomic(self.out / "gpu_check.md", header + "\n".join(self.tables.values()))

    # ---------------------------------------------------------------------------------------- phases
    def environment(self) -> None:
        import importlib.metadata as md

        import torch

        from benchmarks.bench_memory import machine_description

        self.cuda = torch.cuda.is_available()
        self.benches = self.cuda or self.smoke  # --smoke: every phase on the CPU, the example's data and tiny model
        self.report["machine"] = machine_description("cuda" if self.cuda else "cpu")
        self.report["python"] = platform.python_version()
        versions = {}
        for name in VERSIONED:
            try:
                versions[name] = md.version(name.replace("_", "-"))
            except md.PackageNotFoundError:
                versions[name] = None
        versions["cuda"] = torch.version.cuda
        self.report["versions"] = versions
        self.say(f"{self.report['machine']}; {versions}")
        self.save()

    def start_data(self) -> subprocess.Popen | None:
        """The packed rows (32K; 128K too with --legacy), built on the CPU while the GPU runs the tests."""
        if not self.benches:
            return None
        cmd = [sys.executable, "-m", "benchmarks.bench_train_gpu", "--prepare", str(self.work / "data"),
               "--row-lengths", ",".join(map(str, self.lengths)), "--fixtures", str(self.fixtures), *self.bench_flags]
        self.say("background: " + " ".join(cmd))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(self.work / "prepare.log", "w"),
                                stderr=subprocess.STDOUT)

    def tests(self) -> None:
        log = self.out / "gpu_tests.log"
        cmd = [sys.executable, "-m", "pytest", *gpu_test_files(ROOT / "tests"), "-m", "gpu", "-p", "no:cacheprovider",
               "-v", "-rs", "--continue-on-collection-errors", "--timeout", "120" if self.caps else str(NO_CAPS_TIMEOUT)]
        if self.cuda and importlib.util.find_spec("xdist") is not None:
            cmd += ["-n", "8"]  # the compiles (inductor, FlexAttention, Triton) run on the CPU: 8 at once
        code, seconds = self.run(cmd, self.deadline("tests"), log)
        results, reasons = {}, {}
        for line in log.read_text().splitlines():
            if m := TEST_LINE.match(line):
                results[m.group(1)] = m.group(2)
            elif m := XDIST_LINE.match(line):
                results[m.group(2)] = m.group(1)
            elif m := SKIP_LINE.match(line):
                reasons[f"{m.group(1)}:{m.group(2)}"] = m.group(3)
        counts: dict[str, int] = {}
        for outcome in results.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        failed = [t for t, o in results.items() if o in ("FAILED", "ERROR")]
        self.report["phases"]["tests"] = {"returncode": code, "seconds": round(seconds, 1), "counts": counts,
                                          "results": results, "skip_reasons": reasons, "failed": failed}
        lines = ["## gpu tests", "", f"{counts} in {seconds:.0f} s (pytest exit {code})", ""]
        lines += [f"- {t}: {o}" for t, o in results.items() if o != "PASSED"]
        self.tables["tests"] = "\n".join(lines) + "\n"
        self.say(f"tests: {counts}; failed: {failed}")
        self.save()

    def wait_data(self, prep: subprocess.Popen | None) -> dict[int, Path]:
        if prep is None:
            return {}
        try:
            prep.wait(timeout=max(1.0, self.end - time.time() - 60) if self.caps else None)
        except subprocess.TimeoutExpired:
            prep.kill()
        self.log.write((self.work / "prepare.log").read_text())
        found = {}
        for length in self.lengths:
            packed = self.work / "data" / f"data_{2048 if self.smoke else length}" / "packed"
            if (packed / "meta.json").exists():
                found[length] = packed
        self.report["data"] = {str(k): str(v) for k, v in found.items()}
        self.say(f"packed data: {self.report['data']} (prepare exit {prep.returncode})")
        return found

    def bench(self, phase: str, data: dict[int, Path], length: int, shapes: list[str], backends: list[str],
              extra: list[str] = ()) -> None:
        if self.smoke:  # Liger and varlen need CUDA: the smoke runs the fused step's runs on the SDPA loop
            backends = list(dict.fromkeys(b.replace(FUSED, "sdpa") for b in backends))
        if self.smoke and phase in SMOKE_SKIPPED:
            self.report["phases"][phase] = {"skipped": SMOKE_SKIPPED[phase]}
            self.save()
            return
        if not self.benches or length not in data:
            self.report["phases"][phase] = {"skipped": "no CUDA" if not self.benches else f"no packed data at {length}"}
            self.save()
            return
        deadline = self.deadline(phase)
        result = self.work / phase
        cmd = [sys.executable, "-m", "benchmarks.bench_train_gpu", "--packed", str(data[length]),
               "--shapes", ",".join(shapes), "--row-lengths", str(length), "--backends", ",".join(backends),
               "--steps", str(self.steps), *self.limits(150, deadline - 5), "--out", str(result), *extra,
               *self.bench_flags]
        code, seconds = self.run(cmd, deadline, self.work / f"{phase}.log")
        self.collect(phase, result, code, seconds)

    def long_rows(self) -> None:
        """bench_long_rows' runs (LONG_ROW_RUNS) until the phase's deadline; a fallback length only while no longer
        row has been measured."""
        if not self.benches:
            self.report["phases"]["long_rows"] = {"skipped": "no CUDA"}
            self.save()
            return
        deadline = self.deadline("long_rows")
        runs, flags = (SMOKE_LONG_ROW_RUNS, SMOKE_LONG_ROW_FLAGS) if self.smoke else (LONG_ROW_RUNS, LONG_ROW_FLAGS)
        at = flags.index("--timeout")  # the flags' own per-run timeout, and the phase's deadline
        flags, timeout = flags[:at] + flags[at + 2:], float(flags[at + 1])
        entry: dict = {"runs": [], "seconds": 0.0}
        self.report["phases"]["long_rows"] = entry
        table = self.out / "long_rows.md"
        for i, (lengths, options, steps, fallback) in enumerate(runs):
            longest = max((r["length"] for run in entry["runs"] for r in run.get("results", []) if "peak_bytes" in r),
                          default=0)
            if fallback and longest > int(lengths):
                entry["runs"].append({"lengths": lengths, "options": options, "skipped": f"{longest} measured"})
                continue
            if deadline - time.time() < 20:
                entry["runs"].append({"lengths": lengths, "options": options, "skipped": "the deadline had passed"})
                continue
            result = self.work / f"long_rows_{i}.json"
            result.unlink(missing_ok=True)  # an earlier check's
            cmd = [sys.executable, "-m", "benchmarks.bench_long_rows", *flags, "--lengths", lengths, "--options",
                   options, "--steps", str(steps), *self.limits(timeout, deadline - 5), "--json", str(result),
                   "--out", str(table)]
            code, seconds = self.run(cmd, deadline, self.work / "long_rows.log")
            run = {"lengths": lengths, "options": options, "returncode": code, "seconds": round(seconds, 1)}
            if result.exists():
                run["results"] = json.loads(result.read_text())
            entry["runs"].append(run)
            entry["seconds"] = round(entry["seconds"] + seconds, 1)
            if table.exists():
                self.tables["long_rows"] = table.read_text()
            self.save()
        self.say(f"long_rows: {[(r['lengths'], r.get('returncode', r.get('skipped'))) for r in entry['runs']]}")
        self.save()

    def trl(self, data: dict[int, Path]) -> None:
        if not self.benches or 32768 not in data:
            self.report["phases"]["trl"] = {"skipped": "no CUDA" if not self.benches else "no packed data at 32768"}
            self.save()
            return
        deadline = self.deadline("trl")
        result = self.work / "trl"
        # --smoke: FlexAttention has no backward on the CPU (its run could only fail, after compiling)
        cmd = [sys.executable, "-m", "benchmarks.bench_trl", "--packed", str(data[32768]), "--shape", SHAPE_SMALL,
               "--tokenizer", str(self.fixtures / "tokenizers" / "qwen2_5_instruct"), "--attn",
               "sdpa" if self.smoke else "flex_attention,sdpa", "--steps", str(self.steps),
               *self.limits(120, deadline - 5),
               "--gradient-checkpointing", self.packsft_checkpointing(SHAPE_SMALL, 32768),
               "--out", str(result), *self.bench_flags]
        code, seconds = self.run(cmd, deadline, self.work / "trl.log")
        self.collect("trl", result, code, seconds)

    def packsft_checkpointing(self, shape: str, length: int) -> str:
        """"true" / "false": what PackSFT's memory plan chose for this shape and length (TRL then does the same
        recomputation); "true" when nothing was measured."""
        for phase in (*TRAIN_PHASES, "moe"):
            for row in self.report["phases"].get(phase, {}).get("report", {}).get("results", []):
                if (row["shape"], row["row_length"]) == (shape, length) and "checkpointing" in row:
                    return "false" if row["checkpointing"].startswith("off") else "true"
        return "true"

    def moe(self, data: dict[int, Path]) -> None:
        """The Qwen3-30B-A3B shape (MOE_LAYERS layers) at 32K rows: PackSFT with grouped-GEMM experts and with the
        per-expert loop (bench_train_gpu), then TRL on the same rows and shape (bench_trl)."""
        if not self.benches or 32768 not in data:
            self.report["phases"]["moe"] = {"skipped": "no CUDA" if not self.benches else "no packed data at 32768"}
            self.save()
            return
        deadline = self.deadline("moe")
        name = "example-tiny-moe" if self.smoke else f"qwen3-30b-a3b-{MOE_LAYERS}l"
        model_config = self.work / f"{name}.json"
        write_atomic(model_config, json.dumps(SMOKE_MOE if self.smoke else dict(QWEN3_30B_A3B,
                                                                                  num_hidden_layers=MOE_LAYERS)))
        backend = "sdpa" if self.smoke else MOE_BACKEND  # --smoke: no varlen kernel, no compile on the CPU
        length = 2048 if self.smoke else 32768
        entry: dict = {"shape": name, "row_length": length, "model_config": json.loads(model_config.read_text())}
        self.report["phases"]["moe"] = entry
        result = self.work / "moe"
        # TRL keeps its share: the PackSFT runs end 30% of the phase before its deadline
        packsft_deadline = deadline - 0.3 * (deadline - time.time()) if self.caps else deadline
        cmd = [sys.executable, "-m", "benchmarks.bench_train_gpu", "--packed", str(data[32768]), "--model-config",
               str(model_config), "--model-name", name, "--row-lengths", str(length), "--backends",
               f"{backend}+moe_grouped_mm,{backend}+moe_loop", "--steps", str(self.steps),
               *self.limits(200, packsft_deadline - 5), "--out", str(result)]
        code, seconds = self.run(cmd, packsft_deadline, self.work / "moe.log")
        entry.update(returncode=code, seconds=round(seconds, 1))
        if result.with_suffix(".json").exists():
            entry["report"] = json.loads(result.with_suffix(".json").read_text())
            self.tables["moe"] = result.with_suffix(".md").read_text()
        self.save()
        trl = self.work / "moe_trl"
        cmd = [sys.executable, "-m", "benchmarks.bench_trl", "--packed", str(data[32768]), "--model-config",
               str(model_config), "--shape", name,
               "--tokenizer", str(self.fixtures / "tokenizers" / "qwen2_5_instruct"),
               "--attn", "sdpa" if self.smoke else "flex_attention", "--steps", str(self.steps),
               *self.limits(200, deadline - 5), "--gradient-checkpointing", self.packsft_checkpointing(name, length),
               "--out", str(trl), *self.bench_flags]
        code, seconds = self.run(cmd, deadline, self.work / "moe_trl.log")
        entry["trl"] = {"returncode": code, "seconds": round(seconds, 1)}
        if trl.with_suffix(".json").exists():
            entry["trl"]["report"] = json.loads(trl.with_suffix(".json").read_text())
            self.tables["moe_trl"] = trl.with_suffix(".md").read_text()
        entry["summary"] = moe_summary(entry)
        self.tables["moe_summary"] = moe_markdown(entry["summary"])
        write_atomic(self.out / "moe.md", "\n".join(self.tables.get(k, "") for k in ("moe_summary", "moe", "moe_trl")))
        self.say(f"moe: {entry['summary']}")
        self.save()

    def trees(self) -> None:
        """Stepwise tree rows vs the same targets as samples rows (bench_stepwise --prepare), each trained by
        bench_train_gpu: tree rows through the structured attention, samples rows through the varlen kernel."""
        if not self.benches:
            self.report["phases"]["trees"] = {"skipped": "no CUDA"}
            self.save()
            return
        deadline = self.deadline("trees")
        entry: dict = {"runs": {}}
        self.report["phases"]["trees"] = entry
        data = self.work / "stepwise"
        length = SMOKE_TREES["max_length"] if self.smoke else 32768
        fixtures = self.fixtures
        if self.smoke and not (fixtures / "tokenizers" / "qwen3").is_dir():  # the CPU check: the shared fixtures
            fixtures = ROOT.parent / "shared" / "fixtures"
        cmd = [sys.executable, "-m", "benchmarks.bench_stepwise", "--prepare", str(data), "--max-length", str(length),
               "--fixtures", str(fixtures)] + (["--records", str(SMOKE_TREES["records"])] if self.smoke else [])
        code, seconds = self.run(cmd, deadline, self.work / "trees.log")
        entry["prepare"] = {"returncode": code, "seconds": round(seconds, 1)}
        if code != 0 or not (data / "stepwise.json").exists():
            self.save()
            return
        sets = json.loads((data / "stepwise.json").read_text())["sets"]
        entry["sets"] = sets
        model = (["--model-config", str(ROOT / SMOKE_TREES["model_config"]), "--model-name", "tiny-qwen-vocab"]
                 if self.smoke else ["--shapes", TREES_SHAPE])
        backend = "sdpa" if self.smoke else "torch_varlen"  # tree rows: the structured attention whatever is named
        for i, mode in enumerate(("tree", "samples")):
            result = self.work / f"trees_{mode}"
            run_deadline = deadline if i else deadline - 0.5 * (deadline - time.time()) if self.caps else deadline
            cmd = [sys.executable, "-m", "benchmarks.bench_train_gpu", "--packed", sets[mode]["packed"], *model,
                   "--row-lengths", str(length), "--backends", backend, "--steps", str(self.steps),
                   *self.limits(150, run_deadline - 5), "--out", str(result)]
            code, seconds = self.run(cmd, run_deadline, self.work / "trees.log")
            run = {"returncode": code, "seconds": round(seconds, 1)}
            if result.with_suffix(".json").exists():
                run["report"] = json.loads(result.with_suffix(".json").read_text())
            entry["runs"][mode] = run
            self.save()
        entry["summary"] = trees_summary(entry)
        self.tables["trees"] = trees_markdown(entry["summary"])
        write_atomic(self.out / "trees.md", self.tables["trees"])
        self.say(f"trees: {entry['summary']}")
        self.save()

    def collect(self, phase: str, result: Path, code: int | None, seconds: float) -> None:
        entry = {"returncode": code, "seconds": round(seconds, 1)}
        if result.with_suffix(".json").exists():
            entry["report"] = json.loads(result.with_suffix(".json").read_text())
            self.tables[phase] = result.with_suffix(".md").read_text()
        self.report["phases"][phase] = entry
        self.say(f"{phase}: exit {code} in {seconds:.0f} s")
        self.save()

    def furthest_target(self) -> tuple[str, int, str] | None:
        """(shape, row length, backend) of the target furthest below its goal, with its fastest backend."""
        worst = None
        for phase in TRAIN_PHASES:
            for row in self.report["phases"].get(phase, {}).get("report", {}).get("results", []):
                key = (row["shape"], row["row_length"])
                if key not in self.targets or row.get(self.targets[key][0]) is None:
                    continue
                metric, goal = self.targets[key]
                ratio = row[metric] / goal
                best = [r for r in self.report["phases"][phase]["report"]["results"]
                        if (r["shape"], r["row_length"]) == key and r.get(metric) is not None]
                fastest = max(best, key=lambda r: r[metric])
                if fastest is row and (worst is None or ratio < worst[0]):
                    worst = (ratio, row["shape"], row["row_length"], row["backend"])
        return worst[1:] if worst else None

    def profile(self, data: dict[int, Path]) -> None:
        target = self.furthest_target() if self.benches else None
        if target is None:
            self.report["phases"]["profile"] = {"skipped": "no CUDA" if not self.benches else "no measured target"}
            self.save()
            return
        shape, length, backend = target
        deadline = self.deadline("profile")
        result = self.work / "profile"
        packed = next(p for p in data.values() if json.loads((p / "meta.json").read_text())["max_length"] == length)
        cmd = [sys.executable, "-m", "benchmarks.bench_train_gpu", "--packed", str(packed), "--shapes", shape,
               "--row-lengths", str(length), "--backends", backend, "--steps", "3", *self.limits(120, deadline - 3),
               "--out", str(result), "--profile-out", str(self.out / "profile.txt"),
               *self.bench_flags]
        code, seconds = self.run(cmd, deadline, self.work / "profile.log")
        self.report["phases"]["profile"] = {"target": {"shape": shape, "row_length": length, "backend": backend},
                                            "returncode": code, "seconds": round(seconds, 1),
                                            "written": (self.out / "profile.txt").exists()}
        self.save()


def _measured(report: dict | None) -> list[dict]:
    return [r for r in (report or {}).get("results", []) if "tokens_per_s" in r]


def moe_summary(entry: dict) -> dict:
    """Per run: tokens/s, MFU, peak memory; grouped over loop, PackSFT (grouped) over TRL."""
    rows = {r["backend"].rsplit("+", 1)[-1]: r for r in _measured(entry.get("report"))}
    trl = _measured(entry.get("trl", {}).get("report"))
    out: dict = {"shape": entry["shape"], "row_length": entry.get("row_length"), "runs": {}}
    for name, r in rows.items():
        out["runs"][name] = {k: r.get(k) for k in ("tokens_per_s", "mfu", "peak_gib", "checkpointing",
                                                    "experts_implementation", "matmul_params", "n_params")}
    if trl:
        out["runs"]["trl"] = {k: trl[0].get(k) for k in ("tokens_per_s", "mfu", "peak_gib", "attn", "trl")}
        out["runs"]["trl"]["checkpointing"] = "on" if trl[0].get("gradient_checkpointing") else "off"
    runs = out["runs"]
    if "moe_grouped_mm" in runs and "moe_loop" in runs:
        out["grouped_over_loop"] = runs["moe_grouped_mm"]["tokens_per_s"] / runs["moe_loop"]["tokens_per_s"]
    if "moe_grouped_mm" in runs and "trl" in runs:
        out["packsft_over_trl"] = runs["moe_grouped_mm"]["tokens_per_s"] / runs["trl"]["tokens_per_s"]
    not_run = [r for r in (entry.get("report") or {}).get("results", []) if "tokens_per_s" not in r]
    not_run += [r for r in (entry.get("trl", {}).get("report") or {}).get("results", []) if "tokens_per_s" not in r]
    if not_run:
        out["not_run"] = [f"{r.get('backend') or r.get('attn')}: {r.get('error') or r.get('skipped')}" for r in not_run]
    return out


def moe_markdown(summary: dict) -> str:
    lines = [f"## MoE: {summary['shape']} at {summary['row_length']}-token rows, one device — grouped GEMM vs the "
             "per-expert loop, beside TRL", "",
             "| run | tokens/s | MFU (active parameters) | peak GiB | activation checkpointing |",
             "|---|---:|---:|---:|---|"]
    for name, r in summary["runs"].items():
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        label = f"TRL {r.get('trl')} ({r.get('attn')})" if name == "trl" else f"PackSFT {name}"
        lines.append(f"| {label} | {r['tokens_per_s']:,.0f} | {mfu} | {r['peak_gib']:.2f} | {r.get('checkpointing')} |")
    for key, text in (("grouped_over_loop", "grouped GEMM / loop"), ("packsft_over_trl", "PackSFT (grouped) / TRL")):
        if key in summary:
            lines.append(f"\n{text}: {summary[key]:.2f}x tokens/s")
    lines += [f"\nnot run: {why}" for why in summary.get("not_run", [])]
    return "\n".join(lines) + "\n"


def trees_summary(entry: dict) -> dict:
    """Per set: its rows, tokens, trained tokens, and the trainer's tokens/s and trained tokens/s; tree / samples."""
    out: dict = {"sets": {}}
    for mode, run in entry.get("runs", {}).items():
        rows = _measured(run.get("report"))
        cell = dict(entry["sets"][mode])
        cell.pop("packed", None)
        if rows:
            cell.update({k: rows[0].get(k) for k in ("tokens_per_s", "loss_tokens_per_s", "attention", "peak_gib")})
        else:
            cell["not_run"] = next((r.get("error") or r.get("skipped") for r in (run.get("report") or {})
                                    .get("results", [])), f"exit {run.get('returncode')}")
        out["sets"][mode] = cell
    tree, samples = out["sets"].get("tree", {}), out["sets"].get("samples", {})
    if tree.get("loss_tokens_per_s") and samples.get("loss_tokens_per_s"):
        out["tree_over_samples_trained"] = tree["loss_tokens_per_s"] / samples["loss_tokens_per_s"]
        out["tree_over_samples_tokens"] = tree["tokens_per_s"] / samples["tokens_per_s"]
    return out


def trees_markdown(summary: dict) -> str:
    lines = ["## Stepwise prefix trees vs the same targets as samples rows", "",
             "| set | attention | rows | tokens | trained tokens | tokens/s | trained tokens/s | peak GiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for mode, c in summary["sets"].items():
        if "not_run" in c:
            lines.append(f"| {mode} | not run: {c['not_run']} | {c['rows']} | {c['tokens']:,} | {c['loss_tokens']:,} "
                         f"| | | |")
            continue
        lines.append(f"| {mode} | {c['attention']} | {c['rows']} | {c['tokens']:,} | {c['loss_tokens']:,} | "
                     f"{c['tokens_per_s']:,.0f} | {c['loss_tokens_per_s']:,.0f} | {c['peak_gib']:.2f} |")
    if "tree_over_samples_trained" in summary:
        lines.append(f"\ntree / samples: {summary['tree_over_samples_trained']:.2f}x trained tokens/s "
                     f"({summary['tree_over_samples_tokens']:.2f}x tokens/s)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for gpu_check.{json,md,log}, ...")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="seconds for all phases together")
    ap.add_argument("--fixtures", type=Path, default=ROOT / ".fixtures",
                    help="copy of ../shared/fixtures (benchmarks/gpu_wheels.sh makes .fixtures)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/packsft_gpu_check"))
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per benchmark run (median of 3..)")
    ap.add_argument("--smoke", action="store_true",
                    help="run every phase on the CPU too: the example data at 2K and its tiny model (the check's check)")
    ap.add_argument("--second", action="store_true",
                    help="the second command: the trees and moe phases (issue 42), with their own budget")
    ap.add_argument("--legacy", action="store_true",
                    help="after the default phases, also the 0.5B shape per backend, 128K rows, TRL and a profile")
    ap.add_argument("--skip-tests", action="store_true",
                    help="leave out the tests phase (recorded as skipped): the CPU smoke test, whose other test runs "
                         "that phase already")
    ap.add_argument("--no-caps", action="store_true",
                    help="no phase deadline, no per-run timeout (a 1-hour hang guard only): every phase runs to its "
                         "end, whatever the machine's load (the CPU smoke test); --budget is then not used")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.second and args.legacy:
        raise SystemExit("--second runs its own phases (trees, moe); --legacy belongs to the first command")
    check = Check(args.out, args.budget, args.fixtures, args.work, args.steps, args.smoke, args.legacy,
                  caps=not args.no_caps, second=args.second)
    check.environment()
    prep = check.start_data()
    if args.second:  # the 32K rows pack on the CPU while the trees phase runs
        check.trees()
        check.moe(check.wait_data(prep))
        check.say(f"done in {time.time() - check.start:.0f} s")
        return
    if args.skip_tests:
        check.report["phases"]["tests"] = {"skipped": "--skip-tests"}
    else:
        check.tests()
    data = check.wait_data(prep)
    # the 1.5B shape's fused step with the plan's partial checkpointing, then with every layer checkpointed (the
    # previous run's 36.1% MFU), each profiled
    check.bench("train_32k_large", data, 32768, [SHAPE_LARGE], [FUSED, FUSED + "+ckpt"],
                extra=["--profile-out", str(check.out / "profile.txt")])
    check.long_rows()
    if args.legacy:
        # by value: the plain fastest kernel (the baseline), then the fused step, Liger alone, the SDPA loop
        check.bench("train_32k_small", data, 32768, [SHAPE_SMALL],
                    ["torch_varlen", FUSED, "torch_varlen+liger", "sdpa"])
        check.bench("train_128k", data, 131072, [SHAPE_LARGE, SHAPE_SMALL], [FUSED], extra=["--steps", "4"])
        check.trl(data)
        check.profile(data)
    check.say(f"done in {time.time() - check.start:.0f} s")

if __name__ == "__main__":
    main()
