"""`python -m torch.distributed.run ... tests/_train_worker.py config.yaml grads_dir [key=value ...]`: train and
save every step's summed gradients (rank 0) to grads_dir/step_<n>.pt, for the equivalence tests."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main():
    import torch

    from train.config.sections import load_config
    from train.trainer import Trainer

    config, grads_dir, *overrides = sys.argv[1:]
    out = Path(grads_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(load_config(config, overrides))

    def dump(tr):
        if tr.mesh.is_main:
            grads = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None}
            torch.save(grads, out / f"step_{tr.step + 1}.pt")

    trainer.grad_hook = dump
    trainer.train()
    from train.__main__ import release_process_groups

    trainer = None
    release_process_groups()  # as python -m train does: no gloo thread left running at exit (SIGABRT)


if __name__ == "__main__":
    main()
