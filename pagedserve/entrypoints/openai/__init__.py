"""The OpenAI-compatible HTTP server (`pagedserve serve`)."""
