"""An unmodified Orbax multi-tier checkpointing job: ``save N`` or ``restore`` on one node.

Run as a subprocess (JAX's distributed runtime starts once per process). Prints one JSON
line: the steps it saw and, on restore, a digest of the restored values.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import flags
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from orbax.checkpoint.experimental.emergency import replicator_checkpoint_manager as rcm
from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import initialization


def state_at(step: int) -> dict:
    return {"w": jnp.arange(4096, dtype=jnp.float32) * step, "b": jnp.full((64,), step, dtype=jnp.int32)}


def main() -> None:
    flags.FLAGS(sys.argv[:1])  # Orbax reads absl flags, as under MaxText's app.run
    local, run_name, action = epath.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    initialization.initialize_multi_tier_checkpointing(
        local, backup_interval_steps=1, run_name=run_name, num_slices=1, jax_initialization_timeout_seconds=60
    )
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec())
    manager = rcm.ReplicatorCheckpointManager(local, global_mesh=mesh)
    out = {"steps": list(manager.all_steps()), "latest": manager.latest_step()}
    if action == "save":
        for step in range(1, int(sys.argv[4]) + 1):
            state = jax.tree.map(lambda a: jax.device_put(a, sharding), state_at(step))
            manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state)))
            manager.wait_until_finished()
    else:
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), state_at(0))
        restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=sharding), target)
        restored = manager.restore(
            None, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args))
        )
        expected = state_at(out["latest"])
        out["equal"] = all(np.array_equal(np.asarray(restored["state"][k]), np.asarray(expected[k])) for k in expected)
    manager.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
