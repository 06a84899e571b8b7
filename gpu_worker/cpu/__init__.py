"""What the worker does only on a CPU: its features, its heap, packed and quantized linears."""
