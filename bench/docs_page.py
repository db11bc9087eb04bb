"""`python -m bench.docs_page`: regenerates docs/benchmarks.md from bench/results/ (`bench/reports/docs_page.py`)."""

import sys

from bench.reports.docs_page import main

if __name__ == "__main__":
  sys.exit(main())
