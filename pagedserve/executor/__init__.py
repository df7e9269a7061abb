"""Executes the scheduler's decisions: tensors, the model forward pass and sampling."""
