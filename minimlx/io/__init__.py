"""Reading checkpoints: Hugging Face folders, config layouts, tensor names."""
