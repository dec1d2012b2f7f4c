"""Tests of train/attention/: the attention function and its backends, varlen kernels, structured masks, sequence parallel."""
