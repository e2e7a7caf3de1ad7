"""The sections of benchmarks/gpu_probe.py, by plane, and the report they write to."""
