"""GPU runs: the grouped-matmul and layer rows on one GPU, and their summary (bench/gpu_h100.sh runs them)."""
