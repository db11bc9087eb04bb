"""Kernel benchmarks: the grouped matmul on CPU and GPU, compiled for TPU, and the backward's profile."""
