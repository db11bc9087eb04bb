"""`python -m bench.gmm`: the grouped-matmul benchmark (`bench/kernel_runs/gmm.py`)."""

from bench.kernel_runs.gmm import main

if __name__ == "__main__":
  main()
