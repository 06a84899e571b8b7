"""Where the weights come from: a local Hugging Face directory or the default model's GGUF file, read into
Ferry's layers."""
