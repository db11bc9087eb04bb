"""The replicas' gradient sum, compiled for TPU: what it stores.

`parallel.tie_replicas` sums each expert's replica gradients in float32 and rounds once.
Compiled for TPU v5e 2x4 (libtpu; nothing runs), each slot that takes a sum is updated in
place, its received rows added in one pass: no float32 copy of a slot's gradient, its own
or a received one, is ever stored. (Widening all slots first and adding each received row
into its leader would store one a matrix, and read and write a whole float32 slot per
received gradient.)
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import moe_shard as ms
from moe_shard.parallel import replicas

pytest.importorskip("libtpu")

E, N, D, F = 64, 8, 256, 512
# Device d holds experts 8d..8d+7 and one more slot: expert 0 has six replicas, expert 1
# three, expert 9 two.
NINTH = [9, 0, 0, 0, 0, 1, 1, 0]


def test_the_replica_gradient_sum_stores_no_float32_slots():
  from bench.reading import hlo, tpu

  mesh = Mesh(np.array(tpu.devices("v5e:2x4")), (ms.EXPERT,))
  phy2log = np.concatenate([np.r_[np.arange(8 * d, 8 * d + 8), NINTH[d]] for d in range(N)])
  placement = ms.placement.Placement.from_phy2log(phy2log, E)
  J = len(phy2log) // N
  assert replicas.tie_bounds(placement, N)[0] >= 5  # one device receives five gradients
  shapes = {"w1": (N * J, D, F), "w2": (N * J, F, D)}
  specs = {k: P(ms.EXPERT) for k in shapes}

  def loss(ffn, cot):
    tied = replicas.tie_replicas(ffn, placement, mesh=mesh, expert_axis=ms.EXPERT, specs=specs)
    return sum(jnp.vdot(tied[k].astype(jnp.float32), cot[k].astype(jnp.float32)) for k in tied)

  sharding = NamedSharding(mesh, P(ms.EXPERT))
  args = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for k, s in shapes.items()}
  text = jax.jit(jax.grad(loss)).lower(args, args).compile().as_text()
  mod = hlo.parse_hlo(text)
  outputs = [i.type for i in mod.comps[mod.entry]]  # the entry's, not those inside fusions
  assert any(o.startswith(f"bf16[{J},{D},{F}]") for o in outputs)  # the slots' gradients
  # Neither the slots' gradients nor a received one, in float32 (tuples included).
  wide = [o for o in outputs if re.search(rf"f32\[(\d+,)?({D},{F}|{F},{D})\]", o)]
  assert not wide, f"float32 copies of slot gradients stored: {wide}"
