"""Reading checkpoints: Hugging Face folders (safetensors) and GGUF files."""
