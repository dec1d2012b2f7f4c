"""`python -m torch.distributed.run ... tests/_reshard_worker.py config.yaml rows_dir [key=value ...]`: train, and
record the rows every rank trains at every step (rows_dir/rank_<r>.jsonl) and the resume line (rank 0), for the
tests of resuming on another number of processes."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def record_rows(trainer, rows_dir: Path) -> None:
    """Make `trainer` append {step, dp_rank, rows} to rows_dir/rank_<r>.jsonl for each step it trains (fillers,
    which train nothing, left out)."""
    import orjson

    file = rows_dir / f"rank_{trainer.mesh.rank}.jsonl"
    train_step = trainer.train_step

    def recorded(plan, feed=None):
        rows = [r for mb in plan.micro_batches if not mb.filler for r in mb.rows]
        with file.open("ab") as f:
            f.write(orjson.dumps({"step": plan.step + 1, "dp_rank": trainer.mesh.dp_rank,
                                  "sp_rank": trainer.mesh.sp_rank, "rows": rows}) + b"\n")
        return train_step(plan, feed)

    trainer.train_step = recorded


def main():
    from train.config.sections import load_config
    from train.trainer import Trainer

    config, rows_dir, *overrides = sys.argv[1:]
    rows_dir = Path(rows_dir)
    rows_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    trainer = Trainer(load_config(config, overrides), console=lines.append)
    if trainer.mesh.is_main:
        (rows_dir / "console.txt").write_text("\n".join(map(str, lines)))
    record_rows(trainer, rows_dir)
    trainer.train()
    from train.__main__ import release_process_groups

    trainer = None
    release_process_groups()


if __name__ == "__main__":
    main()
