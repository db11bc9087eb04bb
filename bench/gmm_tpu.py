"""`python -m bench.gmm_tpu`: the grouped matmuls compiled for TPU (`bench/kernel_runs/gmm_tpu.py`)."""

from bench.kernel_runs.gmm_tpu import main

if __name__ == "__main__":
  main()
