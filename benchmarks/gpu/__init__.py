"""The GPU check (scripts/gpu_check.sh): steps from every room on one NVIDIA GPU, each a process of its own."""
