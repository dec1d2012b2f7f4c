"""Tests of common/: the modules below data/ and train/ (the output directory's lock)."""
