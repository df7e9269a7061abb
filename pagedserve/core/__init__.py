"""The engine core's decision layer: requests, KV blocks and the scheduler. Pure Python, no tensors."""
