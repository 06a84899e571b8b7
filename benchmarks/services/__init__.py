"""Real processes over gRPC and HTTP: `ferry up` under load and under faults, a router against a synthetic
scheduler, what the service split and Python gRPC cost."""
