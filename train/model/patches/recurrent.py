"""Packed rows through recurrent mixers: restart every linear-attention / state-space / short-convolution mixer at
each packed sequence.

The attention function keeps packed sequences apart (train/attention/function.py), but the hybrid families' other token
mixers (gated delta rule, KDA, Mamba / Mamba2 scans, short convolutions, RG-LRU, lightning attention, mLSTM, RWKV
time mixing) never see it: their convolutions and recurrent states would run across the boundaries of a packed row
and each sequence would read its predecessors. `install_sequence_restart` puts a `SequenceRestart` wrapper in place
of each such mixer (the way PEFT wraps layers; no transformers function or class is patched). While boundaries are
set, the wrapper computes what the mixer computes on each sequence alone (zero initial state, its own convolution
padding), in one of two ways:
- one call over the whole row (`ONE_CALL`: the Mamba2, gated-delta-rule, KDA and short-convolution mixers): the
  wrapper runs the mixer's own forward with the sequence kernels it calls by name (`causal_conv1d_fn`,
  `mamba2_chunk_scan`, `torch_chunk_gated_delta_rule`, `chunk_kimi_delta_attention`) resolved to their
  boundary-restarting forms in train/model/patches/recurrent_kernels.py (the fused CUDA kernels with `seq_idx` / `cu_seqlens`
  where installed, torch forms elsewhere). Memory and time go by tokens, whatever the number of sequences;
- once per packed sequence, outputs concatenated, for the other mixers (Mamba1 scans, RG-LRU, lightning
  attention, mLSTM, RWKV, Zaya's convolution): exact on every device, one mixer call per sequence.

How the trainer uses it::

    layers = install_sequence_restart(lm)               # once, after build_lm (LoRA / checkpointing included)
    ...
    layers.set_row(attn.bounds)                          # before each decoder call; stays set for the recompute
    hidden = decoder_of(lm)(input_ids=..., position_ids=..., use_cache=False, packsft=attn)

The boundaries (the micro-batch's `Row`, train/row.py, with its cached index tensors) reach the wrappers through
one `RowHolder` they share, not through transformers' keyword arguments (the decoder layers do not forward them to
every mixer). They stay set after the forward so that activation-checkpoint recomputation during backward restarts
at the same places; `set_row` of the next micro-batch replaces them, `clear()` returns the wrappers to plain HF behaviour (one call on the whole input).

Sequence parallelism splits a row's tokens over ranks, so a rank's mixer would see a part of a sequence without the
state its predecessor rank ended with: `sequence_parallel_problem` gives the refusal text.
"""
from __future__ import annotations

import functools
import inspect
import re
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from train.model.patches import recurrent_kernels as kernels
from train.families import FAMILIES
from train.model.support import UnsupportedModelError
from train.row import Row, RowHolder

# class names of the token mixers that carry state along the sequence (the families' `mixers`); every one of them
# is exact when called once per sequence
KNOWN_MIXERS = frozenset(name for spec in FAMILIES.values() for name in spec.mixers)

# the module-level sequence kernels the mixers' forwards call by name -> their boundary-restarting forms
ROW_KERNELS = {
    "causal_conv1d_fn": kernels.causal_conv1d,
    "mamba2_chunk_scan": kernels.mamba2_chunk_scan,
    "torch_chunk_gated_delta_rule": kernels.chunk_gated_delta_rule,
    "chunk_kimi_delta_attention": kernels.chunk_kimi_delta_attention,
    # mamba-ssm's convolution + scan + norm + projection in one kernel (training, where installed) takes no
    # boundaries through transformers' call; returning None sends the mixer to its unfused path (the two above)
    "mamba2_split_conv1d_scan_combined": None,
}
SHORT_CONVOLUTION = ("causal_conv1d_fn",)
MAMBA2 = ("mamba2_split_conv1d_scan_combined", "causal_conv1d_fn", "mamba2_chunk_scan")
GATED_DELTA_RULE = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")
KIMI_DELTA_ATTENTION = ("causal_conv1d_fn", "chunk_kimi_delta_attention")
# mixer class -> the kernels its forward calls, every token mixing of it among them (checked per family by
# tests/train/model/patches/test_recurrent.py): these run once over the whole row; every other known mixer once per sequence
ONE_CALL = {
    **dict.fromkeys(("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"), SHORT_CONVOLUTION),
    **dict.fromkeys(("Mamba2Mixer", "BambaMixer", "FalconH1Mixer", "GraniteMoeHybridMambaLayer",
                     "NemotronHMamba2Mixer", "Zamba2MambaMixer"), MAMBA2),
    **dict.fromkeys(("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet",
                     "Qwen4ExpTextGatedDeltaNet", "OlmoHybridGatedDeltaNet"), GATED_DELTA_RULE),
    **dict.fromkeys(("KimiLinearDeltaAttention", "BailingHybridDeltaAttention"), KIMI_DELTA_ATTENTION),
}

# class-name fragments of sequence mixers that do not go through the attention function (the generic detector)
RECURRENT_NAME_FRAGMENTS = (
    "mamba", "ssm", "statespace", "deltanet", "deltaattention", "delta_attention", "linearattention",
    "lightning", "shortconv", "rglru", "recurrent", "lstm", "rwkv", "retention", "hyena",
)
# path components of non-text towers (multimodal causal LMs): their convolutions run on audio / pixels, not on the
# packed token sequence
MODALITY_TOWER = re.compile(r"audio|speech|vision|visual|image|video")
# keyword names under which transformers passes a recurrent cache / state to a mixer
CACHE_ARGUMENTS = ("cache_params", "past_key_values", "past_key_value", "cache", "state")


class SequenceRestart(nn.Module):
    """Restarts `mixer` at each packed sequence while boundaries are set (in one call over the row for the mixers
    of `ONE_CALL`, else once per sequence), calls it directly otherwise.

    Transparent: the wrapper shares the mixer's parameter, buffer and child dictionaries, so parameter and
    state-dict names are unchanged (checkpoints, LoRA targets and optimizer groups see the same model) and
    DeepSpeed's hooks on the wrapper and its children gather the mixer's weights. The mixer itself is held outside
    the module tree; attributes the wrapper lacks are read from it.
    """

    def __init__(self, mixer: nn.Module, boundaries: RowHolder):
        super().__init__()
        self._parameters = mixer._parameters
        self._buffers = mixer._buffers
        self._non_persistent_buffers_set = mixer._non_persistent_buffers_set
        self._modules = mixer._modules
        self.training = mixer.training
        object.__setattr__(self, "mixer", mixer)
        self._signature = inspect.signature(mixer.forward)
        self._hidden_argument = next(iter(self._signature.parameters))
        self.attach(boundaries)

    def attach(self, boundaries: RowHolder) -> None:
        """Read the boundaries from `boundaries` from now on."""
        object.__setattr__(self, "boundaries", boundaries)
        kernel_names = ONE_CALL.get(type(self.mixer).__name__)
        row_forward = None
        if kernel_names is not None:
            row_kernels = {name: _row_kernel(ROW_KERNELS[name], boundaries) for name in kernel_names}
            row_forward = _with_globals(type(self.mixer).forward, row_kernels)
        object.__setattr__(self, "_row_forward", row_forward)

    @property
    def one_call(self) -> bool:
        """Whether packed rows run through the mixer in one call (else once per sequence)."""
        return self._row_forward is not None

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            mixer = self.__dict__.get("mixer")
            if mixer is None:
                raise
            return getattr(mixer, name)

    def train(self, mode: bool = True):
        super().train(mode)
        self.mixer.training = mode  # the mixer is not a child: train() would not reach its own flag
        return self

    def extra_repr(self) -> str:
        how = "in one call" if self.one_call else "once per sequence"
        return f"restarts {type(self.mixer).__name__} at each packed sequence, {how}"

    # host offsets drive Python-side indexing: compiled decoder layers break their graph here rather than guard on them
    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        row = self.boundaries.row
        if row is None:
            return self.mixer(*args, **kwargs)
        arguments = self._keyword_arguments(args, kwargs)
        hidden = arguments[self._hidden_argument]
        if hidden.ndim < 2 or hidden.shape[0] != 1:
            raise ValueError(f"{self._describe()}: packed input must be [1, T, ...], got {tuple(hidden.shape)}")
        total = hidden.shape[1]
        if row.total != total:
            raise ValueError(
                f"{self._describe()}: the packed boundaries cover {row.total} tokens, the input has {total}"
            )
        for name in CACHE_ARGUMENTS:
            if arguments.get(name) is not None:
                raise ValueError(
                    f"{self._describe()}: a {name} was passed with packed boundaries set; packed training runs "
                    "with use_cache=False (clear() the boundaries for cached generation)"
                )
        # a row of one sequence needs no restart: the loop below makes it the mixer's own call, unmasked kernels
        if self._row_forward is not None and row.count > 1:
            return self._row_forward(self.mixer, **arguments)
        bounds = row.offsets
        pieces = [
            self.mixer(**{name: _token_slice(value, lo, hi, total) for name, value in arguments.items()})
            for lo, hi in zip(bounds[:-1], bounds[1:])
        ]
        lengths = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]
        return _join(pieces, lengths)

    def _keyword_arguments(self, args: tuple, kwargs: dict) -> dict:
        """All arguments by name (the mixer's **kwargs flattened in)."""
        bound = self._signature.bind(*args, **kwargs)
        arguments = {}
        for name, value in bound.arguments.items():
            kind = self._signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                raise TypeError(f"{self._describe()}: cannot split a mixer taking *{name}")
            else:
                arguments[name] = value
        return arguments

    def _describe(self) -> str:
        return f"SequenceRestart({type(self.mixer).__name__})"


def _row_kernel(kernel, boundaries: RowHolder):
    """`kernel` (a function of train/model/patches/recurrent_kernels.py taking `row=`) with the holder's current row; None stays
    None (a fused path that is skipped)."""
    if kernel is None:
        return lambda *args, **kwargs: None

    @functools.wraps(kernel)
    def restarted(*args, **kwargs):
        return kernel(*args, row=boundaries.row, **kwargs)

    return restarted


def _with_globals(function, replacements: dict):
    """A copy of `function` in which the global names of `replacements` resolve to the given values (transformers'
    own function and module are left as they are); a decorator that wrapped it with functools.wraps and holds it in
    its closure (transformers' `force_accelerate_hooks`) is copied around the copy. None when the function does not
    call every replaced name (a transformers whose mixer no longer computes through these kernels)."""
    inner = getattr(function, "__wrapped__", None)
    if inner is None:
        if not set(replacements) <= set(function.__code__.co_names):
            return None
        namespace = {**function.__globals__, **replacements}
        closure = function.__closure__
    else:
        copy_of_inner = _with_globals(inner, replacements)
        cells = function.__closure__ or ()
        if copy_of_inner is None or not any(cell.cell_contents is inner for cell in cells):
            return None
        namespace = function.__globals__
        closure = tuple(types.CellType(copy_of_inner) if cell.cell_contents is inner else cell for cell in cells)
    copy = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__, closure)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def _token_slice(value, lo: int, hi: int, total: int):
    """Tokens lo:hi of a per-token tensor (found by a dimension of size `total`), recursively in tuples and lists;
    anything else unchanged. Layouts: [T] (cache_position), [B, T, ...] (states, 2D masks, position ids),
    [k, B, T] (multi-axis position ids), [B, H, T, T] (4D masks)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_token_slice(item, lo, hi, total) for item in value)
    if not isinstance(value, torch.Tensor) or value.ndim == 0:
        return value
    if value.ndim == 1:
        return value[lo:hi] if value.shape[0] == total else value
    if value.ndim == 4 and value.shape[-2:] == (total, total):
        return value[..., lo:hi, lo:hi]
    if value.shape[1] == total:
        return value[:, lo:hi]
    if value.ndim == 3 and value.shape[1] == 1 and value.shape[2] == total:
        return value[:, :, lo:hi]
    return value


def _join(pieces: list, lengths: list[int]):
    """Per-sequence outputs -> one: per-token tensors ([1, L_i, ...]) concatenated along the tokens; any other
    value (a final recurrent state, None) is the last sequence's, which is what a run restarted at every boundary
    ends with."""
    first = pieces[0]
    if isinstance(first, (tuple, list)):
        return type(first)(_join([piece[i] for piece in pieces], lengths) for i in range(len(first)))
    if isinstance(first, torch.Tensor) and all(
        piece.ndim >= 2 and piece.shape[1] == n for piece, n in zip(pieces, lengths)
    ):
        return torch.cat(pieces, dim=1)
    return pieces[-1]


@dataclass
class RecurrentLayers:
    """The wrappers `install_sequence_restart` put into a model (empty for a model without recurrent mixers)."""

    boundaries: RowHolder = field(default_factory=RowHolder)
    wrapped: dict[str, str] = field(default_factory=dict)  # module name -> mixer class name

    def __bool__(self) -> bool:
        return bool(self.wrapped)

    @property
    def names(self) -> list[str]:
        return list(self.wrapped)

    def set_row(self, row: Row | None) -> None:
        """The packed row of the next forward (`AttentionContext.bounds`: its host offsets [0, l1, ..., T] and their
        cached index tensors). It stays set, for the backward's recomputation, until replaced or cleared."""
        if row is None:
            raise ValueError("recurrent mixers (train/model/patches/recurrent.py) cannot run under sequence "
                             "parallelism: a rank holds a slice of each sequence")
        bounds = row.offsets
        if len(bounds) < 2 or bounds[0] != 0 or any(hi <= lo for lo, hi in zip(bounds[:-1], bounds[1:])):
            raise ValueError(f"packed boundaries must start at 0 and strictly increase, got {bounds}")
        self.boundaries.row = row

    def clear(self) -> None:
        """Back to plain HF behaviour: each mixer call covers its whole input (one unpacked sequence)."""
        self.boundaries.row = None


def _is_known_mixer(module: nn.Module) -> bool:
    return type(module).__name__ in KNOWN_MIXERS or isinstance(module, SequenceRestart)


def _family_prefixes(lm: nn.Module) -> tuple[str, ...]:
    """Class-name prefixes of the model's own classes ("Qwen3Next" of Qwen3NextForCausalLM), longest first: the
    generic detector matches what follows them, so that "RecurrentGemmaRMSNorm" is not taken for a recurrence."""
    from transformers import PreTrainedModel

    prefixes = {
        re.sub(r"(For[A-Z]\w*|PreTrainedModel|Model)$", "", type(module).__name__)
        for module in lm.modules()
        if isinstance(module, PreTrainedModel)
    }
    return tuple(sorted(filter(None, prefixes), key=len, reverse=True))


def _looks_recurrent(module: nn.Module, prefixes: tuple[str, ...]) -> bool:
    """Generic detector for mixers no family lists: a module below the decoder layers whose class name
    (after the family prefix) names a recurrent mixer, or one owning a Conv1d (a convolution over the sequence)."""
    from transformers import PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer

    if isinstance(module, (PreTrainedModel, GradientCheckpointingLayer, nn.ModuleList, nn.ModuleDict)):
        return False
    name = type(module).__name__
    name = next((name[len(prefix):] for prefix in prefixes if name.startswith(prefix)), name).lower()
    if any(fragment in name for fragment in RECURRENT_NAME_FRAGMENTS):
        return True
    return any(isinstance(child, nn.Conv1d) for child in module.children())


def _scan(lm: nn.Module) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
    """(known mixers, unknown recurrent-looking modules) by module name; the outermost of nested matches. The
    generic detector skips modality towers."""
    prefixes = _family_prefixes(lm)
    known, unknown = {}, {}
    for name, module in lm.named_modules():
        if any(name.startswith(prefix + ".") for prefix in (*known, *unknown)):
            continue
        if _is_known_mixer(module):
            known[name] = module
        elif not MODALITY_TOWER.search(name) and _looks_recurrent(module, prefixes):
            unknown[name] = module
    return known, unknown


def recurrent_mixers(lm: nn.Module) -> list[str]:
    """Names of the modules that mix tokens outside the attention function: the known mixers (KNOWN_MIXERS, wrapped
    or not) and whatever the generic detector flags. Empty for a plain transformer."""
    known, unknown = _scan(lm)
    return [*known, *unknown]


def install_sequence_restart(lm: nn.Module) -> RecurrentLayers:
    """Wrap every known recurrent mixer of `lm` (a causal LM, its body, or a PEFT wrapper) in a `SequenceRestart`
    sharing one boundaries holder. Idempotent: already wrapped mixers join the returned holder.

    Raises UnsupportedModelError when the generic detector finds mixers of an unknown family: packed rows would
    leak through them, so training must not start."""
    known, unknown = _scan(lm)
    if unknown:
        raise UnsupportedModelError(
            f"{_family(lm)}: token mixers outside the attention function that PackSFT cannot restart at packed "
            f"sequence boundaries: {_abbreviate(unknown)}. Packed rows would leak between sequences; add their "
            "classes to the family's `mixers` in train/families.py once checked exact per sequence"
        )
    layers = RecurrentLayers()
    modules = dict(lm.named_modules())
    for name, module in known.items():
        if isinstance(module, SequenceRestart):
            module.attach(layers.boundaries)
        else:
            parent_name, _, child_name = name.rpartition(".")
            module = SequenceRestart(module, layers.boundaries)
            setattr(modules[parent_name], child_name, module)
        layers.wrapped[name] = type(module.mixer).__name__
    return layers


def sequence_parallel_problem(lm_or_config) -> str | None:
    """Why sequence parallelism cannot train this model exactly (None: it can).

    A rank holds a slice of each row, so its recurrent mixers would start every sequence piece from a zero state
    instead of the state the previous rank's piece ended with. Takes the model, or its config (the model is then
    built on the meta device, no memory, to find its mixers)."""
    lm = lm_or_config if isinstance(lm_or_config, nn.Module) else _meta_model(lm_or_config)
    known, unknown = _scan(lm)
    mixers = {**known, **unknown}
    if not mixers:
        return None
    return (
        f"sequence_parallel_size > 1 cannot train {_family(lm)} exactly: its recurrent token mixers "
        f"({_abbreviate(mixers)}) carry state along the sequence, and sequence parallelism gives each rank only a "
        "slice of every sequence. Set sequence_parallel_size=1 (shorter rows or gradient checkpointing save memory)"
    )


def _meta_model(config) -> nn.Module:
    from train.model.composite import auto_model_class

    with torch.device("meta"):
        return auto_model_class(config).from_config(config)


def _family(lm: nn.Module) -> str:
    config = getattr(lm, "config", None)
    model_type = getattr(config, "model_type", None)
    return f"model_type {model_type!r}" if model_type else type(lm).__name__


def _abbreviate(modules: dict[str, nn.Module], shown: int = 4) -> str:
    """'N modules (classes): first names and K more'."""
    names = list(modules)
    classes = sorted({type(m.mixer if isinstance(m, SequenceRestart) else m).__name__ for m in modules.values()})
    head = ", ".join(names[:shown])
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{len(names)} modules ({', '.join(classes)}): {head}{more}"
