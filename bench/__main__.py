"""`python -m bench`: see `bench/command/cli.py`."""

import sys

from bench.command.cli import main

sys.exit(main())
