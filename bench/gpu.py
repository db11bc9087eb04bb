"""`python -m bench.gpu`: the grouped-matmul and layer rows on one GPU (`bench/gpu_runs/gpu.py`)."""

from bench.gpu_runs.gpu import main

if __name__ == "__main__":
  main()
