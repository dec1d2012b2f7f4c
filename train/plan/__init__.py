"""Decisions made once at start: the attention plan (SP layout, kernel per layer) and the memory plan."""
