"""One operation alone, on made-up tensors or rows: the paged decode kernels (Triton, C++ CPU), the grammar
engines' compile and bitmask times."""
