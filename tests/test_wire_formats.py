"""pmean_value_and_grad's wire formats: gradients averaged in float32 while
fewer bytes travel (bfloat16, e4m3), within each format's documented error
bound, with the narrow element type checked in the compiled program, and
a non-finite gradient on one device seen by every device."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import jmp_lite
from helpers import default_run_keeps

#: Unit roundoff (round to nearest) of the wire formats' significands.
U = {"bfloat16": 2.0**-8, "e4m3": 2.0**-4}
#: Half the spacing of e4m3's subnormals (in scaled units): the absolute
#: rounding error of a value scaled into e4m3's subnormal range.
E4M3_ABS = 2.0**-10
E4M3_MAX = 448.0


def _mesh(n):
  return Mesh(np.array(jax.devices()[:n]), ("d",))


def _loss(w, x):
  return (jnp.mean(jnp.tanh(x @ w["a"]) ** 2)
          + jnp.sum(w["b"] ** 2) * jnp.mean(x))


def _problem(n, seed=0):
  rng = np.random.default_rng(seed + n)
  w = {"a": jnp.asarray(rng.normal(size=(37, 5)), jnp.float32),
       "b": jnp.asarray(rng.normal(size=(3,)) * 1e-3, jnp.float32)}
  xs = jnp.asarray(rng.normal(size=(n * 4, 37)), jnp.float32)
  return w, xs


def _step(n, wire, per_device=False):
  step = jmp_lite.pmean_value_and_grad(jax.value_and_grad(_loss), "d",
                                       wire_format=wire)
  if per_device:   # every device's own result, stacked
    inner = step
    step = lambda w, x: jax.tree.map(lambda v: v[None], inner(w, x))
  return jax.jit(jax.shard_map(step, mesh=_mesh(n), in_specs=(P(), P("d")),
                               out_specs=P("d") if per_device else P()))


def _per_device_grads(w, xs, n):
  per = jax.vmap(jax.grad(_loss), in_axes=(None, 0))(
      w, xs.reshape((n, -1) + xs.shape[1:]))
  return jax.tree.map(lambda g: np.asarray(g, np.float64), per)


def _bound(wire, per, n):
  """The documented bound on |result - exact mean|, per element."""
  mean_abs = np.mean(np.abs(per), axis=0)
  # The float32 sums, and the float32 rounding of the gradients themselves
  # (the mapped program and this test's vmap round them differently).
  sums = n * 2.0**-23 * mean_abs + 2.0**-21 * np.max(np.abs(per))
  if wire == "float32":
    return sums
  u = U[wire]
  if wire == "bfloat16":
    return (2 * u + u * u) * mean_abs + sums
  amax1 = np.max(np.abs(per))
  amax2 = np.max(np.abs(np.mean(per, axis=0)))
  return ((2 * u + u * u) * mean_abs + (1 + u) * E4M3_ABS * amax1 / E4M3_MAX
          + E4M3_ABS * amax2 / E4M3_MAX * (1 + u) + sums)


@pytest.mark.parametrize("n", default_run_keeps([2, 4, 8]))
@pytest.mark.parametrize("wire", default_run_keeps(["float32", "bfloat16", "e4m3"], keep=2))
def test_the_mean_is_within_the_formats_bound(n, wire):
  w, xs = _problem(n)
  per = _per_device_grads(w, xs, n)
  loss, grads = _step(n, wire)(w, xs)
  assert np.isfinite(float(loss))
  for name in ("a", "b"):
    got = np.asarray(grads[name], np.float64)
    exact = np.mean(per[name], axis=0)
    assert grads[name].dtype == jnp.float32
    err = np.abs(got - exact)
    bound = _bound(wire, per[name], n)
    assert np.all(err <= bound), (name, float(np.max(err - bound)))
    if wire != "float32":   # the narrow format does round: a real bound
      assert np.max(err) > 0


def _collectives(text):
  """(op, element type, element count) of every collective in an HLO text."""
  found = []
  for line in text.splitlines():
    m = re.search(r"= \(?([a-z0-9]+)\[([0-9,]*)\][^=]*? (all-to-all|"
                  r"all-gather|all-reduce|reduce-scatter|collective-permute)\(",
                  line)
    if m:
      dims = [int(d) for d in m.group(2).split(",") if d]
      found.append((m.group(3), m.group(1), int(np.prod(dims))))
  return found


@pytest.mark.parametrize("wire,width", [("bfloat16", "u16"), ("e4m3", "u8")])
def test_the_compiled_program_moves_the_narrow_format(wire, width):
  n = 4
  w, xs = _problem(n)
  text = _step(n, wire).lower(w, xs).compile().as_text()
  ops = _collectives(text)
  moved = [op for op in ops if op[0] in ("all-to-all", "all-gather")]
  size = 37 * 5 + 3
  piece = -(-size // n)
  # One all_to_all of n pieces (this device's 1/n share of the bucket per
  # peer) and one all_gather of the bucket, both in the wire's width.
  assert sorted(moved) == sorted([("all-to-all", width, piece),
                                  ("all-gather", width, piece * n)]), ops
  # Nothing gradient-sized travels wider: the float32 all-reduces are the
  # loss and (e4m3) the leaves' amaxes, one per leaf.
  wide = [op for op in ops if op[0] == "all-reduce"]
  assert all(count <= 2 for _, _, count in wide), ops


def test_float32_is_one_float32_all_reduce_of_the_gradients():
  n = 4
  w, xs = _problem(n)
  text = _step(n, "float32").lower(w, xs).compile().as_text()
  assert not [op for op in _collectives(text)
              if op[0] in ("all-to-all", "all-gather")]
  assert re.search(r"f32\[37,5\][^\n]*all-reduce\(|all-reduce\([^\n]*f32\[37,5\]",
                   text) or "f32[37,5]" in text


@pytest.mark.parametrize("wire", default_run_keeps(["float32", "bfloat16", "e4m3"], keep=2))
@pytest.mark.parametrize("bad", default_run_keeps([np.nan, np.inf]))
def test_a_non_finite_gradient_on_one_device_reaches_every_device(wire, bad):
  n = 4
  w, xs = _problem(n)
  xs = xs.at[5, 3].set(bad)            # device 1's shard only
  _, grads = _step(n, wire, per_device=True)(w, xs)
  for d in range(n):
    per = jax.tree.map(lambda g, d=d: g[d], grads)
    assert not bool(jmp_lite.all_finite(per)), (wire, d)


@pytest.mark.parametrize("wire", ["bfloat16", "e4m3"])
def test_finite_runs_create_no_nan_or_inf(wire):
  n = 2
  w, xs = _problem(n)
  with jax.debug_nans(True), jax.debug_infs(True):
    _, grads = _step(n, wire)(w, xs)
  assert bool(jmp_lite.all_finite(grads))


@pytest.mark.parametrize("wire", ["bfloat16", "e4m3"])
def test_pmap_and_vmap_give_the_shard_map_result(wire):
  n = 4
  w, xs = _problem(n)
  _, expected = _step(n, wire)(w, xs)
  step = jmp_lite.pmean_value_and_grad(jax.value_and_grad(_loss), "d",
                                       wire_format=wire)
  shards = xs.reshape(n, -1, xs.shape[1])
  for mapped in (jax.pmap(step, axis_name="d", in_axes=(None, 0),
                          devices=jax.devices()[:n]),
                 jax.jit(jax.vmap(step, in_axes=(None, 0), axis_name="d"))):
    _, grads = mapped(w, shards)
    for name in ("a", "b"):
      for d in range(n):
        np.testing.assert_array_equal(np.asarray(grads[name][d]),
                                      np.asarray(expected[name]))


def test_zero_and_tiny_gradients_stay_finite_and_exact_at_zero():
  n = 2
  step = jmp_lite.pmean_value_and_grad(
      jax.value_and_grad(lambda w, x: jnp.sum(w["z"] * 0.0)
                         + jnp.sum(w["t"] * x.mean() * 1e-30)), "d",
      wire_format="e4m3")
  f = jax.jit(jax.shard_map(step, mesh=_mesh(n), in_specs=(P(), P("d")),
                            out_specs=P()))
  w = {"z": jnp.ones((4,)), "t": jnp.ones((4,))}
  _, grads = f(w, jnp.ones((4, 3)))
  np.testing.assert_array_equal(np.asarray(grads["z"]), 0.0)
  assert bool(jmp_lite.all_finite(grads))
  np.testing.assert_allclose(np.asarray(grads["t"]), 1e-30, rtol=2.0**-4)


def test_an_unknown_wire_format_is_refused():
  with pytest.raises(ValueError, match="wire_format.*'float32', 'bfloat16', 'e4m3'"):
    jmp_lite.pmean_value_and_grad(jax.value_and_grad(_loss), "d",
                                  wire_format="fp8")
  with pytest.raises(TypeError, match="wire_format"):
    jmp_lite.pmean_value_and_grad(jax.value_and_grad(_loss), "d",
                                  wire_format=jnp.bfloat16)
