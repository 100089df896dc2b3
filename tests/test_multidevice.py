"""Multi-device tests: finiteness agreed across replicas, and sharded training.

conftest.py gives 8 simulated CPU devices. Under ``pmap``/``shard_map`` each
device sees only its shard of the gradients, so without ``axis_name`` one
device with an inf would back off its loss scale and skip its step while the
others would not, and the replicas would drift apart. ``all_finite(...,
axis_name=...)`` and ``loss_scaling(..., axis_name=...)`` make them agree.
"""

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jmp_lite
from helpers import default_run_keeps

N = 8
BAD_DEVICE = 3

pytestmark = pytest.mark.skipif(
    jax.device_count() < N, reason=f"needs {N} devices (see conftest.py)"
)

try:
  shard_map = jax.shard_map
except AttributeError:  # jax < 0.7
  from jax.experimental.shard_map import shard_map  # pylint: disable=all

F16 = np.dtype(jnp.float16)
F32 = np.dtype(jnp.float32)


def _mesh(shape=(N,), names=("i",)):
  devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, names)


def _per_device(bad=None, dtype=F32, seed=0):
  """A (N, 3) array, one row per device; ``bad`` goes into BAD_DEVICE's row."""
  x = np.random.default_rng(seed).normal(size=(N, 3)).astype(dtype)
  if bad is not None:
    x[BAD_DEVICE, 1] = bad
  return jnp.asarray(x)


def _map(kind, fn, replicated_args, sharded_args):
  """Runs ``fn(*replicated, *sharded_rows)`` once per device.

  ``sharded_args`` have a leading axis of size N split over the devices;
  ``fn`` sees one row of each (without the leading axis). Every output gets a
  leading axis of size N, one entry per device.
  """
  n_rep = len(replicated_args)
  if kind == "pmap":
    mapped = jax.pmap(
        fn, axis_name="i",
        in_axes=(None,) * n_rep + (0,) * len(sharded_args),
    )
    return mapped(*replicated_args, *sharded_args)

  def per_shard(*args):
    rows = [jax.tree_util.tree_map(lambda x: x[0], a) for a in args[n_rep:]]
    out = fn(*args[:n_rep], *rows)
    return jax.tree_util.tree_map(lambda x: x[None], out)

  mapped = shard_map(
      per_shard, mesh=_mesh(),
      in_specs=(P(),) * n_rep + (P("i"),) * len(sharded_args),
      out_specs=P("i"),
  )
  return jax.jit(mapped)(*replicated_args, *sharded_args)


MAPS = ["pmap", "shard_map"]


# ---------------------------------------------------------------------------
# all_finite with axis_name.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", MAPS)
@pytest.mark.parametrize("bad", [np.inf, np.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("dtype", [F16, F32], ids=lambda d: d.name)
def test_all_finite_agrees_across_devices(kind, bad, dtype):
  def fn(row):
    tree = {"g": row, "step": jnp.int32(1), "h": jnp.ones(2, dtype)}
    return (jmp_lite.all_finite(tree, axis_name="i"),
            jmp_lite.all_finite(tree))

  agreed, local = _map(kind, fn, (), (_per_device(bad, dtype),))
  assert agreed.shape == (N,) and agreed.dtype == np.bool_
  np.testing.assert_array_equal(agreed, np.zeros(N, bool))
  # Locally only the bad device knows.
  np.testing.assert_array_equal(local, np.arange(N) != BAD_DEVICE)

  agreed, local = _map(kind, fn, (), (_per_device(None, dtype),))
  np.testing.assert_array_equal(agreed, np.ones(N, bool))
  np.testing.assert_array_equal(local, np.ones(N, bool))


def test_all_finite_over_several_mesh_axes():
  mesh = _mesh((2, 4), ("a", "b"))
  x = _per_device(np.inf).reshape(2, 4, 3)

  def fn(block):
    both = jmp_lite.all_finite(block, axis_name=("a", "b"))
    only_b = jmp_lite.all_finite(block, axis_name="b")
    return both[None, None], only_b[None, None]

  both, only_b = jax.jit(shard_map(
      fn, mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", "b")
  ))(x)
  np.testing.assert_array_equal(both, np.zeros((2, 4), bool))
  # BAD_DEVICE = 3 is in row 0 of the (2, 4) grid: only that row disagrees.
  np.testing.assert_array_equal(only_b, [[False] * 4, [True] * 4])


# ---------------------------------------------------------------------------
# The optax wrapper with axis_name.
# ---------------------------------------------------------------------------


def _params():
  return {"w": jnp.asarray(np.linspace(-1.0, 1.0, 3), F32)}


def _make_step(opt, mean):
  """One device's step; returns arrays only (params and state counters)."""

  def step(params, state, row):
    grads = {"w": row}
    if mean:
      grads = lax.pmean(grads, "i")
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    return (params["w"], state.loss_scale.loss_scale, state.skipped_steps,
            state.last_finite)

  return step


def _assert_same_on_every_device(x):
  x = np.asarray(x)
  for i in range(1, N):
    np.testing.assert_array_equal(x[i], x[0])


@pytest.mark.parametrize("kind", MAPS)
@pytest.mark.parametrize("mean", [False, True], ids=["no_mean", "pmean"])
def test_loss_scaling_with_axis_name_skips_everywhere(kind, mean):
  opt = jmp_lite.loss_scaling(
      optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0), axis_name="i"
  )
  params = _params()
  state = opt.init(params)
  grads = _per_device(np.inf, F16)  # the inf is on one device only

  new_w, scales, skipped, finite = _map(
      kind, _make_step(opt, mean), (params, state), (grads,))

  for x in (new_w, scales, skipped, finite):
    _assert_same_on_every_device(x)
  np.testing.assert_array_equal(scales, np.full(N, 4.0, F32))
  np.testing.assert_array_equal(skipped, np.ones(N, np.int32))
  np.testing.assert_array_equal(finite, np.zeros(N, bool))
  np.testing.assert_array_equal(new_w, np.tile(params["w"], (N, 1)))


@pytest.mark.parametrize("kind", MAPS)
def test_loss_scaling_with_axis_name_applies_finite_step_everywhere(kind):
  opt = jmp_lite.loss_scaling(
      optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0, period=1), axis_name="i"
  )
  params = _params()
  state = opt.init(params)
  grads = _per_device(None, F16)

  new_w, scales, skipped, finite = _map(
      kind, _make_step(opt, mean=True), (params, state), (grads,))

  for x in (new_w, scales, skipped, finite):
    _assert_same_on_every_device(x)
  np.testing.assert_array_equal(scales, np.full(N, 16.0, F32))
  np.testing.assert_array_equal(finite, np.ones(N, bool))
  expected = params["w"] - 0.1 * np.mean(np.asarray(grads, F32), axis=0) / 8.0
  np.testing.assert_allclose(new_w[0], expected, atol=1e-5)  # f16 pmean


@pytest.mark.parametrize("kind", MAPS)
def test_without_axis_name_replicas_disagree(kind):
  """Why ``axis_name`` exists: unsynchronised replicas drift apart."""
  opt = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0))
  params = _params()
  state = opt.init(params)
  grads = _per_device(np.inf, F32)

  new_w, scales, skipped, finite = _map(
      kind, _make_step(opt, mean=False), (params, state), (grads,))

  good = np.arange(N) != BAD_DEVICE
  np.testing.assert_array_equal(finite, good)
  np.testing.assert_array_equal(skipped, (~good).astype(np.int32))
  np.testing.assert_array_equal(scales, np.where(good, 8.0, 4.0))
  assert len({float(s) for s in np.asarray(scales)}) == 2
  # The bad replica kept its params, the others moved.
  np.testing.assert_array_equal(new_w[BAD_DEVICE], params["w"])
  assert not np.allclose(new_w[0], params["w"])


def test_pmap_train_step_returns_replicated_opt_state():
  """The usual pmap loop: the whole opt state goes in and out replicated."""
  opt = jmp_lite.loss_scaling(
      optax.sgd(0.1), jmp_lite.DynamicLossScale(8.0, min_loss_scale=2.0),
      axis_name="i",
  )
  params = _params()

  def step(params, state, row):
    grads = lax.pmean({"w": row}, "i")
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def replicate(tree):
    return jax.tree_util.tree_map(lambda x: jnp.stack([x] * N), tree)

  p_step = jax.pmap(step, axis_name="i")
  rep_params, rep_state = replicate(params), replicate(opt.init(params))
  rep_params, rep_state = p_step(rep_params, rep_state,
                                 _per_device(np.inf, F16))
  scale = rep_state.loss_scale
  assert isinstance(scale, jmp_lite.DynamicLossScale)
  assert scale.min_loss_scale == 2.0
  np.testing.assert_array_equal(scale.loss_scale, np.full(N, 4.0, F32))
  _assert_same_on_every_device(rep_params["w"])


# ---------------------------------------------------------------------------
# jax.jit with NamedSharding.
# ---------------------------------------------------------------------------


def _half_loss(params, batch):
  x, y = batch
  pred = x.astype(F16) @ params["w"].astype(F16) + params["b"].astype(F16)
  return jnp.mean(jnp.square(pred.astype(F32) - y))


def _sharded_setup():
  opt = jmp_lite.loss_scaling(
      optax.sgd(0.05, momentum=0.9),
      jmp_lite.DynamicLossScale(2.0**10, period=2),
  )

  @jax.jit
  def train_step(params, state, batch):
    loss_scale = jmp_lite.get_loss_scale(state)
    loss, grads = jmp_lite.scaled_value_and_grad(_half_loss, loss_scale)(
        params, batch)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(4, 2)), F32),
            "b": jnp.zeros(2, F32)}
  xs = rng.normal(size=(4, 2 * N, 4)).astype(np.float32)
  xs[1, 5, 2] = np.inf  # one example on one device, at step 1
  ys = rng.normal(size=(4, 2 * N, 2)).astype(np.float32)
  return opt, train_step, params, jnp.asarray(xs), jnp.asarray(ys)


def _train(train_step, params, state, xs, ys, put_batch):
  losses = []
  for i in range(xs.shape[0]):
    params, state, loss = train_step(params, state, put_batch((xs[i], ys[i])))
    losses.append(loss)
  return params, state, losses


def test_jit_named_sharding_matches_single_device():
  opt, train_step, params, xs, ys = _sharded_setup()
  mesh = _mesh((N,), ("data",))
  replicated = NamedSharding(mesh, P())
  data = NamedSharding(mesh, P("data"))

  sharded_params = jax.device_put(params, replicated)
  sharded_state = jax.device_put(opt.init(params), replicated)
  out_params, out_state, losses = _train(
      train_step, sharded_params, sharded_state, xs, ys,
      lambda batch: jax.device_put(batch, data),
  )

  scale = out_state.loss_scale.loss_scale
  assert scale.shape == () and scale.dtype == F32
  assert scale.sharding.is_fully_replicated
  assert out_state.skipped_steps.sharding.is_fully_replicated
  assert isinstance(out_state.loss_scale, jmp_lite.DynamicLossScale)
  assert out_state.loss_scale.period == 2
  assert int(out_state.skipped_steps) == 1
  assert not np.isfinite(float(losses[1]))

  device = jax.devices()[0]
  ref_params, ref_state, ref_losses = _train(
      train_step, jax.device_put(params, device),
      jax.device_put(opt.init(params), device), xs, ys,
      lambda batch: jax.device_put(batch, device),
  )
  assert float(scale) == float(ref_state.loss_scale.loss_scale)
  assert int(out_state.loss_scale.counter) == int(ref_state.loss_scale.counter)
  # float16 matmuls reduce in a different order on 8 shards than on one
  # (float16 epsilon is ~1e-3).
  for a, b in zip(losses, ref_losses):
    np.testing.assert_allclose(a, b, rtol=1e-3)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-4),
      (out_params, out_state.inner_state), (ref_params, ref_state.inner_state),
  )


# ---------------------------------------------------------------------------
# FSDP: state shardings built the optax way (optax.tree_map_params).
# ---------------------------------------------------------------------------

BF16 = np.dtype(jnp.bfloat16)


def _fsdp_params():
  rng = np.random.default_rng(7)
  return {
      "w1": jnp.asarray(rng.normal(size=(16, 6)), BF16),
      "w2": jnp.asarray(rng.normal(size=(8, 16)), BF16),
      "norm": jnp.asarray(rng.normal(size=(8,)), F32),  # no copy: f32
      "bias": jnp.asarray(rng.normal(size=(6,)), BF16),  # 6: not divisible
      "gain": jnp.asarray(1.5, F32),                     # a scalar
  }


def _fsdp_spec(x):
  """FSDP: the first dimension over the mesh where it divides."""
  return P("fsdp") if np.ndim(x) and np.shape(x)[0] % N == 0 else P()


def _adam():
  return optax.adam(1e-2)


FSDP_OPTIMIZERS = [
    ("loss_scaling", lambda: jmp_lite.loss_scaling(
        _adam(), jmp_lite.DynamicLossScale(2.0**8, period=2))),
    ("loss_scaling_accumulating", lambda: jmp_lite.loss_scaling(
        _adam(), jmp_lite.DynamicLossScale(2.0**8, period=2),
        accumulation_steps=2)),
    ("copy", lambda: jmp_lite.master_weights(_adam())),
    ("stochastic_rounding", lambda: jmp_lite.master_weights(
        _adam(), method="stochastic_rounding", seed=3)),
    ("kahan", lambda: jmp_lite.master_weights(_adam(), method="kahan")),
    ("with_state_dtype", lambda: jmp_lite.with_state_dtype(
        _adam(), jnp.bfloat16)),
    ("composed", lambda: jmp_lite.loss_scaling(
        jmp_lite.master_weights(jmp_lite.with_state_dtype(
            optax.chain(optax.clip_by_global_norm(1.0), _adam()),
            jnp.bfloat16), method="kahan"),
        jmp_lite.DynamicLossScale(2.0**8, period=2))),
]


def _fsdp_steps(opt, params, state, n=4, bad_step=2):
  """A few jitted steps on fixed gradients (the loss-scaling optimizers get
  them scaled, with an inf at ``bad_step``)."""
  rng = np.random.default_rng(11)
  true = [jax.tree.map(lambda p: rng.normal(size=np.shape(p)).astype(F32),
                       params) for _ in range(n)]
  step = jax.jit(lambda g, s, p: opt.update(g, s, p))
  scaled = isinstance(state, jmp_lite.LossScaleState)
  for i, g in enumerate(true):
    if scaled:
      scale = float(jmp_lite.get_loss_scale(state).loss_scale)
      g = jax.tree.map(lambda x: x * np.float32(scale), g)
      if i == bad_step:
        g["w1"][3, 2] = np.inf
    g = jax.tree.map(lambda x, p: jnp.asarray(x, p.dtype), g, params)
    updates, state = step(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.standard_promotion  # adam
@pytest.mark.parametrize("name,make", default_run_keeps(FSDP_OPTIMIZERS,
                                                         unpack=True),
                         ids=[c[0] for c in FSDP_OPTIMIZERS])
def test_fsdp_state_shardings_the_optax_way(name, make):
  """optax.tree_map_params maps the params' shardings over the state (init
  runs on optax's placeholder), jax.jit(opt.init, out_shardings=...) makes
  the state on 8 devices with every per-param leaf sharded like its param,
  eval_shape and optax.tree.get work, and training on 8 devices gives the
  1-device results to float32 rounding, with the same loss scale and skips:
  every operation on a param is elementwise, the one reduction (the largest
  gradient magnitude) is a max, exact in any order, and stochastic rounding
  draws its bits from the element's index, not from the shard. jax 0.10's
  XLA:CPU gives them bit for bit; jax 0.12's fuses the sharded and the whole
  update differently (an ulp apart), and with a clip by global norm inside
  ("composed") the norm is a sum whose order follows the sharding. The float32
  values (params, or master values) agree within 1e-6; a value an ulp apart
  can round the other way to bfloat16, so the stored narrow parts are not
  compared bit for bit."""
  opt = make()
  params = _fsdp_params()
  mesh = _mesh((N,), ("fsdp",))
  replicated = NamedSharding(mesh, P())
  param_shardings = jax.tree.map(lambda p: NamedSharding(mesh, _fsdp_spec(p)),
                                 params)
  state = opt.init(params)
  # A param master_weights keeps nothing for holds optax.MaskedNode() (no
  # leaf, as in optax.masked's state): is_leaf= hands it to f, which keeps it.
  masked = lambda x: isinstance(x, optax.MaskedNode)
  shardings = optax.tree_map_params(
      opt, lambda p, s: p if masked(p) else s, state, param_shardings,
      transform_non_params=lambda _: replicated, is_leaf=masked)
  abstract = jax.eval_shape(opt.init, params)
  assert jax.tree.structure(abstract) == jax.tree.structure(state)
  assert jax.tree.structure(shardings) == jax.tree.structure(state)

  sharded_params = jax.device_put(params, param_shardings)
  sharded = jax.jit(opt.init, out_shardings=shardings)(sharded_params)
  per_param = [leaf for leaf in jax.tree.leaves(sharded)
               if leaf.shape == (16, 6) or leaf.shape == (8, 16)]
  assert per_param, "no per-param state leaf"
  for leaf in per_param:  # moments, copies, compensations, accumulators
    assert leaf.sharding.spec == P("fsdp"), (leaf.shape, leaf.sharding)
    assert len(leaf.addressable_shards) == N
    assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // N
  counts = optax.tree.get_all_with_path(sharded, "count")  # optax's lookup
  assert counts and all(c.sharding.is_fully_replicated for _, c in counts)
  mu = optax.tree.get(sharded, "mu")
  assert mu["w1"].sharding.spec == P("fsdp") and mu["norm"].shape == (8,)

  out8 = _fsdp_steps(opt, sharded_params, sharded)
  device = jax.devices()[0]
  out1 = _fsdp_steps(opt, jax.device_put(params, device),
                     jax.device_put(state, device))
  # The float32 values (params, or params + master copy / Kahan
  # compensation) within 1e-6, absolute and relative (the params are of
  # order 1); the scale and the skips exactly.
  with_master = name in ("copy", "stochastic_rounding", "kahan", "composed")
  masters = [jmp_lite.get_master_params(s, p) if with_master else p
             for p, s in (out8, out1)]
  for a, b in zip(*map(jax.tree.leaves, masters)):
    np.testing.assert_allclose(np.asarray(a, F32), np.asarray(b, F32),
                               rtol=1e-6, atol=1e-6)
  if name.startswith("loss_scaling") or name == "composed":
    for field in ("loss_scale", "skipped_steps"):
      assert jax.tree.map(np.asarray, optax.tree.get(out8[1], field)) == (
          jax.tree.map(np.asarray, optax.tree.get(out1[1], field)))
  for p in jax.tree.leaves(out8[0]):
    assert np.all(np.isfinite(np.asarray(p, F32)))


# ---------------------------------------------------------------------------
# Delayed float8 state under pmap/shard_map: global amaxes by default.
# ---------------------------------------------------------------------------

# A recipe without axis_name; the head in float8 too (two layers of state).
FP8_DELAYED = "p=f32,c=bf16,o=f32,m=fp8_delayed(include_output_head=true)"


def _fp8_batch():
  """(32, 32) inputs, 4 rows per device; device 3's rows hold an outlier, so
  its local amax is not the others'."""
  x = np.random.default_rng(5).normal(size=(4 * N, 32)).astype(np.float32)
  x[4 * BAD_DEVICE, 0] = 300.0
  return jnp.asarray(x)


def _linen_fp8():
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jmp_lite.linen as jlinen  # pylint: disable=import-outside-toplevel

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(16, name="head")(nn.relu(nn.Dense(32, name="inp")(x)))

  model = jlinen.apply_policy(Mlp(), FP8_DELAYED)
  variables = jax.jit(model.init)(jax.random.key(0), _fp8_batch()[:4])

  def step(variables, x):
    """One training step's float8 state: loss and gradients run, the
    histories rolled."""
    def loss(params):
      y, updates = model.apply({**variables, "params": params}, x,
                               mutable=["fp8_state"])
      return jnp.mean(jnp.square(y)), updates
    (_, updates), _ = jax.value_and_grad(loss, has_aux=True)(
        variables["params"])
    return updates["fp8_state"]

  return variables, step


@pytest.mark.parametrize("kind", default_run_keeps(["pmap", "shard_map"]))
def test_delayed_fp8_histories_agree_across_replicas_by_default(kind):
  """Issue 36, item 4: without axis_name each replica kept its own shard's
  amaxes. By default the amaxes are reduced over every bound axis: each
  replica's histories are those of one jitted step on the whole batch."""
  variables, step = _linen_fp8()
  x = _fp8_batch()
  whole = jax.jit(step)(variables, x)
  if kind == "pmap":
    out = jax.pmap(step, in_axes=(None, 0))(variables, x.reshape(N, 4, 32))
    for leaf in jax.tree.leaves(out):
      assert all(np.array_equal(leaf[0], leaf[i]) for i in range(N))
    out = jax.tree.map(lambda leaf: leaf[0], out)
  else:
    # Several mesh axes, the batch over one: out_specs P() (replicated)
    # type-checks only if the histories vary over neither axis.
    mesh = _mesh((4, 2), ("data", "model"))
    out = jax.jit(shard_map(step, mesh=mesh, in_specs=(P(), P("data")),
                            out_specs=P()))(variables, x)
  jax.tree.map(np.testing.assert_array_equal, out, whole)
  assert float(jax.lax.bitcast_convert_type(
      out["inp"]["lhs"][0], jnp.float32)) == 300.0


def test_delayed_fp8_named_vmap_and_explicit_axis_name():
  """A vmap with an axis_name binds a mapped axis too; an explicit axis_name
  is kept (here the only bound axis, so the same result)."""
  from jmp_lite import fp8  # pylint: disable=import-outside-toplevel
  x = _fp8_batch().reshape(N, 4, 32)
  w = jnp.ones((32, 16), jnp.float32)
  dims = (((1,), (0,)), ((), ()))

  def amax_lhs(config):
    def fn(x):
      scales = fp8.DelayedScales(jnp.float32(1.0), jnp.float32(1.0))
      _, vjp = jax.vjp(lambda s: fp8.dot_general(
          x, w, dims, config=config, scales=s), scales)
      return vjp(jnp.ones((4, 16), jnp.float32))[0].lhs
    return fn

  for config in (fp8.Fp8Config(scaling="delayed"),
                 fp8.Fp8Config(scaling="delayed", axis_name="v")):
    out = jax.jit(jax.vmap(amax_lhs(config), axis_name="v"))(x)
    np.testing.assert_array_equal(out, np.full(N, 300.0))
  # Outside any mapped axis nothing is reduced (jit: the amax is global).
  assert float(jax.jit(amax_lhs(fp8.Fp8Config(scaling="delayed")))(x[0])) < 300


def test_delayed_fp8_nnx_histories_agree_under_shard_map():
  """The NNX route: the module's histories after a call on the batch split
  over 'data' (of two mesh axes) are those of one call on the whole batch."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import jmp_lite.nnx as jnnx  # pylint: disable=import-outside-toplevel

  class Mlp(nnx.Module):
    def __init__(self, rngs):
      self.inp = nnx.Linear(32, 32, rngs=rngs)
      self.head = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
      return self.head(nnx.relu(self.inp(x)))

  graphdef, state = nnx.split(
      jnnx.apply_policy(Mlp(nnx.Rngs(0)), FP8_DELAYED))

  def call(state, x):
    model = nnx.merge(graphdef, state)
    model(x)
    return nnx.state(model, jnnx.Fp8State)

  x = _fp8_batch()
  whole = jax.jit(call)(state, x)
  mesh = _mesh((4, 2), ("data", "model"))
  out = jax.jit(shard_map(call, mesh=mesh, in_specs=(P(), P("data")),
                          out_specs=P()))(state, x)
  jax.tree.map(np.testing.assert_array_equal, out, whole)
