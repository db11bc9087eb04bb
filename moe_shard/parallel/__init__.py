"""Expert parallelism with `jax.shard_map`: the only package that issues collectives.

Tokens are split over every mesh axis; expert parameters over the expert axis only
(replicated over the others, e.g. "data"). Each group of devices along the expert axis
serves its own tokens with the E experts split L = E / N per device.

  * `moe_all_gather`: all_gather tokens and routing along the expert axis, each device runs
    its L experts on the items routed to them, a reduce-scatter returns the outputs.
  * `moe_all_to_all`: each device sorts its items by destination device and sends them in
    rounds of fixed-size `lax.all_to_all`s; dropless, with the number of rounds set on device
    by the busiest (source, destination) pair.
  * `moe_ragged_all_to_all`: `lax.ragged_all_to_all` sends each (source, destination, expert)
    queue exactly (an emulation from padded `all_to_all`s on CPU); rounds only when a
    receive buffer overflows.

With `expert_tensor_axis` each expert's hidden dimension F is also split over that axis
(the rows a device computes are gathered over it and the partial outputs reduce-scattered),
and with `expert_fsdp_axis` each weight matrix's last dimension is stored split over that axis
(gathered once per call); `shared_mlp` runs the shared experts the same way, as a dense
tensor-parallel MLP. `tie_replicas` gives the replicas of slot-major expert weights their
expert's whole gradient (`replicas.py`, with the fetch of a placement's slots).

Modules: `common.py` (the layout of a call, its input checks and placement, and the
weight-splitting steps every dispatch shares), `all_gather.py`, `all_to_all.py`,
`ragged.py` (one dispatch each; the ragged one's rounds in `ragged_rounds.py`), `ragged_exchange.py` (the ragged dispatch's transport:
the native `lax.ragged_all_to_all`, or its emulation), `dense.py` (the shared experts).
"""

from moe_shard.parallel.all_gather import moe_all_gather
from moe_shard.parallel.all_to_all import OVERFLOW_SCOPE, moe_all_to_all
from moe_shard.parallel.dense import shared_mlp
from moe_shard.parallel.ragged import moe_ragged_all_to_all
from moe_shard.parallel.ragged_exchange import RAGGED_PLATFORMS, ragged_all_to_all_emulated
from moe_shard.parallel.ragged_rounds import RAGGED_LAST_SCOPE, RAGGED_SCOPE
from moe_shard.parallel.replicas import tie_replicas

__all__ = [
  "OVERFLOW_SCOPE",
  "RAGGED_LAST_SCOPE",
  "RAGGED_PLATFORMS",
  "RAGGED_SCOPE",
  "moe_all_gather",
  "moe_all_to_all",
  "moe_ragged_all_to_all",
  "ragged_all_to_all_emulated",
  "shared_mlp",
  "tie_replicas",
]
