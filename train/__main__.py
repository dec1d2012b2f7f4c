"""`python -m train [config.yaml] [key=value ...]` (normally started by `sh train.sh` through accelerate launch)."""
from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import traceback

from common.errors import PackSFTError
from train.machines.stop_report import reports_directory, say_stop, stopping

DEFAULT_CONFIG = "configs/train/example.yaml"


def launch_args(cfg, threads) -> list[str]:
    """`accelerate launch` options for this config (train.sh), with `threads` (train.machines.threads.CpuThreads) per
    process. Several processes go through accelerate's multi-process (torchrun) launcher, on CPU too; ranks then come
    from torch.distributed (gloo on CPU)."""
    import torch

    launch = cfg.launch
    args = ["--num_processes", str(launch.num_processes), "--num_machines", str(launch.num_machines),
            "--machine_rank", str(launch.machine_rank), "--main_process_port", str(launch.main_process_port),
            "--mixed_precision", "no", "--dynamo_backend", "no",
            "--num_cpu_threads_per_process", str(threads.per_process)]  # accelerate's OMP_NUM_THREADS, said
    if launch.main_process_ip:
        args += ["--main_process_ip", launch.main_process_ip]
    if launch.num_processes > 1 or launch.num_machines > 1:
        args.append("--multi_gpu")  # accelerate's torchrun launcher; it also starts CPU processes (gloo)
    elif not torch.cuda.is_available():
        args.append("--cpu")  # accelerate's --cpu launcher starts a single process only
    return args


def resume_command(config_path: str, overrides: list[str]) -> str:
    """The command that continues a run stopped by stop_at_step: the same config and overrides with resume=latest
    (and stop_at_step=null when the YAML file sets one)."""
    from train.config.sections import load_config

    own = ("resume", "stop_at_step")
    kept = [o for o in overrides if o.split("=", 1)[0].strip() not in own]
    extra = ["resume=latest"]
    if load_config(config_path, kept).steps.stop_at_step is not None:
        extra.append("stop_at_step=null")
    return "sh train.sh " + shlex.join([config_path, *kept, *extra])


def main(argv: list[str] | None = None) -> int:
    """The command (module docstring). The stop signals' handlers this process had are restored when it returns:
    `python -m train` exits right after, and an in-process caller (a test) keeps its own. A SIG_IGN left behind by a
    stopping run (train/machines/stop_report.py `stopping`) would pass to every process the caller starts later,
    which a SIGTERM could then no longer stop (a process pool's workers that `terminate` cannot end: seen as a hang)."""
    from train.machines.stop_report import STOP_SIGNALS

    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        return run_command(list(sys.argv[1:] if argv is None else argv))
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: a handler not set from Python (left as it is)
                signal.signal(sig, handler)


def run_command(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        from train.config.sections import help_text

        try:
            print(help_text(), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader left; silence the flush at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if argv and argv[0] == "--launch":  # train.sh: accelerate launch under a supervisor (train/launch.py)
        from train.launch import MachineWatch, supervise
        from train.machines.heartbeat import heartbeat_port
        from train.machines.layout import describe_layout, load_launch_config
        from train.machines.threads import THREADS_ENV, choose_cpu_threads
        from train.preflight import preflight

        argv.pop(0)
        config_path = argv.pop(0) if argv and "=" not in argv[0] else DEFAULT_CONFIG
        try:  # every check is made here, before accelerate starts any process
            cfg, from_environment = load_launch_config(config_path, argv)
            preflight(cfg, world_size=cfg.launch.num_processes)
        except PackSFTError as exc:
            print(exc.one_line(), file=sys.stderr)
            return exc.exit_code
        launch = cfg.launch
        if launch.num_machines > 1 or from_environment:
            print(describe_layout(cfg, from_environment), flush=True)
        threads = choose_cpu_threads(launch.cpu_threads_per_process, launch.processes_per_machine)
        os.environ[THREADS_ENV] = f"{threads.per_process}\t{threads.why}"  # the trainers say it, as chosen here
        command = [sys.executable, "-m", "train.launch", *launch_args(cfg, threads), "-m", "train", config_path,
                   *argv]
        watch = MachineWatch(launch.machine_rank, launch.num_machines, launch.main_process_ip,
                             heartbeat_port(launch.main_process_port), launch.heartbeat_timeout_s)
        try:  # machine 0 holds the lock of the shared output_dir for every machine of the run
            return supervise(command, cfg.checkpoint.output_dir if launch.machine_rank == 0 else None,
                             reports=launch.num_processes > 1, watch=watch if launch.num_machines > 1 else None)
        except PackSFTError as exc:  # the output_dir's lock held by another run, the heartbeat's port taken
            print(exc.one_line(), file=sys.stderr)
            return exc.exit_code
    from train.launch import die_with_supervisor
    from train.machines.layout import load_launch_config
    from train.machines.threads import apply_cpu_threads, trainer_cpu_threads

    die_with_supervisor()  # under train.sh: never outlive it (kill -9 to it leaves no orphan training on)
    config_path = argv.pop(0) if argv and "=" not in argv[0] else DEFAULT_CONFIG
    configure_console()

    received = stop_on_signals()
    cfg = trainer = None
    try:
        cfg = load_launch_config(config_path, argv)[0]  # torchrun's world over the launch keys
        threads = trainer_cpu_threads(cfg.launch.cpu_threads_per_process)
        apply_cpu_threads(threads)  # before numpy's and torch's thread pools start
        from train.preflight import preflight

        checked = preflight(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # before the model (and most imports) load
        if int(os.environ.get("RANK", "0")) == 0:
            print(threads.describe(), flush=True)
        quiet_cpu_accelerator_notice()
        from train.trainer import Trainer

        apply_cpu_threads(threads)  # torch is loaded: its own count (it caps OMP_NUM_THREADS at the cores)
        trainer = Trainer(cfg, checked=checked)
        trainer.train()
        if trainer.step < trainer.total_steps and trainer.mesh.is_main:
            print(f"resume with: {resume_command(config_path, argv)}", flush=True)
    except PackSFTError as exc:  # a config, model, checkpoint, data or self-check error, a diverged step: one line,
        return say_stop(exc.one_line(), exc.exit_code)  # said once for the run (train/machines/stop_report.py)
    except BaseException as exc:
        if received:  # Interrupted, or the error a collective raised on this rank when another rank stopped first
            report_interrupt(received[0], trainer, cfg, config_path, argv)
            return 128 + received[0]
        if isinstance(exc, Exception) and reports_directory() is not None:  # said only if nothing else explains
            stopping()  # the stop: mostly a collective failing after another rank or machine ended
            return say_stop(f"[train.sh] rank {os.environ.get('RANK', '?')} failed:\n{traceback.format_exc()}", 1,
                            kind="crash")
        raise
    finally:
        trainer = None
        release_process_groups()
    return 0


class ConsoleFormat(logging.Formatter):
    """PackSFT's console lines are plain text: a warning reads `warning: message`, as an error reads `config error:
    message` (train/ and data/ print the rest themselves)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return f"{record.levelname.lower()}: {text}" if record.levelno >= logging.WARNING else text


PACKSFT_LOGGERS = ("train", "data", "common", "packsft")


def configure_console() -> None:
    """One console format for the run's log lines (`ConsoleFormat`), and PackSFT's own warnings said once: by rank 0
    (every rank runs the same checks on the same inputs, so the others would repeat them word for word); an error
    is still said by the rank that meets it."""
    handler = logging.StreamHandler()
    handler.setFormatter(ConsoleFormat("%(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    if int(os.environ.get("RANK", "0")) != 0:
        for name in PACKSFT_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)


def quiet_cpu_accelerator_notice() -> None:
    """Without CUDA (nor another accelerator's torch extension), DeepSpeed's accelerator is the CPU: say so
    (`DS_ACCELERATOR=cpu`) instead of letting DeepSpeed warn that it "was unable to detect" a GPU when the run (or
    the export, through transformers) first touches it. An explicit DS_ACCELERATOR is kept."""
    import importlib.util

    import torch

    others = ("intel_extension_for_pytorch", "torch_npu", "habana_frameworks", "torch_mlu", "torch_musa",
              "torch_sdaa", "torch_supa", "torch_xmlir")
    if "DS_ACCELERATOR" in os.environ or torch.cuda.is_available() or getattr(torch.backends, "mps", None) and \
            torch.backends.mps.is_available():
        return
    if not any(importlib.util.find_spec(name) for name in others):
        os.environ["DS_ACCELERATOR"] = "cpu"


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP while training (a KeyboardInterrupt: no `except Exception` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_on_signals() -> list[int]:
    """Make SIGINT, SIGTERM and SIGHUP raise Interrupted at once (the first one; later ones are ignored while the
    run stops): the run then says where it stopped instead of dying silently (SIGTERM) or with a traceback
    (Ctrl-C). Returns the list the received signal goes into."""
    from train.launch import FORWARDED_SIGNALS

    received: list[int] = []

    def handler(signum, _frame) -> None:
        if not received:
            received.append(signum)
            raise Interrupted(signum)

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, handler)
    return received


def report_interrupt(signum: int, trainer, cfg, config_path: str, argv: list[str]) -> None:
    """On the main rank: the step reached, the last complete checkpoint and the command that resumes from it,
    as stop_at_step says them. Nothing of the interrupted step is saved; a checkpoint being written stays a
    `.step-N.tmp/`, removed by the next start."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    name = signal.Signals(signum).name
    where = (f"stopped at step {trainer.step} of {trainer.total_steps} ({name})" if trainer is not None else
             f"stopped before the first step ({name})")
    if cfg is None:
        say_stop(where, 128 + signum, kind="interrupt", stream="stdout")
        return
    from train.checkpoint import CheckpointError, resolve_resume

    try:
        last = resolve_resume("latest", cfg.checkpoint.output_dir)
    except CheckpointError:
        last = None
    say_stop(f"{where}; last checkpoint: {last if last is not None else 'none yet (resume=latest starts at step 0)'}"
             f"\nresume with: {resume_command(config_path, argv)}", 128 + signum, kind="interrupt", stream="stdout")


def release_process_groups() -> None:
    """Destroy the process groups and free them now, while the interpreter is whole. destroy_process_group() alone
    leaves gloo's process groups, and their worker threads, alive for as long as Python objects reference them (the
    trainer's mesh, which sits in reference cycles): they were then freed during interpreter shutdown, where a
    worker thread releasing the tensors of a last collective needs the GIL of a finalizing interpreter and aborts
    the process (SIGABRT, "terminate called without an active exception"), on the rank that exits first."""
    import gc

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # the trainer's cycles: each ProcessGroupGloo destructor joins its worker threads here


if __name__ == "__main__":
    status = main()
    # everything the run writes is on disk (synced, atomically renamed) and its process groups are released: skip
    # the interpreter's teardown of torch and its thread pools (seconds on 2 busy cores) that would follow
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that left (`| head`), a closed stream
            pass
    os._exit(status)
