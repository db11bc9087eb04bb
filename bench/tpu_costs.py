"""`python -m bench.tpu_costs`: the HBM bytes XLA's TPU cost model charges the layer's building blocks (`bench/reading/tpu_costs.py`)."""

import os

from bench.reading.tpu_costs import main

if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  main()
