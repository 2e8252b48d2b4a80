"""Tensor code of the model: paged attention (attention.py, with the CPU decode kernel paged_decode.c
built by cpu_kernels.py), RoPE (rotary.py), RMSNorm (norm.py), the linears' oneDNN-packed backend
(linear.py) and the sampler (sampler.py: values in, values out; no scheduling types)."""
