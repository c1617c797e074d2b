"""Kernels: a torch reference for every op (the specification, used on CPU) and Triton kernels
for GPUs. Imports only torch (and triton, lazily, where a kernel needs it)."""
