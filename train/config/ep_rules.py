"""The rules expert parallelism (`expert_parallel_size`, train/model/experts.py) obeys, each written once: pure
functions (no torch) that say what is wrong (None: nothing), naming the key and what would work.

- the values (train/config/sections.py, before anything is read): the engine (plain torch or FSDP2), the
  data-parallel size (processes / sequence_parallel_size) divisible by the degree, and the features not yet verified
  with it (LoRA and tiled_mlp are verified: adapters stay whole on every rank, the routed experts' too, and
  tiled_mlp tiles the rows each rank's experts receive, after the exchange; LoRA on the routed experts under FSDP2
  is refused);
- the model (train/preflight.py, once its config is read, before any weight loads): a mixture-of-experts family
  whose experts module the family table marks (`FamilySpec.experts`), with num_experts divisible by the degree.
"""
from __future__ import annotations


def expert_parallel_problem(cfg, world_size: int, sp: int | str | None = None) -> str | None:
    """What the values of TrainConfig `cfg` forbid for its expert_parallel_size on `world_size` processes (`sp`: the
    sequence-parallel degree, default the config's; `auto` leaves the data-parallel size to be checked once chosen)."""
    ep = cfg.parallel.expert_parallel_size
    if ep < 1:
        return f"expert_parallel_size must be >= 1, got {ep}"
    if ep == 1:
        return None
    head = f"expert_parallel_size={ep}"
    if cfg.uses_deepspeed:
        return (f"{head} is not supported under DeepSpeed (deepspeed.stage={cfg.deepspeed.stage}): ZeRO would average "
                "each expert's gradient over every rank and partition it across the ranks holding other experts, "
                "while under expert parallelism only the ranks holding the same experts share one; use "
                "distributed_backend=fsdp2 with deepspeed.stage=null (or deepspeed.stage=null alone: plain torch "
                "AdamW), or expert_parallel_size=1")
    if cfg.uses_fsdp2 and cfg.lora.lora_rank > 0 and cfg.lora.target_parameters:
        return (f"{head} with LoRA target_parameters={cfg.lora.target_parameters} under distributed_backend=fsdp2 is "
                "not supported: each experts module is its own FSDP2 unit, still sharded where peft folds the "
                "adapters into its weights; use the plain engine (distributed_backend=deepspeed with "
                "deepspeed.stage=null), target_parameters=[] (LoRA on linear layers only), or expert_parallel_size=1")
    if cfg.model.compile_layers:
        return (f"{head} with compile_layers: true is not verified yet (the token exchange inside a compiled decoder "
                "layer); set compile_layers=false, or expert_parallel_size=1")
    sp = cfg.parallel.sequence_parallel_size if sp is None else sp
    for processes, what in ((world_size, f"world size {world_size}"),
                            (cfg.launch.num_processes, f"launch.num_processes={cfg.launch.num_processes}")):
        if processes <= 1 or sp == "auto" or processes % sp:  # (not whole sp groups: sp_rules' message)
            continue
        if (processes // sp) % ep:
            return (f"{head} must divide the data-parallel size ({processes // sp} = {what} / sequence_parallel_size "
                    f"{sp}): each group of {ep} data-parallel ranks shares one copy of the experts; use a divisor of "
                    f"{processes // sp}")
    if world_size == 1:
        return (f"{head} needs {ep} processes (a multiple of {ep}), got one; run `sh train.sh` with "
                f"launch.num_processes={ep} (or a multiple), or expert_parallel_size=1")
    return None


def expert_count(text_config, count_key: str) -> int | None:
    value = getattr(text_config, count_key, None)
    return value if isinstance(value, int) else None


MOE_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def expert_count_keys(text_config) -> list[str]:
    """The keys of MOE_COUNT_KEYS the (text) model config sets above 1: none for a dense model."""
    return [k for k in MOE_COUNT_KEYS if isinstance(getattr(text_config, k, None), int) and getattr(text_config, k) > 1]


def model_expert_parallel_problem(expert_parallel_size: int, model_config, model_type: str) -> str | None:
    """What the model config forbids for `expert_parallel_size`: a dense model, a family whose experts the table
    does not mark, a number of experts the degree does not divide."""
    from train.families import FAMILIES, expert_parallel_families, text_config

    ep = expert_parallel_size
    if ep == 1:
        return None
    text = text_config(model_config)
    text_type = getattr(text, "model_type", model_type)
    spec = FAMILIES.get(text_type)
    head = f"expert_parallel_size={ep}"
    counts = expert_count_keys(text)
    if spec is None or spec.experts is None:
        if not counts:
            return (f"{head} needs a mixture-of-experts model; {model_type!r} is dense (its config has none of "
                    f"{', '.join(MOE_COUNT_KEYS)}): set expert_parallel_size=1")
        return (f"{head}: family {text_type!r} is not one expert parallelism supports yet (supported: "
                f"{', '.join(expert_parallel_families())}); set expert_parallel_size=1")
    n = expert_count(text, spec.experts.count_key)
    if n is None:
        return f"{head}: the model config has no {spec.experts.count_key} (its number of experts); set expert_parallel_size=1"
    if n % ep:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        return (f"{head} must divide the number of experts ({spec.experts.count_key}={n}): each rank holds "
                f"{spec.experts.count_key} / expert_parallel_size of them; use one of {divisors}")
    return None
