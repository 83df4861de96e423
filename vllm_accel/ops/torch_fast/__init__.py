"""Provider ``torch_fast``: batched pure-torch kernels (whole-page gathers, batched
matmuls) -- what a card runs where neither its vendor nor Triton has a kernel.
Its weight-only GEMMs on torch's fused CPU kernels are in ``wint_gemm.py``."""
