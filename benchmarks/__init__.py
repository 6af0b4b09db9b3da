"""Developer benchmarks, probes and calibration scripts, run from the repository root."""
