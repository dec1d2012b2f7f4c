"""What data/ and train/ both use and neither owns: the typed-config machinery, crash-safe file writes and hashes,
the run lock. Imports neither of them (tests/project/test_layering.py)."""
