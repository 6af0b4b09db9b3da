"""Benchmarks behind ``megarl bench``: each measures its variants side by side in one process."""
