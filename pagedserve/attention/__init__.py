"""Paged attention: metadata built once per step and the torch reference implementation."""
