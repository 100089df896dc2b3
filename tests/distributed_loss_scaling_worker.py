"""One process of the two-process ``jax.distributed`` test of loss scaling.

``tests/test_grad_reduction.py::test_two_process_loss_scaling_run`` starts two
of these, as users on two hosts would::

  python tests/distributed_loss_scaling_worker.py PROCESS_ID PORT OUT.npz

Each process gets 2 simulated CPU devices and gloo CPU collectives; together
they form one global mesh of 4 devices. Each process puts the same params and
a fresh ``loss_scaling(adam)`` state on the global mesh with
``jax.device_put(..., replicated)`` (which compares the values of every
process: a NaN in a fresh state made that fail, NaN != NaN), then trains a
float16-compute step under ``jax.jit`` with the batch sharded over the mesh.
At step ``BAD_STEP`` one example of the global batch is inf; only the process
whose devices hold that row sees it. Both must skip that step, back off the
scale and end with identical params and states, which each process writes to
``OUT.npz`` for the test to compare.

Exit status 77 means gloo CPU collectives are not available in this jaxlib
(the test then skips); any other non-zero status is a failure.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
  # Before jax initialises its backend: 2 local CPU devices per process.
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jmp_lite  # noqa: E402

NUM_PROCESSES = 2
GLOBAL_DEVICES = 4
GLOO_UNAVAILABLE = 77
STEPS = 5
BAD_STEP = 2
BAD_ROW = 21  # of 32: on the last device of the mesh (the second process)
BATCH = 32
SIZES = (8, 16, 4)


def init_params():
  """Float32 MLP params, the same in every process (numpy, seeded)."""
  rng = np.random.default_rng(0)
  return [
      (rng.normal(size=(a, b)).astype(np.float32) / np.float32(np.sqrt(a)),
       np.zeros(b, np.float32))
      for a, b in zip(SIZES[:-1], SIZES[1:])
  ]


def batches():
  """``STEPS`` global batches (numpy); step ``BAD_STEP`` has one inf."""
  rng = np.random.default_rng(1)
  out = []
  for i in range(STEPS):
    x = rng.normal(size=(BATCH, SIZES[0])).astype(np.float32)
    if i == BAD_STEP:
      x[BAD_ROW, 3] = np.inf
    out.append({"x": x,
                "y": rng.integers(0, SIZES[-1], size=BATCH).astype(np.int32)})
  return out


def make_optimizer():
  return jmp_lite.loss_scaling(
      optax.adam(1e-2), jmp_lite.DynamicLossScale(2.0**10, period=2))


def step(opt, params, opt_state, batch):
  """A data-parallel train step: float16 compute, the documented loop."""
  apply = jmp_lite.with_policy(
      lambda ps, x: _mlp(ps, x), jmp_lite.get_policy("p=f32,c=f16,o=f32"))

  def loss_fn(ps):
    logits = apply(ps, batch["x"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]))

  loss, grads = jmp_lite.scaled_value_and_grad(loss_fn, opt_state)(params)
  updates, opt_state = opt.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def _mlp(params, x):
  for i, (w, b) in enumerate(params):
    x = x @ w + b
    if i < len(params) - 1:
      x = jax.nn.relu(x)
  return x


def _global(mesh: Mesh, spec: P, value: np.ndarray) -> jax.Array:
  """A global array from the full value every process holds: each process
  supplies only the rows its devices own."""
  return jax.make_array_from_callback(
      value.shape, NamedSharding(mesh, spec), lambda index: value[index])


def _local(x: jax.Array) -> np.ndarray:
  return np.asarray(x.addressable_data(0))


def train(mesh: Mesh) -> dict[str, np.ndarray]:
  """Trains on ``mesh``; returns every leaf of the final params and state,
  the scale and skipped steps after each step, and whether this process's
  shards of the bad batch held the inf."""
  replicated = NamedSharding(mesh, P())
  opt = make_optimizer()
  params = init_params()
  # device_put onto a global mesh checks the values agree on every process.
  params = jax.device_put(params, replicated)
  opt_state = jax.device_put(opt.init(init_params()), replicated)
  compiled = jax.jit(lambda p, s, b: step(opt, p, s, b))
  scales, skipped, saw_inf = [], [], False
  for i, batch in enumerate(batches()):
    put = {k: _global(mesh, P("data"), v) for k, v in batch.items()}
    if i == BAD_STEP:
      saw_inf = any(not np.all(np.isfinite(np.asarray(s.data)))
                    for s in put["x"].addressable_shards)
    params, opt_state, _ = compiled(params, opt_state, put)
    scales.append(float(_local(opt_state.loss_scale.loss_scale)))
    skipped.append(int(_local(opt_state.skipped_steps)))
  leaves = [_local(x) for x in jax.tree.leaves((params, opt_state))]
  return {"scales": np.asarray(scales), "skipped": np.asarray(skipped),
          "saw_inf": np.asarray(saw_inf),
          **{f"leaf_{i}": x for i, x in enumerate(leaves)}}


def main(argv: list[str]) -> int:
  process_id, port, out_path = int(argv[1]), argv[2], argv[3]
  try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except Exception as err:  # pylint: disable=broad-except
    print(f"gloo CPU collectives are not available in jaxlib "
          f"{jax.__version__}: {err}", flush=True)
    return GLOO_UNAVAILABLE
  jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{port}", num_processes=NUM_PROCESSES,
      process_id=process_id)
  try:
    assert jax.process_count() == NUM_PROCESSES, jax.process_count()
    assert jax.device_count() == GLOBAL_DEVICES, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    with jax.numpy_dtype_promotion("standard"):  # optax's adam
      out = train(mesh)
    np.savez(out_path, **out)
    print(f"[process {process_id}] scales {out['scales']} skipped "
          f"{out['skipped']} saw the inf: {bool(out['saw_inf'])}", flush=True)
  finally:
    jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
