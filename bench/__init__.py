"""Benchmark suite: LoRA kernels and model steps, timed inside CUDA graphs, every time printed
next to its roofline floor and the base GEMM of the same module."""
