"""`python -m torch.distributed.run --nproc_per_node=2 tests/_ep_worker.py <family> <config.json> <out.json> <kernel>`: one
causal LM, every rank its own tokens; the loss and gradients with every expert on every rank (summed over the ranks)
vs with the experts split by expert parallelism (train/model/experts.py), the expert gradients put back together.
Rank 0 writes the largest relative differences to out.json (tests/train/test_expert_parallel.py)."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main():
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from train.distributed import build_mesh, init_distributed
    from train.model.experts import apply_expert_parallel, gather_expert_state, is_expert_parameter

    family, config_path, out, kernel = sys.argv[1:]
    torch.set_num_threads(1)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    config = AutoConfig.for_model(**json.loads(Path(config_path).read_text()))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, config.vocab_size, (1, 12 + 5 * rank), generator=g)  # uneven tokens per rank

    def run(m):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    ref_loss = run(model)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    for grad in ref.values():
        dist.all_reduce(grad)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    mesh = build_mesh(ep_size=world)
    info = apply_expert_parallel(model, config, mesh, kernel)
    loss = run(model)
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if not is_expert_parameter(p):
            dist.all_reduce(grad)
        grads[name] = grad
    whole = gather_expert_state(model, {} if rank == 0 else None, mesh.ep_group, rank == 0)  # as the export does
    for name, p in model.named_parameters():
        if is_expert_parameter(p):
            parts = [torch.empty_like(grads[name]) for _ in range(world)]
            dist.all_gather(parts, grads[name].contiguous(), group=mesh.ep_group)
            grads[name] = torch.cat(parts)
    if rank == 0:
        worst = {name: float((grads[name] - ref[name]).abs().max() / ref[name].abs().max().clamp_min(1e-12))
                 for name in ref}
        Path(out).write_text(json.dumps({
            "loss": float(abs(loss - ref_loss) / ref_loss), "grads": worst, "info": info,
            "gathered_equal": {n: bool(torch.equal(whole[n], before[n])) for n in whole},
            "dense_layers": sum(1 for layer in model.model.layers if not hasattr(layer.mlp, "experts"))}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
