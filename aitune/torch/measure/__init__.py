"""Measure: latency and throughput (paired with eager), peak memory, CUDA kernels per module."""
