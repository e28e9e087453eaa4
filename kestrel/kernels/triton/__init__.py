"""Triton kernels (each module holds its kernels, their launch wrappers and the torch reference)."""
