"""Quantization: the 8-bit KV cache (kv_cache.py). Its one hook into the core is the cache element dtype: the
model runner allocates int8 / float8 cache tensors with scale tensors beside them, and the attention kernels
read them in place."""
