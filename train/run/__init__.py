"""The run around the loop: built in order (setup), its start-up self-check (check), checkpoints (resume), export."""
