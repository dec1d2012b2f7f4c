"""Attention over packed rows: the attention function, varlen kernels, structured masks, sequence parallel, Ulysses."""
