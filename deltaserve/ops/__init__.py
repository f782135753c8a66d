"""Compute ops, one folder per op: reference.py (plain torch, the CPU oracle) and, later, GPU kernels behind
the same signatures."""
