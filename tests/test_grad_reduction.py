"""Cross-device gradient reduction in float32: the HLO, the numbers, the errors.

conftest.py gives 8 simulated CPU devices. The dtype of each all-reduce is
read from the HLO:

* ``jax.jit`` + sharding: the SPMD partitioner inserts the all-reduces, so
  they are read from the HLO right after partitioning (dumped by XLA), before
  backend passes: XLA:CPU's ``all-reduce-promotion`` rewrites bfloat16
  all-reduces to float32 later (CPU cannot reduce in bfloat16), which GPU
  backends do not. float16 all-reduces survive to the compiled HLO on CPU, so
  those are checked there too.
* ``pmap``/``shard_map``: the collectives are in the program JAX hands to XLA
  (``lowered.as_text(dialect="hlo")``).

Weight-gradient all-reduces are the non-scalar ones (the scalar one is the
loss).
"""

import glob
import os
import pathlib
import socket
import subprocess
import sys

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import distributed_loss_scaling_worker as ls_worker
import distributed_worker as worker
import jmp_lite
from jmp_lite._src import parallel  # The float32 pmean inside.
from helpers import default_run_keeps

N = 8
F16 = np.dtype(jnp.float16)
BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(jnp.float32)
TAG = {F16: "f16", BF16: "bf16", F32: "f32"}
REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

needs_devices = pytest.mark.skipif(
    jax.device_count() < N, reason=f"needs {N} devices (see conftest.py)")

try:
  shard_map = jax.shard_map
except AttributeError:  # jax < 0.7
  from jax.experimental.shard_map import shard_map  # pylint: disable=all


# ---------------------------------------------------------------------------
# A small MLP whose matmuls run in the compute dtype.
# ---------------------------------------------------------------------------

SIZES = (32, 64, 64, 8)
BATCH = 64


def _params(dtype=F32, sizes=SIZES):
  rng = np.random.default_rng(0)
  return [
      (jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), dtype),
       jnp.asarray(rng.normal(size=(b,)) * 0.1, dtype))
      for a, b in zip(sizes[:-1], sizes[1:])
  ]


def _batch(seed=1):
  rng = np.random.default_rng(seed)
  return {"x": jnp.asarray(rng.normal(size=(BATCH, SIZES[0])), F32),
          "y": jnp.asarray(rng.integers(0, SIZES[-1], BATCH), jnp.int32)}


def _loss_fn(compute):
  apply = jmp_lite.with_policy(worker._mlp,  # pylint: disable=protected-access
                               jmp_lite.Policy(F32, compute, F32))

  def loss_fn(params, batch):
    logits = apply(params, batch["x"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]))

  return loss_fn


def _mesh():
  return Mesh(np.array(jax.devices()[:N]), ("data",))


def _sharded(params, batch):
  mesh = _mesh()
  return (jax.device_put(params, NamedSharding(mesh, P())),
          jax.device_put(batch, NamedSharding(mesh, P("data"))))


# ---------------------------------------------------------------------------
# HLO inspection.
# ---------------------------------------------------------------------------


def _weight_types(types):
  """The all-reduced arrays that are not scalars (the loss is a scalar)."""
  return [t for t in types if not t.endswith("[]")]


def _partitioned_types(fn, args, tmp_path):
  """All-reduce types of ``jax.jit(fn)`` right after SPMD partitioning, and
  of the compiled HLO."""
  dump = tmp_path / "xla_dump"
  compiled = jax.jit(fn).lower(*args).compile(compiler_options={
      "xla_dump_to": str(dump),
      "xla_dump_hlo_pass_re": "spmd-partitioning",
  })
  files = glob.glob(str(dump / "*after_spmd-partitioning*"))
  assert len(files) == 1, sorted(os.listdir(dump))
  partitioned = pathlib.Path(files[0]).read_text()
  return (worker.all_reduce_types(partitioned),
          worker.all_reduce_types(compiled.as_text()))


def _assert_all(types, dtype):
  weights = _weight_types(types)
  assert weights, types
  assert all(t.startswith(TAG[dtype] + "[") for t in weights), types


# ---------------------------------------------------------------------------
# jax.jit + sharding.
# ---------------------------------------------------------------------------


@needs_devices
@pytest.mark.parametrize("compute", [F16, BF16], ids=lambda d: d.name)
def test_jit_plain_step_reduces_weight_grads_in_half(compute, tmp_path):
  """The problem: GSPMD all-reduces each weight gradient in the compute dtype."""
  grad_fn = jax.value_and_grad(_loss_fn(compute))
  partitioned, compiled = _partitioned_types(
      grad_fn, _sharded(_params(), _batch()), tmp_path)
  _assert_all(partitioned, compute)
  if compute == F16:  # XLA:CPU keeps float16 all-reduces.
    _assert_all(compiled, F16)


@needs_devices
@pytest.mark.parametrize("params_dtype", [F32, BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("compute", default_run_keeps([F16, BF16]), ids=lambda d: d.name)
def test_jit_grouped_step_reduces_weight_grads_in_f32(compute, params_dtype,
                                                      tmp_path):
  grad_fn = jmp_lite.pmean_value_and_grad(
      jax.value_and_grad(_loss_fn(compute)), num_groups=N)
  args = _sharded(_params(params_dtype), _batch())
  partitioned, compiled = _partitioned_types(grad_fn, args, tmp_path)
  _assert_all(partitioned, F32)
  _assert_all(compiled, F32)
  # One all-reduced array per param leaf (6), plus the loss.
  assert len(_weight_types(partitioned)) == 6, partitioned
  loss, grads = jax.jit(grad_fn)(*args)
  assert loss.dtype == F32
  assert {g.dtype for g in jax.tree_util.tree_leaves(grads)} == {F32}


def _max_rel_diff(a, b):
  """max |a - b| / max |b|, per leaf, on host copies."""
  return [float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
                / np.max(np.abs(np.asarray(y, np.float64))))
          for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))]


# Grouped vs ungrouped gradients: the same math, rounded differently. Each
# group's weight gradient is rounded to the compute dtype once (8 partial sums
# instead of 1), so they agree to a few units of its epsilon, relative to the
# largest element of each gradient: 2**-8 ~ 4 eps for float16, 2**-5 ~ 4 eps
# for bfloat16; float32 compute agrees to float32 rounding.
TOLERANCE = {F16: 2.0**-8, BF16: 2.0**-5, F32: 1e-5}


@needs_devices
@pytest.mark.parametrize("compute", [F16, BF16, F32], ids=lambda d: d.name)
def test_grouped_matches_ungrouped_gradient(compute):
  loss_fn = _loss_fn(compute)
  params, batch = _params(), _batch()
  device = jax.devices()[0]
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(
      *jax.device_put((params, batch), device))
  grouped = jmp_lite.pmean_value_and_grad(jax.value_and_grad(loss_fn), num_groups=N)
  loss, grads = jax.jit(grouped)(*_sharded(params, batch))
  np.testing.assert_allclose(loss, ref_loss, rtol=TOLERANCE[compute])
  assert max(_max_rel_diff(grads, ref_grads)) <= TOLERANCE[compute]


@pytest.mark.parametrize("jit", default_run_keeps([False, True], keep=1),
                         ids=["eager", "jit"])
def test_grouped_train_step_with_loss_scaling_and_aux(jit):
  """Composes with scaled_value_and_grad, has_aux and the optax wrapper."""
  loss_fn = _loss_fn(F16)

  def loss_with_aux(params, batch):
    loss = loss_fn(params, batch)
    return loss, {"group_loss": loss, "count": jnp.int32(batch["x"].shape[0])}

  opt = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(2.0**10))

  def step(params, opt_state, batch):
    grad_fn = jmp_lite.pmean_value_and_grad(
        jmp_lite.scaled_value_and_grad(loss_with_aux, opt_state, has_aux=True),
        num_groups=4, has_aux=True)
    (loss, aux), grads = grad_fn(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, aux, grads

  step_fn = jax.jit(step) if jit else step
  # Eagerly, every operation is dispatched on its own: one layer is enough.
  params, batch = _params(sizes=SIZES if jit else SIZES[:1] + SIZES[-1:]), _batch()
  opt_state = opt.init(params)
  new_params, opt_state, loss, aux, grads = step_fn(params, opt_state, batch)
  # The loss is unscaled and the mean of the group losses.
  assert loss.dtype == F32 and loss.shape == ()
  assert aux["group_loss"].shape == (4,) and aux["count"].shape == (4,)
  np.testing.assert_array_equal(aux["count"], np.full(4, BATCH // 4))
  np.testing.assert_allclose(loss, np.mean(aux["group_loss"]), rtol=1e-6)
  np.testing.assert_allclose(loss, loss_fn(params, batch), rtol=2.0**-9)
  # Still scaled, as loss_scaling expects; float32.
  _, plain = jax.value_and_grad(lambda p: 2.0**10 * loss_fn(p, batch))(params)
  assert max(_max_rel_diff(grads, plain)) <= TOLERANCE[F16]
  assert bool(opt_state.last_finite)
  assert jax.tree_util.tree_map(lambda x: x.dtype, new_params) == \
      jax.tree_util.tree_map(lambda x: x.dtype, params)
  if jit:
    step_fn(new_params, opt_state, _batch(seed=2))
    assert step_fn._cache_size() == 1  # pylint: disable=protected-access


def test_grouped_batch_arguments():
  """Several batch arguments, scalar and non-array leaves, keyword arguments."""

  seen = []

  def loss_fn(w, x, extra, *, scale):
    seen.append((x.shape, extra["y"].shape, extra["t"].shape, extra["name"]))
    return scale * jnp.mean((x @ w) * extra["y"][:, None] * extra["t"])

  vg = jax.value_and_grad(loss_fn)
  w = jnp.ones((3, 2))
  x = jnp.arange(24.0).reshape(8, 3)
  extra = {"y": jnp.arange(8.0), "t": jnp.float32(0.5), "name": "abc"}
  grouped = jmp_lite.pmean_value_and_grad(vg, num_groups=4, batch_argnums=(1, 2))
  loss, grads = grouped(w, x, extra, scale=2.0)
  assert seen == [((2, 3), (2,), (), "abc")]  # one traced group
  ref_loss, ref_grads = vg(w, x, extra, scale=2.0)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  np.testing.assert_allclose(grads, ref_grads, rtol=1e-6)


def test_grouped_half_params_return_f32_grads():
  loss_fn = _loss_fn(BF16)
  params = _params(BF16)
  loss, grads = jax.jit(jmp_lite.pmean_value_and_grad(
      jax.value_and_grad(loss_fn), num_groups=2))(params, _batch())
  assert loss.dtype == F32
  assert {g.dtype for g in jax.tree_util.tree_leaves(grads)} == {F32}


@needs_devices
def test_grouped_under_autocast(tmp_path):
  def f32_loss(params, batch):
    logits = worker._mlp(params, batch["x"])  # pylint: disable=protected-access
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]))

  loss16 = jmp_lite.autocast(f32_loss, jnp.float16)
  args = _sharded(_params(), _batch())
  plain, _ = _partitioned_types(jax.value_and_grad(loss16), args, tmp_path / "a")
  # autocast adds the float32 biases in float32: only the kernels' are half.
  kernels = [t for t in plain if t.count(",") == 1]
  assert len(kernels) == 3 and all(t.startswith("f16[") for t in kernels), plain
  grouped, _ = _partitioned_types(
      jmp_lite.pmean_value_and_grad(jax.value_and_grad(loss16), num_groups=N), args,
      tmp_path / "b")
  _assert_all(grouped, F32)


@needs_devices
def test_grouped_linen_policy_batch_norm_is_per_group(tmp_path):
  """Flax policies: f32 reduction; BatchNorm statistics become per group."""
  import flax.linen as flax_linen  # pylint: disable=g-import-not-at-top
  import jmp_lite.linen as jlinen  # pylint: disable=g-import-not-at-top

  class Net(flax_linen.Module):

    @flax_linen.compact
    def __call__(self, x):
      x = flax_linen.Dense(16)(x)
      x = flax_linen.BatchNorm(use_running_average=False, momentum=0.0)(x)
      return flax_linen.Dense(4)(flax_linen.relu(x))

  model = jlinen.apply_policy(Net(), "mixed_float16")
  x = jnp.asarray(np.random.default_rng(0).normal(size=(BATCH, 8)), F32)
  variables = model.init(jax.random.PRNGKey(0), x[:2])

  def loss_fn(params, x):
    y, updates = model.apply({"params": params,
                              "batch_stats": variables["batch_stats"]},
                             x, mutable=["batch_stats"])
    return jnp.mean(jnp.square(y)), updates["batch_stats"]

  grad_fn = jmp_lite.pmean_value_and_grad(
      jax.value_and_grad(loss_fn, has_aux=True), num_groups=N, has_aux=True)
  mesh = _mesh()
  params = jax.device_put(variables["params"], NamedSharding(mesh, P()))
  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  plain, _ = _partitioned_types(jax.value_and_grad(loss_fn, has_aux=True),
                                (params, xs), tmp_path / "plain")
  kernels = [t for t in plain if t.count(",") == 1]  # BatchNorm's are f32
  assert len(kernels) == 2 and all(t.startswith("f16[") for t in kernels), plain
  partitioned, _ = _partitioned_types(grad_fn, (params, xs), tmp_path / "grouped")
  _assert_all(partitioned, F32)
  (_, stats), _ = jax.jit(grad_fn)(params, xs)
  # momentum=0: the running mean is the batch mean -- of each group.
  group_means = stats["BatchNorm_0"]["mean"]
  assert group_means.shape == (N, 16)
  dense = variables["params"]["Dense_0"]
  hidden = (x.astype(F16) @ dense["kernel"].astype(F16)
            + dense["bias"].astype(F16)).astype(F32).reshape(N, BATCH // N, 16)
  np.testing.assert_allclose(group_means, hidden.mean(1), atol=2e-3)


# ---------------------------------------------------------------------------
# pmap and shard_map.
# ---------------------------------------------------------------------------

KINDS = ["pmap", "shard_map", "shard_map_no_vma"]


def _mapped(kind, per_device):
  """``per_device(params, local_batch)`` mapped over 8 devices, jitted.

  Returns the function and a converter of the global batch to its input.
  """
  if kind == "pmap":
    fn = jax.pmap(per_device, axis_name="i", in_axes=(None, 0))
    to_input = lambda b: jax.tree_util.tree_map(  # noqa: E731
        lambda v: v.reshape((N, -1) + v.shape[1:]), b)
    return fn, to_input
  mesh = Mesh(np.array(jax.devices()[:N]), ("i",))
  fn = jax.jit(shard_map(per_device, mesh=mesh, in_specs=(P(), P("i")),
                         out_specs=P(), check_vma=kind == "shard_map"))
  return fn, lambda b: b


def _hlo_types(kind, fn, params, batch):
  return worker.all_reduce_types(fn.lower(params, batch).as_text(dialect="hlo"))


@needs_devices
@pytest.mark.parametrize("params_dtype", [F32, BF16], ids=lambda d: d.name)
@pytest.mark.parametrize("kind", KINDS)
def test_mapped_plain_pmean_reduces_in_grad_dtype_or_half(kind, params_dtype):
  """The problem: ``lax.pmean(grads)`` reduces in the gradients' dtype, and
  shard_map (check_vma) has JAX sum replicated params' grads in half."""
  loss_fn = _loss_fn(F16)

  def per_device(params, batch):
    return lax.pmean(jax.grad(loss_fn)(params, batch), "i")

  fn, to_input = _mapped(kind, per_device)
  types = _weight_types(_hlo_types(kind, fn, _params(params_dtype),
                                   to_input(_batch())))
  grad_tag = TAG[params_dtype] + "["
  if kind == "shard_map":
    # JAX's own psum, in the compute dtype, of the weights' half copies ...
    assert any(t.startswith("f16[") for t in types), types
  else:
    assert all(t.startswith(grad_tag) for t in types), types


@needs_devices
@pytest.mark.parametrize("params_dtype", default_run_keeps([F32, BF16], keep=1), ids=lambda d: d.name)
@pytest.mark.parametrize("kind", default_run_keeps(KINDS))
def test_pmean_value_and_grad_reduces_in_f32(kind, params_dtype):
  loss_fn = _loss_fn(F16)
  step = jmp_lite.pmean_value_and_grad(jax.value_and_grad(loss_fn), "i")
  fn, to_input = _mapped(kind, step)
  params, batch = _params(params_dtype), _batch()
  types = _hlo_types(kind, fn, params, to_input(batch))
  _assert_all(types, F32)
  assert len(_weight_types(types)) == 6, types

  loss, grads = fn(params, to_input(batch))
  if kind == "pmap":  # one (identical) copy per device
    for leaf in jax.tree_util.tree_leaves((loss, grads)):
      np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))
    loss, grads = jax.tree_util.tree_map(lambda v: v[0], (loss, grads))
  assert loss.dtype == F32
  assert {g.dtype for g in jax.tree_util.tree_leaves(grads)} == {F32}
  # The gradient of the mean loss over the whole batch (not 8x it), of the
  # same values held in float32 (so that the reference is not rounded to
  # bfloat16).
  ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(
      jmp_lite.cast_to_full(params), batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=2.0**-9)
  assert max(_max_rel_diff(grads, ref_grads)) <= TOLERANCE[F16]


@needs_devices
def test_pmean_value_and_grad_has_aux_and_argnums():
  loss_fn = _loss_fn(F16)

  def loss_aux(batch, params):
    loss = loss_fn(params, batch)
    return loss, loss

  step = jmp_lite.pmean_value_and_grad(
      jax.value_and_grad(loss_aux, argnums=1, has_aux=True), "i", argnums=1,
      has_aux=True)
  (loss, aux), grads = jax.pmap(step, axis_name="i", in_axes=(0, None))(
      jax.tree_util.tree_map(lambda v: v.reshape((N, -1) + v.shape[1:]), _batch()),
      _params())
  assert aux.shape == (N,)  # per device
  np.testing.assert_allclose(loss, np.full(N, np.mean(aux)), rtol=1e-6)
  assert {g.dtype for g in jax.tree_util.tree_leaves(grads)} == {F32}


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=lambda d: d.name)
def test_pmean_f32_reduces_in_f32(dtype):
  big = 49152.0  # 1.5 * 2**15, exact in every dtype; 8x it overflows float16.
  tree = {"g": jnp.full((N, 2), big, dtype), "step": jnp.ones(N, jnp.int32)}
  pmean = jax.vmap(lambda t: parallel._pmean_f32(t, "i"), axis_name="i")
  out = pmean(tree)
  assert out["g"].dtype == F32 and out["step"].dtype == np.int32
  np.testing.assert_array_equal(out["g"], np.full((N, 2), big, F32))
  np.testing.assert_array_equal(out["step"], np.ones(N, np.int32))
  if dtype == F16:  # lax.pmean's float16 sum overflows.
    plain = jax.vmap(lambda t: lax.pmean(t, "i"), axis_name="i")(tree["g"])
    assert not np.isfinite(np.asarray(plain, np.float32)).any()


@needs_devices
def test_pmean_f32_collective_is_f32_under_pmap():
  fn = jax.pmap(lambda g: parallel._pmean_f32(g, "i"), axis_name="i")
  g = jnp.ones((N, 4, 4), BF16)
  _assert_all(worker.all_reduce_types(fn.lower(g).as_text(dialect="hlo")), F32)


# ---------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------


def _vg():
  return jax.value_and_grad(lambda w, x: jnp.mean(x @ w))


def test_num_groups_must_divide_the_batch():
  grad_fn = jmp_lite.pmean_value_and_grad(_vg(), num_groups=3)
  with pytest.raises(ValueError, match=r"num_groups=3 .* leaf \[1\]\['x'\], of "
                     r"size 8 \(shape \(8, 2\)\).* e\.g\. 9"):
    grad_fn(jnp.ones(2), {"x": jnp.ones((8, 2))})


@pytest.mark.parametrize("bad,error", [
    (0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError),
    ("8", TypeError),
])
def test_num_groups_must_be_a_positive_int(bad, error):
  with pytest.raises(error, match="num_groups must be an int >= 1"):
    jmp_lite.pmean_value_and_grad(_vg(), num_groups=bad)


# -- one door: axis_name (pmap/shard_map) or num_groups (jit) --------------------


def test_num_groups_is_the_grouped_path_of_before():
  """pmean_value_and_grad(num_groups=) gives what grouped_value_and_grad
  gave (the deprecated spelling forwards to it), bit for bit."""
  vg = jax.value_and_grad(lambda w, x: jnp.mean(jnp.tanh(x @ w)))
  w = jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 3)), F32)
  new = jax.jit(jmp_lite.pmean_value_and_grad(vg, num_groups=4))(w, x)
  from jmp_lite._src import parallel  # pylint: disable=g-import-not-at-top
  old = jax.jit(parallel._grouped(  # pylint: disable=protected-access
      vg, 4, 1, False, "grouped_value_and_grad"))(w, x)
  with pytest.warns(DeprecationWarning, match="pmean_value_and_grad"):
    deprecated = jmp_lite.grouped_value_and_grad(vg, 4)
  for got in (old, jax.jit(deprecated)(w, x)):
    np.testing.assert_array_equal(new[0], got[0])
    np.testing.assert_array_equal(new[1], got[1])


@pytest.mark.parametrize("kwargs,got", [
    ({}, "got neither"),
    ({"axis_name": "i", "num_groups": 2}, "got both"),
], ids=["neither", "both"])
def test_exactly_one_of_axis_name_and_num_groups(kwargs, got):
  with pytest.raises(TypeError, match=f"exactly one of axis_name and "
                     f"num_groups, {got}.*axis_name='batch' inside jax.pmap "
                     "or jax.shard_map.*num_groups=N.*under jax.jit"):
    jmp_lite.pmean_value_and_grad(_vg(), **kwargs)
  with pytest.raises(TypeError, match="got neither"):
    jmp_lite.pmean_value_and_grad(_vg(), num_groups=None)


@pytest.mark.parametrize("wire", ["bfloat16", "e4m3"])
def test_a_narrow_wire_format_needs_axis_name(wire):
  with pytest.raises(ValueError, match=rf"wire_format='{wire}' needs "
                     "axis_name under jax.shard_map or jax.pmap.*XLA emits "
                     "the reduction itself"):
    jmp_lite.pmean_value_and_grad(_vg(), num_groups=2, wire_format=wire)
  with pytest.raises(ValueError, match="wire_format"):   # unknown: as before
    jmp_lite.pmean_value_and_grad(_vg(), num_groups=2, wire_format="f8")
  jmp_lite.pmean_value_and_grad(_vg(), num_groups=2, wire_format="float32")


def test_the_options_of_the_other_mode_are_refused():
  with pytest.raises(TypeError, match=r"argnums=1 applies with axis_name"):
    jmp_lite.pmean_value_and_grad(_vg(), num_groups=2, argnums=1)
  with pytest.raises(TypeError, match=r"batch_argnums=2 applies with "
                     "num_groups"):
    jmp_lite.pmean_value_and_grad(_vg(), "i", batch_argnums=2)


def test_batch_argnums_out_of_range():
  grad_fn = jmp_lite.pmean_value_and_grad(_vg(), num_groups=2, batch_argnums=2)
  with pytest.raises(ValueError, match=r"batch_argnums=2 .* 2 positional"
                     r" argument\(s\) \(valid indices: 0\.\.1\)"):
    grad_fn(jnp.ones(2), jnp.ones((4, 2)))


@pytest.mark.parametrize("bad,error", [
    (-1, ValueError), ((1, 1), ValueError), ((), ValueError), ("1", TypeError),
    (1.0, TypeError),
])
def test_batch_argnums_must_be_non_negative_ints(bad, error):
  with pytest.raises(error, match="batch_argnums"):
    jmp_lite.pmean_value_and_grad(_vg(), num_groups=2, batch_argnums=bad)


@pytest.mark.parametrize("factory", [
    lambda f: jmp_lite.pmean_value_and_grad(f, num_groups=2),
    lambda f: jmp_lite.pmean_value_and_grad(f, "i"),
], ids=["grouped", "pmean"])
def test_non_callable_is_rejected(factory):
  with pytest.raises(TypeError, match="expects a value-and-grad function.*"
                     "jax.value_and_grad"):
    factory(jnp.ones(2))


def test_wrong_output_structure():
  loss_only = jmp_lite.pmean_value_and_grad(lambda w, x: jnp.mean(x @ w), num_groups=2)
  with pytest.raises(TypeError, match=r"must return \(loss, grads\)"):
    loss_only(jnp.ones(2), jnp.ones((4, 2)))
  no_aux = jmp_lite.pmean_value_and_grad(_vg(), num_groups=2, has_aux=True)
  with pytest.raises(TypeError, match=r"\(\(loss, aux\), grads\) with "
                     r"has_aux=True; got \(an array, grads\) with has_aux=True"):
    no_aux(jnp.ones(2), jnp.ones((4, 2)))
  with_aux = jax.value_and_grad(lambda w, x: (jnp.mean(x @ w), 0.0), has_aux=True)
  for wrapped in (jmp_lite.pmean_value_and_grad(with_aux, num_groups=2),
                  jmp_lite.pmean_value_and_grad(with_aux, "i")):
    with pytest.raises(TypeError, match="pass has_aux=True"):
      jax.vmap(wrapped, in_axes=(None, 0), axis_name="i")(
          jnp.ones(2), jnp.ones((2, 4, 2)))


def test_pmean_value_and_grad_bad_input():
  with pytest.raises(TypeError, match="axis_name"):
    jmp_lite.pmean_value_and_grad(_vg(), 1)
  step = jmp_lite.pmean_value_and_grad(_vg(), "i", argnums=3)
  with pytest.raises(ValueError, match=r"argnums=3 .* 2 positional"):
    jax.vmap(step, in_axes=(None, 0), axis_name="i")(jnp.ones(2), jnp.ones((4, 2)))
  with pytest.raises(ValueError, match="no such axis is bound"):
    jmp_lite.pmean_value_and_grad(_vg(), "i")(jnp.ones(2), jnp.ones((4, 2)))


@needs_devices
@pytest.mark.parametrize("where", ["jit", "pmap_other_axis",
                                   "vmap_other_axis"])
def test_pmean_value_and_grad_on_an_unbound_axis_is_a_value_error(where):
  """A NameError under jit and a bare AssertionError under pmap over another
  axis, before: the docstring promises a ValueError."""
  step = jmp_lite.pmean_value_and_grad(_vg(), "i")
  w, xs = jnp.ones(2), jnp.ones((2, 4, 2))
  run = {
      "jit": lambda: jax.jit(step)(w, xs[0]),
      "pmap_other_axis": lambda: jax.pmap(step, axis_name="j",
                                          in_axes=(None, 0))(w, xs),
      "vmap_other_axis": lambda: jax.vmap(step, axis_name="j",
                                          in_axes=(None, 0))(w, xs),
  }[where]
  with pytest.raises(ValueError, match=r"pmean_value_and_grad\(axis_name='i'\)"
                     r".*no such axis is bound"):
    run()


# ---------------------------------------------------------------------------
# Two processes, as on two hosts: jax.distributed with gloo CPU collectives.
# ---------------------------------------------------------------------------

# Runs of two worker programs: the slow stage's (pytest -m slow).


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_two_processes(module, tmp_path):
  """Runs ``module``'s worker as two ``jax.distributed`` processes; returns
  what each wrote (skips where gloo is unavailable)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  port = _free_port()
  outs = [tmp_path / f"process_{i}.npz" for i in range(module.NUM_PROCESSES)]
  procs = [
      subprocess.Popen(
          [sys.executable, str(pathlib.Path(module.__file__)), str(i),
           str(port), str(out)],
          cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT, text=True)
      for i, out in enumerate(outs)
  ]
  logs = []
  try:
    for proc in procs:
      logs.append(proc.communicate(timeout=180)[0])
  except subprocess.TimeoutExpired:
    for proc in procs:
      proc.kill()
    pytest.fail("the two jax.distributed processes did not finish in 180 s")
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  codes = [p.returncode for p in procs]
  if module.GLOO_UNAVAILABLE in codes:
    pytest.skip("gloo CPU collectives are unavailable in this jaxlib: "
                + logs[codes.index(module.GLOO_UNAVAILABLE)][-500:])
  assert codes == [0, 0], "\n\n".join(log[-3000:] for log in logs)
  return [np.load(out) for out in outs]


@pytest.mark.slow
@needs_devices
def test_two_process_distributed_run(tmp_path):
  """Each process: f32 weight-gradient all-reduces; both end with the params
  of a single-process run on 4 devices."""
  results = _run_two_processes(worker, tmp_path)
  for r in results:
    _assert_all(list(r["grouped"]), F32)
    _assert_all(list(r["plain"]), F16)
  params = [[r[f"param_{i}"] for i in range(6)] for r in results]
  for a, b in zip(*params):
    np.testing.assert_array_equal(a, b)  # the two processes agree exactly

  reference = worker.train(Mesh(np.array(jax.devices()[:worker.GLOBAL_DEVICES]),
                                ("data",)))
  _assert_all(reference["grouped"], F32)
  np.testing.assert_allclose(results[0]["losses"], reference["losses"], rtol=1e-6)
  for a, b in zip(params[0], reference["params"]):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

  # The float8 FSDP step (issue 39): every weight all-gather carries float8
  # bits (u8; the scales' gathers are u32 scalars' bits), both processes end
  # with equal params, those of a one-process run on 4 devices.
  for r in results:
    gathers = [t for t in r["fsdp_gathers"] if not t.endswith("[]")]
    assert gathers and all(t.startswith(("u8[", "u32[")) for t in gathers), \
        list(r["fsdp_gathers"])
    assert any(t.startswith("u8[") for t in gathers)
  fsdp = [[r[f"fsdp_param_{i}"] for i in range(6)] for r in results]
  for a, b in zip(*fsdp):
    np.testing.assert_array_equal(a, b)
  with jax.numpy_dtype_promotion("standard"):
    local = worker.train_fsdp(Mesh(np.array(
        jax.devices()[:worker.GLOBAL_DEVICES]), ("data",)))
  np.testing.assert_allclose(results[0]["fsdp_losses"], local["losses"],
                             rtol=1e-5)
  for a, b in zip(fsdp[0], local["params"]):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@needs_devices
def test_two_process_loss_scaling_run(tmp_path):
  """Two processes put a fresh loss_scaling state on a global mesh (no NaN in
  it, so the values agree), train under jit with the batch sharded, and one
  process alone sees an inf at BAD_STEP: both skip it, back off once, and end
  with identical params and states (bit for bit), those of a one-process run
  on 4 local devices (the same scales and skips)."""
  results = _run_two_processes(ls_worker, tmp_path)
  assert sorted(bool(r["saw_inf"]) for r in results) == [False, True]
  for r in results:
    skipped = list(r["skipped"])
    assert skipped[ls_worker.BAD_STEP - 1] == 0
    assert skipped[ls_worker.BAD_STEP:] == [1] * (
        ls_worker.STEPS - ls_worker.BAD_STEP)
    scales = list(r["scales"])
    assert scales[ls_worker.BAD_STEP] == scales[ls_worker.BAD_STEP - 1] / 2
  keys = sorted(k for k in results[0].files if k.startswith("leaf_"))
  assert keys and keys == sorted(
      k for k in results[1].files if k.startswith("leaf_"))
  for key in keys + ["scales", "skipped"]:
    assert results[0][key].tobytes() == results[1][key].tobytes(), key

  # The scale trajectory is exact; the values within float16's rounding:
  # the workers compile with XLA's default passes and this process with
  # conftest.py's cheap ones, so float16 matmuls round differently (1e-5
  # here), and Adam's normalised steps carry that through.
  mesh = Mesh(np.array(jax.devices()[:ls_worker.GLOBAL_DEVICES]), ("data",))
  with jax.numpy_dtype_promotion("standard"):
    reference = ls_worker.train(mesh)
  for key in ("scales", "skipped"):
    np.testing.assert_array_equal(results[0][key], reference[key])
  for key in keys:
    np.testing.assert_allclose(results[0][key], reference[key], rtol=2e-3,
                               atol=1e-4, err_msg=key)
