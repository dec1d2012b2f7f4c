"""End-to-end runs through both halves: data_process.sh then sh train.sh (Parallel-R1, stepwise trees, images)."""
