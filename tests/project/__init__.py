"""Tests of the project itself: import layers, the GPU check and its benchmark."""
