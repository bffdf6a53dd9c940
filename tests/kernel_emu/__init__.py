"""Host (g++) emulation of ds_fp4's CUDA kernels for CPU-only tests; see loader.py."""
