"""One training step (forward + backward) of a tiny Granite 4 hybrid on one packed row, in its own process so that
its peak resident memory can be read: `python -m tests._recurrent_memory_worker TOKENS SEQUENCES`.

The model: `granitemoehybrid`, hidden 64, one Mamba2 and one attention layer, the config's default Mamba sizes (128
heads, state 256, chunks of 256). The row: TOKENS tokens cut into SEQUENCES sequences at seeded random places.
Prints one JSON line: peak RSS growth over the step (MiB, from getrusage) and the loss.
"""
import json
import resource
import sys

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GraniteMoeHybridConfig

import train.attention.function  # noqa: F401  (registers attn_implementation="packsft")
from tests.model_zoo import tiny_config
from train.attention.function import BACKENDS, AttentionContext, LayerKernels
from train.model.patches.recurrent import install_sequence_restart


def main(tokens: int, count: int) -> None:
    default = GraniteMoeHybridConfig()
    config = tiny_config("granitemoehybrid", mamba_n_heads=default.mamba_n_heads,
                         mamba_d_state=default.mamba_d_state, mamba_chunk_size=default.mamba_chunk_size)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(config, attn_implementation="packsft").train()
    layers = install_sequence_restart(lm)
    g = torch.Generator().manual_seed(1)
    bounds = [0, *sorted(torch.randperm(tokens - 1, generator=g)[: count - 1].add(1).tolist()), tokens]
    lengths = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
    input_ids = torch.randint(3, config.vocab_size, (1, tokens), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    attn = AttentionContext(torch.tensor(bounds, dtype=torch.int32), max(lengths), LayerKernels(every=BACKENDS["sdpa"]))

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    layers.set_row(attn.bounds)
    hidden = lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, packsft=attn)
    loss = F.cross_entropy(lm.lm_head(hidden.last_hidden_state[0, :-1]), input_ids[0, 1:])
    loss.backward()
    growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(json.dumps({"rss_growth_mib": growth, "loss": loss.item()}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
