"""The rules a sequence-parallel layout obeys, each written once: pure functions of numbers (no torch) that say
what is wrong (None: nothing). train/config/sections.py checks the config with them, train/distributed.py the mesh it
builds, train/plan/attention.py the layout it chooses from the model's heads, and train/attention/ulysses.py the heads of
every exchange.

- the processes (the world, `launch.num_processes`) split into whole sp groups;
- the Ulysses degree u divides the sp degree, and its ring part (u < sp) uses the contiguous layout (not zigzag);
- a Ulysses group of u ranks splits the heads: u divides the query heads and the key/value heads, or is a multiple
  of the key/value heads, which are then repeated up to u;
- an sp group stays on one machine, except the Ulysses x ring hybrid: sp a multiple of the processes per machine,
  each Ulysses group inside one machine.
"""
from __future__ import annotations

from train.config.backend_names import AUTO, ULYSSES, ZIGZAG


def processes_problem(processes: int, what: str, sp_size: int) -> str | None:
    """`processes` (`what` names them) must split into whole sp groups."""
    return None if processes % sp_size == 0 else f"{what} is not divisible by sequence_parallel_size={sp_size}"


def degree_problem(sp_size: int, ulysses_size: int) -> str | None:
    """The Ulysses degree must divide the sp degree."""
    if ulysses_size >= 1 and sp_size % ulysses_size == 0:
        return None
    return f"sp_ulysses_size={ulysses_size} must divide sequence_parallel_size={sp_size} (or be null)"


def ulysses_size_problem(sp_backend: str, sp_size: int, ulysses_size: int | None) -> str | None:
    """`sp_ulysses_size` against the sp degree and `sp_backend` (None: chosen from the heads, always possible)."""
    if ulysses_size is None:
        return None
    if problem := degree_problem(sp_size, ulysses_size):
        return problem
    if ulysses_size > 1 and sp_backend == ZIGZAG:
        return ("sp_ulysses_size > 1 needs the contiguous layout; sp_backend=zigzag cannot be its ring part (use "
                "auto, torch, llama3 or ulysses)")
    if ulysses_size == 1 and sp_backend == ULYSSES:
        return "sp_backend=ulysses needs sp_ulysses_size > 1 (or null: sequence_parallel_size)"
    return None


def kv_heads_after_repeat(n_kv_heads: int, degree: int) -> int:
    """Key/value heads entering the Ulysses exchange: repeated up to `degree` when fewer."""
    return max(n_kv_heads, degree)


def heads_problem(n_heads: int, n_kv_heads: int, degree: int) -> str | None:
    """Why a Ulysses group of `degree` ranks cannot split these heads."""
    if n_heads % degree:
        return f"{n_heads} attention heads are not divisible by the Ulysses degree {degree}"
    if n_kv_heads >= degree and n_kv_heads % degree:
        return f"{n_kv_heads} key/value heads are not divisible by the Ulysses degree {degree}"
    if n_kv_heads < degree and degree % n_kv_heads:
        return (f"{n_kv_heads} key/value heads cannot be repeated up to the Ulysses degree {degree} (it is not a "
                "multiple of them)")
    return None


def allowed_degrees(n_heads: int, n_kv_heads: int, sp_size: int) -> list[int]:
    """Ulysses degrees > 1 dividing `sp_size` that these heads allow, ascending."""
    return [d for d in range(2, sp_size + 1) if sp_size % d == 0 and not heads_problem(n_heads, n_kv_heads, d)]


def placement_problem(sp_backend: str, sp_size: int, ulysses_size: int | None, per_machine: int) -> str | None:
    """An sp group must not span machines, except the hybrid: whole machines of Ulysses groups, the ring between
    them (`sp_ulysses_size` dividing the processes per machine, or chosen by `auto`)."""
    if per_machine % sp_size == 0:
        return None
    if sp_size % per_machine == 0:
        if ulysses_size is None and sp_backend == AUTO:
            return None
        if ulysses_size is not None and ulysses_size > 1 and per_machine % ulysses_size == 0:
            return None
    return (f"sequence_parallel_size={sp_size} does not divide the {per_machine} processes per machine: a "
            "sequence-parallel group must not span machines, except the Ulysses x ring hybrid (sp_backend auto or "
            "sp_ulysses_size dividing the processes per machine, sequence_parallel_size a multiple of them)")


# stepwise trees and sequence parallelism (the plan refuses tree rows under an SP layout; the start-up checks a fixed
# degree from the shards' fields)
TREE_SP_REFUSAL = ("stepwise trees (tree_spans in the shards) cannot run under sequence parallelism yet: no SP "
                   "layout carries their subtree mask. Train them with sequence_parallel_size: 1, or re-run the data "
                   "pipeline with stepwise: samples")
