"""`python -m bench.maxtext_peer`: MaxText's RoutedMoE compiled beside the layer (`bench/peers/maxtext_peer.py`)."""

import sys

from bench.peers.maxtext_peer import main

if __name__ == "__main__":
  sys.exit(main())
