"""Which matmuls a float8 region quantizes, and how a fallback shows
(issue 25, items 2 and 4): the output head is the last matmul float8 would
quantize (a cross-entropy written as a batched einsum is none), the
multiple-of-16 rule constrains K and N only (not the rows, which data
parallelism splits), and every fallback is named by ``op_dtypes`` and logged.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite

E4, BF = ("float8_e4m3fn",) * 2, ("bfloat16",) * 2
PARAMS = {"w1": jnp.full((32, 64), 0.05), "w2": jnp.full((64, 32), 0.05)}
X = jnp.linspace(-1.0, 1.0, 16 * 32).reshape(16, 32)
LABELS = jnp.arange(16) % 32


def einsum_loss(params, x, labels):
  """An LM-style loss: the head, then a cross-entropy as a batched einsum
  (Haliax's way)."""
  logits = jax.nn.relu(x @ params["w1"]) @ params["w2"]
  logp = jax.nn.log_softmax(logits)
  onehot = jax.nn.one_hot(labels, 32, dtype=logp.dtype)
  return -jnp.mean(jnp.einsum("bv,bv->b", onehot, logp))


def dots(fn, *args):
  return [op for op in jmp_lite.op_dtypes(fn, *args) if op[0] == "dot_general"]


@pytest.mark.parametrize("route", [jmp_lite.autocast, jmp_lite.with_policy])
def test_head_stays_out_with_the_loss_in_the_region(route):
  f = route(einsum_loss, "mixed_fp8")
  found = dots(f, PARAMS, X, LABELS)
  traced = "bfloat16"  # autocast's compute dtype; with_policy's cast inputs
  assert [d for _, d in found] == [E4, BF, (traced,) * 2], found
  assert found[1].note.startswith("output head")
  assert found[2].note.startswith("batched matmul")
  # On the jaxpr of the training step too: the head's backward stays out.
  grad = dots(jax.grad(f), PARAMS, X, LABELS)
  assert {d for _, d in grad} == {E4, ("float8_e5m2", "float8_e4m3fn"), BF,
                                  (traced,) * 2}
  assert all(op[1] != E4 for op in grad if op.note and "head" in op.note)


def test_pinning_a_matmul_without_flax_rules():
  # Out: a float32 island (as MaxText's logits_dot_in_fp32)...
  def pinned_out(params, x):
    h = jax.nn.relu(x @ params["w1"])
    return jmp_lite.in_float32(lambda h, w: h @ w)(h, params["w2"]) @ (
        jnp.eye(32))
  found = dots(jmp_lite.autocast(pinned_out, "mixed_fp8"), PARAMS, X)
  assert [d for _, d in found] == [E4, ("float32",) * 2, BF]
  # ... in: a nested with_policy whose recipe includes its head.
  head_in = jmp_lite.with_policy(
      lambda h, w: h @ w, "p=f32,c=bf16,o=f32,m=fp8(include_output_head=true)")
  def pinned_in(params, x):
    return head_in(jax.nn.relu(x @ params["w1"]), params["w2"])
  found = dots(jmp_lite.autocast(pinned_in, "mixed_fp8"), PARAMS, X)
  assert [d for _, d in found] == [E4, E4]


def test_rows_are_not_constrained_k_and_n_are():
  small_batch = X[:4]                                     # M = 4
  found = dots(jmp_lite.autocast(einsum_loss, "mixed_fp8"), PARAMS,
               small_batch, LABELS[:4])
  assert found[0][1] == E4 and found[0].note is None
  odd = {"w1": jnp.full((24, 64), 0.05), "w2": PARAMS["w2"]}   # K = 24
  found = dots(jmp_lite.autocast(einsum_loss, "mixed_fp8"), odd,
               jnp.ones((16, 24)), LABELS)
  assert found[0][1] == BF and found[0].note == "dims not multiple of 16: K=24"


def test_shard_map_batch_of_64_on_8_devices_stays_in_float8():
  mesh = jax.make_mesh((8,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  spec = jax.sharding.PartitionSpec("data")
  x = jnp.ones((64, 32))

  def loss(params, x):
    def local(params, x):                                 # 8 rows per device
      return jax.lax.pmean(jnp.mean(jax.nn.relu(x @ params["w1"])
                                    @ params["w2"]), "data")
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(jax.sharding.PartitionSpec(), spec),
                         out_specs=jax.sharding.PartitionSpec())(params, x)

  found = dots(jmp_lite.autocast(loss, "mixed_fp8"), PARAMS, x)
  assert found[0][1] == E4, found


def test_fallbacks_are_logged(caplog):
  with caplog.at_level(logging.DEBUG, logger="jmp_lite"):
    jax.make_jaxpr(jmp_lite.autocast(einsum_loss, "mixed_fp8"))(
        PARAMS, X, LABELS)
  messages = [r.getMessage() for r in caplog.records if r.name == "jmp_lite"]
  assert any("(16, 64) x (64, 32) stays out of float8: output head" in m
             for m in messages), messages
  assert any("batched matmul" in m for m in messages), messages


def test_values_follow_the_reported_dtypes():
  f = jax.jit(jmp_lite.autocast(einsum_loss, "mixed_fp8"))
  plain = jax.jit(einsum_loss)(PARAMS, X, LABELS)
  np.testing.assert_allclose(f(PARAMS, X, LABELS), plain, rtol=2e-2)
