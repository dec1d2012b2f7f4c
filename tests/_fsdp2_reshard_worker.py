"""`python tests/_fsdp2_reshard_worker.py config.yaml checkpoint_dir [key=value ...]`: one process (FSDP2 over a
world of one) loads the model, optimizer and lr-scheduler state of an FSDP2 checkpoint written by another number of
ranks straight through its engine, then trains the remaining steps into output_dir's log.jsonl. The data position
and the resume checks of a run are not exercised here: only the state."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main():
    from train.checkpoint import load_trainer_state
    from train.config import load_config
    from train.trainer import Trainer

    config, checkpoint, *overrides = sys.argv[1:]
    trainer = Trainer(load_config(config, overrides))
    trainer.engine.load(Path(checkpoint))
    trainer.step = int(load_trainer_state(Path(checkpoint))["step"])
    trainer.train()
    from train.__main__ import release_process_groups

    trainer = None
    release_process_groups()


if __name__ == "__main__":
    main()
