"""One process of the two-process ``jax.distributed`` test of the gradient reduction.

``tests/test_grad_reduction.py::test_two_process_distributed_run`` starts two
of these, as users on two hosts would::

  python tests/distributed_worker.py PROCESS_ID PORT OUT.npz

Each process gets 2 simulated CPU devices and gloo CPU collectives; together
they form one global mesh of 4 devices. Each builds the same data-parallel,
loss-scaled, float16-compute train step with
``jmp_lite.pmean_value_and_grad(..., num_groups=...)`` (one group per device), checks that every
weight-gradient all-reduce of the compiled HLO is float32 (and that the plain
step's are float16), trains a few steps and writes its copy of the final
params to ``OUT.npz``. Then the same MLP with its weights sharded over the
devices (FSDP) under a float8 policy whose weights are all-gathered as
float8 bits (``m=fp8(fsdp_axis=data)``, issue 39): every weight all-gather
of its compiled HLO is ``u8``; it trains and saves its params too. The test compares the two processes' params with each
other and with a single-process run of :func:`train` on 4 local devices.

Exit status 77 means gloo CPU collectives are not available in this jaxlib
(the test then skips); any other non-zero status is a failure.
"""

from __future__ import annotations

import os
import re
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
STEPS = 3
SIZES = (32, 64, 64, 8)
BATCH = 32
POLICY = "p=f32,c=f16,o=f32"


def _mlp(params, x):
  for i, (w, b) in enumerate(params):
    x = x @ w + b
    if i < len(params) - 1:
      x = jax.nn.relu(x)
  return x


def init_params(sizes=SIZES):
  """Float32 MLP params, the same in every process (numpy, seeded)."""
  rng = np.random.default_rng(0)
  return [
      (rng.normal(size=(a, b)).astype(np.float32) / np.float32(np.sqrt(a)),
       np.zeros(b, np.float32))
      for a, b in zip(sizes[:-1], sizes[1:])
  ]


def batches():
  """``STEPS`` global batches (numpy); each process feeds its own rows."""
  rng = np.random.default_rng(1)
  return [
      {"x": rng.normal(size=(BATCH, SIZES[0])).astype(np.float32),
       "y": rng.integers(0, SIZES[-1], size=BATCH).astype(np.int32)}
      for _ in range(STEPS)
  ]


def make_step(num_groups: int | None):
  """The train step; ``num_groups=None`` is the plain (ungrouped) one."""
  apply = jmp_lite.with_policy(_mlp, jmp_lite.get_policy(POLICY))
  opt = jmp_lite.loss_scaling(optax.sgd(0.05, momentum=0.9),
                              jmp_lite.DynamicLossScale(2.0**10))

  def loss_fn(params, batch):
    logits = apply(params, batch["x"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]))

  def step(params, opt_state, batch):
    grad_fn = jmp_lite.scaled_value_and_grad(loss_fn, opt_state)
    if num_groups is not None:
      grad_fn = jmp_lite.pmean_value_and_grad(grad_fn, num_groups=num_groups)
    loss, grads = grad_fn(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return opt, step


def all_reduce_types(hlo_text: str) -> list[str]:
  """``dtype[shape]`` of every array an all-reduce of the HLO reduces."""
  types = []
  for line in hlo_text.splitlines():
    if re.search(r"\ball-reduce(-start)?\(", line):
      result = line.split("=", 1)[1].split("all-reduce", 1)[0]
      types += re.findall(r"\b([a-z]+\d*\[[\d,]*\])", result)
  return types


def _global(mesh: Mesh, spec: P, value: np.ndarray) -> jax.Array:
  """A global array from the full value every process holds."""
  return jax.make_array_from_callback(
      value.shape, NamedSharding(mesh, spec), lambda index: value[index])


def train(mesh: Mesh) -> dict[str, object]:
  """Trains the grouped step on ``mesh`` (batch sharded, params replicated).

  Returns:
    ``{"params": [numpy leaves], "losses": [...], "grouped": all-reduce
    types of the grouped step, "plain": those of the plain step}``.
  """
  replicated = NamedSharding(mesh, P())
  params = jax.tree_util.tree_map(lambda v: _global(mesh, P(), v), init_params())
  data = batches()
  put = lambda b: {k: _global(mesh, P("data"), v) for k, v in b.items()}  # noqa: E731
  out = {}
  for name, groups in (("plain", None), ("grouped", GLOBAL_DEVICES)):
    opt, step = make_step(groups)
    opt_state = jax.jit(opt.init, out_shardings=replicated)(params)
    compiled = jax.jit(step).lower(params, opt_state, put(data[0])).compile()
    out[name] = all_reduce_types(compiled.as_text())
    if name == "grouped":
      losses = []
      p = params
      for batch in data:
        p, opt_state, loss = compiled(p, opt_state, put(batch))
        losses.append(float(np.asarray(loss.addressable_data(0))))
      out["params"] = [np.asarray(x.addressable_data(0))
                       for x in jax.tree_util.tree_leaves(p)]
      out["losses"] = losses
  return out


FSDP_POLICY = "p=f32,c=bf16,o=f32,m=fp8(fsdp_axis=data;include_output_head=true)"
#: The FSDP MLP: every matmul in float8 (widths multiples of 16, the head
#: included), so that every weight gather is a float8 one.
FSDP_SIZES = (32, 64, 64, 16)


def all_gather_types(hlo_text: str) -> list[str]:
  """``dtype[shape]`` of every array an all-gather of the HLO gathers."""
  types = []
  for line in hlo_text.splitlines():
    if re.search(r"\ball-gather(-start)?\(", line):
      result = line.split("=", 1)[1].split("all-gather", 1)[0]
      types += re.findall(r"\b([a-z]+\d*\[[\d,]*\])", result)
  return types


def train_fsdp(mesh: Mesh) -> dict[str, object]:
  """Trains the float8 FSDP step on ``mesh``: the weights (and the batch)
  sharded over ``data``, the float8 weights all-gathered as their bits.

  Returns:
    ``{"params": [numpy leaves], "losses": [...], "gathers": all-gather
    types}``.
  """
  apply = jmp_lite.with_policy(_mlp, jmp_lite.get_policy(FSDP_POLICY))
  opt = optax.sgd(0.05)   # no state: nothing else to gather

  def loss_fn(params, batch):
    logits = apply(params, batch["x"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]))

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  shard = lambda v: _global(mesh, P("data") if v.ndim == 2 else P(), v)  # noqa: E731
  params = jax.tree_util.tree_map(shard, init_params(FSDP_SIZES))
  data = batches()
  put = lambda b: {k: _global(mesh, P("data"), v) for k, v in b.items()}  # noqa: E731
  with jax.set_mesh(mesh):
    opt_state = jax.jit(opt.init)(params)
    shardings = lambda t: jax.tree_util.tree_map(lambda x: x.sharding, t)  # noqa: E731
    compiled = jax.jit(step, out_shardings=(
        shardings(params), shardings(opt_state), NamedSharding(mesh, P()))
    ).lower(params, opt_state, put(data[0])).compile()
    losses = []
    for batch in data:
      params, opt_state, loss = compiled(params, opt_state, put(batch))
      losses.append(float(np.asarray(loss.addressable_data(0))))
  full = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))(params)
  return {"params": [np.asarray(x.addressable_data(0))
                     for x in jax.tree_util.tree_leaves(full)],
          "losses": losses, "gathers": all_gather_types(compiled.as_text())}


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
    with jax.numpy_dtype_promotion("strict"):
      out = train(mesh)
    weight = lambda types: [t for t in types if not t.endswith("[]")]  # noqa: E731
    print(f"[process {process_id}] plain all-reduces: {out['plain']}", flush=True)
    print(f"[process {process_id}] grouped all-reduces: {out['grouped']}", flush=True)
    assert weight(out["grouped"]), out["grouped"]
    assert all(t.startswith("f32[") for t in weight(out["grouped"])), out["grouped"]
    assert any(t.startswith("f16[") for t in weight(out["plain"])), out["plain"]
    with jax.numpy_dtype_promotion("standard"):   # optax's sgd
      fsdp = train_fsdp(mesh)
    print(f"[process {process_id}] fp8 FSDP all-gathers: {fsdp['gathers']}",
          flush=True)
    np.savez(out_path, losses=np.asarray(out["losses"]),
             grouped=np.asarray(out["grouped"]), plain=np.asarray(out["plain"]),
             fsdp_losses=np.asarray(fsdp["losses"]),
             fsdp_gathers=np.asarray(fsdp["gathers"]),
             **{f"param_{i}": x for i, x in enumerate(out["params"])},
             **{f"fsdp_param_{i}": x for i, x in enumerate(fsdp["params"])})
    print(f"[process {process_id}] losses {out['losses']}", flush=True)
  finally:
    jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
