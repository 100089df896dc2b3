"""A Mixture-of-Experts LM in plain JAX (no Flax), written as JAX trainers
write one (MaxText's ``sparse_matmul`` path, Levanter): params are float32
pytrees, the expert matmuls are ``jax.lax.ragged_dot``.

The benchmarks' ``moe`` workload (``benchmarks/workloads.py``) is built from
it. Like :mod:`models.jax_models`, ``apply`` follows the dtype of its inputs;
norm statistics, the router's softmax and the gates are computed in float32.

Per layer (pre-LN, residual), for the ``T = batch x seq_len`` tokens:

1. router: a dense ``[T, D] x [D, E]`` matmul, softmax in float32;
2. top-``k`` experts per token (``jax.lax.top_k``), gates renormalised to
   sum to 1;
3. the ``T x k`` token copies sorted by expert (``argsort`` of the expert
   ids), the group sizes counted (``bincount``);
4. up projection ``ragged_dot(x_sorted[T*k, D], w_up[E, D, F], sizes)``,
   GELU, down projection ``ragged_dot(h[T*k, F], w_down[E, F, D], sizes)``;
5. unsorted (a gather with the inverse permutation) and combined: each
   token's ``k`` outputs weighted by its gates and summed.

No attention (the block is the MoE feed-forward only, so that the row
measures the router and the grouped matmuls) and no load-balancing loss (the
workloads' loss is the cross-entropy); the output head is the tied embedding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.jax_models import layer_norm

Params = dict
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """An MoE LM shape: ``layers`` MoE blocks of ``experts`` GELU experts
  (``width -> hidden -> width``), ``top_k`` experts per token."""

  vocab: int
  layers: int
  width: int
  hidden: int
  experts: int
  seq_len: int
  top_k: int = 2

  def describe(self) -> str:
    return (f"MoE LM {self.layers} layers x {self.width} wide, {self.experts} "
            f"experts x {self.hidden} hidden, top-{self.top_k}, ragged_dot, "
            f"{self.seq_len} tokens, vocab {self.vocab}")


def init_moe(key: jax.Array, cfg: MoEConfig) -> Params:
  """Float32 params: embedding (tied head), positions, per layer a norm, a
  router ``[D, E]`` and the experts' ``w_up [E, D, F]`` and ``w_down [E, F, D]``."""
  d, f, e = cfg.width, cfg.hidden, cfg.experts
  keys = iter(jax.random.split(key, 3 * cfg.layers + 2))

  def normal(shape, std):
    return jax.random.normal(next(keys), shape, F32) * np.float32(std)

  def norm():
    return {"scale": jnp.ones((d,), F32), "bias": jnp.zeros((d,), F32)}

  return {
      "embed": normal((cfg.vocab, d), 0.02),
      "pos": normal((cfg.seq_len, d), 0.01),
      "blocks": [
          {"ln": norm(), "router": normal((d, e), 0.02),
           "w_up": normal((e, d, f), d ** -0.5), "w_down": normal((e, f, d), f ** -0.5)}
          for _ in range(cfg.layers)
      ],
      "ln_f": norm(),
  }


def moe_ffn(x: jax.Array, p: Params, top_k: int) -> jax.Array:
  """The MoE feed-forward on tokens ``x [T, D]``: route, sort, two grouped
  matmuls, unsort, combine. Returns ``[T, D]`` in ``x``'s dtype."""
  t, _ = x.shape
  experts = p["w_up"].shape[0]
  probs = jax.nn.softmax((x @ p["router"]).astype(F32), axis=-1)     # [T, E]
  gates, chosen = jax.lax.top_k(probs, top_k)                          # [T, k]
  gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  flat = chosen.reshape(-1)                                            # [T*k]
  order = jnp.argsort(flat, stable=True)                               # sort by expert
  sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)         # [E]
  x_sorted = x[order // top_k]                                         # [T*k, D]
  h = jax.nn.gelu(jax.lax.ragged_dot(x_sorted, p["w_up"], sizes), approximate=True)
  y_sorted = jax.lax.ragged_dot(h, p["w_down"], sizes)                 # [T*k, D]
  y = y_sorted[jnp.argsort(order)].reshape(t, top_k, -1)               # unsort
  return jnp.sum(y * gates[..., None].astype(y.dtype), axis=1)


def apply_moe(params: Params, tokens: jax.Array, cfg: MoEConfig) -> jax.Array:
  """Logits ``(batch, seq, vocab)`` for int32 ``tokens``; tied output embedding."""
  b, s = tokens.shape
  x = params["embed"][tokens] + params["pos"][:s]
  x = x.reshape(b * s, -1)
  for block in params["blocks"]:
    x = x + moe_ffn(layer_norm(x, block["ln"]), block, cfg.top_k)
  x = layer_norm(x, params["ln_f"])
  return (x @ params["embed"].T).reshape(b, s, -1)
