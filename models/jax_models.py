"""Models written in plain JAX (no Flax): params are float32 pytrees.

The benchmarks' workloads (``benchmarks/workloads.py``) and the PyTorch
side-by-side of the GPU suite (``benchmarks/torch_side.py``, layer for layer)
are built from these.

Every ``apply`` follows the dtype of its inputs: give it float16 params and
inputs (``policy.cast_to_compute``) and its matmuls and convolutions run in
float16. Normalisation statistics and the attention softmax are computed in
float32 (explicit ``astype``) and cast back to the input dtype, as a
mixed-precision model written by hand would; under ``jmp_lite.autocast`` those
casts are no-ops at trace time and autocast's own rules decide.

* :func:`init_mlp` / :func:`apply_mlp`: ReLU MLP.
* :func:`init_conv` / :func:`apply_conv`: two convolutions and a dense layer.
* :func:`init_resnet` / :func:`apply_resnet`: ResNet (basic or bottleneck
  blocks, batch norm with batch statistics, i.e. training mode).
* :func:`init_lm` / :func:`apply_lm`: decoder-only pre-LN transformer LM with
  tied embeddings (GPT-2 layout).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

Params = Any
F32 = jnp.float32


def _dense_init(key: jax.Array, fan_in: int, shape: tuple[int, ...]) -> dict[str, jax.Array]:
  w = jax.random.normal(key, shape, F32) / np.sqrt(fan_in).astype(np.float32)
  return {"w": w, "b": jnp.zeros(shape[-1:], F32)}


# --- MLP -------------------------------------------------------------------------


def init_mlp(key: jax.Array, sizes: tuple[int, ...]) -> Params:
  """Float32 MLP params: a list of ``{"w", "b"}`` per layer."""
  keys = jax.random.split(key, len(sizes) - 1)
  return [
      _dense_init(k, din, (din, dout))
      for k, din, dout in zip(keys, sizes[:-1], sizes[1:])
  ]


def apply_mlp(params: Params, x: jax.Array) -> jax.Array:
  """ReLU MLP; returns logits in the dtype of ``params`` and ``x``."""
  for i, layer in enumerate(params):
    x = x @ layer["w"] + layer["b"]
    if i < len(params) - 1:
      x = jax.nn.relu(x)
  return x


# --- small conv net ----------------------------------------------------------------


def init_conv(key: jax.Array, sizes: tuple[int, ...]) -> Params:
  """Float32 params of a two-conv-layer net on ``side x side x 1`` images."""
  side, c1, c2, classes = sizes
  k1, k2, k3 = jax.random.split(key, 3)
  flat = ((side + 1) // 2) ** 2 * c2
  return {
      "conv1": _dense_init(k1, 9, (3, 3, 1, c1)),
      "conv2": _dense_init(k2, 9 * c1, (3, 3, c1, c2)),
      "dense": _dense_init(k3, flat, (flat, classes)),
  }


def _conv(x: jax.Array, w: jax.Array, stride: int) -> jax.Array:
  return jax.lax.conv_general_dilated(
      x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


def apply_conv(params: Params, x: jax.Array) -> jax.Array:
  """conv 3x3 -> conv 3x3 stride 2 -> dense; returns logits."""
  x = jax.nn.relu(_conv(x, params["conv1"]["w"], 1) + params["conv1"]["b"])
  x = jax.nn.relu(_conv(x, params["conv2"]["w"], 2) + params["conv2"]["b"])
  x = x.reshape(x.shape[0], -1)
  return x @ params["dense"]["w"] + params["dense"]["b"]


# --- ResNet ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  """A ResNet shape.

  Attributes:
    blocks: blocks per stage, e.g. (2, 2, 2, 2) for ResNet-18, (3, 4, 6, 3)
      for ResNet-50.
    widths: base channels per stage (a bottleneck block outputs 4x).
    bottleneck: bottleneck (1x1-3x3-1x1) blocks instead of basic (3x3-3x3).
    imagenet_stem: 7x7/2 conv + 3x3/2 max pool (ImageNet); otherwise a 3x3/1
      conv (CIFAR-style, for small images).
    stem_width: channels of the stem conv.
    classes: output classes.
  """

  blocks: tuple[int, ...]
  widths: tuple[int, ...]
  bottleneck: bool
  imagenet_stem: bool
  stem_width: int
  classes: int

  def describe(self) -> str:
    kind = "bottleneck" if self.bottleneck else "basic"
    stem = "7x7/2+pool stem" if self.imagenet_stem else "3x3 stem"
    return (
        f"ResNet {'-'.join(map(str, self.blocks))} {kind} blocks, widths "
        f"{'/'.join(map(str, self.widths))}, {stem}"
    )


def _conv_bn_init(key: jax.Array, k: int, cin: int, cout: int) -> dict[str, jax.Array]:
  w = jax.random.normal(key, (k, k, cin, cout), F32) * np.float32(np.sqrt(2.0 / (k * k * cin)))
  return {"w": w, "scale": jnp.ones((cout,), F32), "bias": jnp.zeros((cout,), F32)}


def init_resnet(key: jax.Array, cfg: ResNetConfig) -> Params:
  """Float32 ResNet params (conv weights HWIO, batch-norm scale and bias)."""
  keys = iter(jax.random.split(key, 4 * sum(cfg.blocks) + 2))
  params: dict[str, Any] = {
      "stem": _conv_bn_init(next(keys), 7 if cfg.imagenet_stem else 3, 3, cfg.stem_width)
  }
  cin = cfg.stem_width
  stages = []
  for width, count in zip(cfg.widths, cfg.blocks):
    cout = 4 * width if cfg.bottleneck else width
    blocks = []
    for i in range(count):
      if cfg.bottleneck:
        block = {
            "a": _conv_bn_init(next(keys), 1, cin, width),
            "b": _conv_bn_init(next(keys), 3, width, width),
            "c": _conv_bn_init(next(keys), 1, width, cout),
        }
      else:
        block = {
            "a": _conv_bn_init(next(keys), 3, cin, width),
            "b": _conv_bn_init(next(keys), 3, width, cout),
        }
      if cin != cout or (i == 0 and stages):
        block["proj"] = _conv_bn_init(next(keys), 1, cin, cout)
      blocks.append(block)
      cin = cout
    stages.append(blocks)
  params["stages"] = stages
  params["head"] = _dense_init(next(keys), cin, (cin, cfg.classes))
  return params


def batch_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
  """Batch norm with batch statistics, computed in float32, output in x's dtype."""
  x32 = x.astype(F32)
  mean = jnp.mean(x32, axis=(0, 1, 2))
  var = jnp.mean(jnp.square(x32 - mean), axis=(0, 1, 2))
  y = (x32 - mean) * jax.lax.rsqrt(var + eps)
  return (y * scale.astype(F32) + bias.astype(F32)).astype(x.dtype)


def _conv_bn(x: jax.Array, p: dict[str, jax.Array], stride: int, relu: bool) -> jax.Array:
  y = batch_norm(_conv(x, p["w"], stride), p["scale"], p["bias"])
  return jax.nn.relu(y) if relu else y


def apply_resnet(params: Params, x: jax.Array, cfg: ResNetConfig) -> jax.Array:
  """ResNet forward pass on NHWC images; returns logits."""
  x = _conv_bn(x, params["stem"], 2 if cfg.imagenet_stem else 1, relu=True)
  if cfg.imagenet_stem:
    x = jax.lax.reduce_window(
        x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME"
    )
  for s, blocks in enumerate(params["stages"]):
    for i, block in enumerate(blocks):
      stride = 2 if (i == 0 and s > 0) else 1
      if cfg.bottleneck:
        y = _conv_bn(x, block["a"], 1, relu=True)
        y = _conv_bn(y, block["b"], stride, relu=True)
        y = _conv_bn(y, block["c"], 1, relu=False)
      else:
        y = _conv_bn(x, block["a"], stride, relu=True)
        y = _conv_bn(y, block["b"], 1, relu=False)
      shortcut = _conv_bn(x, block["proj"], stride, relu=False) if "proj" in block else x
      x = jax.nn.relu(y + shortcut)
  x = jnp.mean(x.astype(F32), axis=(1, 2)).astype(x.dtype)
  return x @ params["head"]["w"] + params["head"]["b"]


# --- transformer LM ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """A decoder-only transformer shape (GPT-2 small: 50257, 12, 768, 12, 1024)."""

  vocab: int
  layers: int
  width: int
  heads: int
  seq_len: int

  def describe(self) -> str:
    return (
        f"decoder LM {self.layers} layers x {self.width} wide, {self.heads} "
        f"heads, {self.seq_len} tokens, vocab {self.vocab}"
    )


def init_lm(key: jax.Array, cfg: LMConfig) -> Params:
  """Float32 GPT-2-style params (normal(0.02) weights, tied embedding)."""
  d = cfg.width
  keys = iter(jax.random.split(key, 4 * cfg.layers + 2))

  def dense(din: int, dout: int) -> dict[str, jax.Array]:
    return {"w": jax.random.normal(next(keys), (din, dout), F32) * np.float32(0.02),
            "b": jnp.zeros((dout,), F32)}

  def norm() -> dict[str, jax.Array]:
    return {"scale": jnp.ones((d,), F32), "bias": jnp.zeros((d,), F32)}

  return {
      "embed": jax.random.normal(next(keys), (cfg.vocab, d), F32) * np.float32(0.02),
      "pos": jax.random.normal(next(keys), (cfg.seq_len, d), F32) * np.float32(0.01),
      "blocks": [
          {"ln1": norm(), "qkv": dense(d, 3 * d), "out": dense(d, d),
           "ln2": norm(), "fc": dense(d, 4 * d), "proj": dense(4 * d, d)}
          for _ in range(cfg.layers)
      ],
      "ln_f": norm(),
  }


def layer_norm(x: jax.Array, p: dict[str, jax.Array], eps: float = 1e-5) -> jax.Array:
  """Layer norm computed in float32, output in x's dtype."""
  x32 = x.astype(F32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps)
  return (y * p["scale"].astype(F32) + p["bias"].astype(F32)).astype(x.dtype)


def _attention(x: jax.Array, p: dict[str, Any], heads: int, matmul: Callable) -> jax.Array:
  b, t, d = x.shape
  qkv = matmul(x, p["qkv"]["w"]) + p["qkv"]["b"]
  q, k, v = jnp.split(qkv.reshape(b, t, 3 * heads, d // heads), 3, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads).astype(np.float32)
  causal = jnp.tril(jnp.ones((t, t), bool))
  scores = jnp.where(causal, scores.astype(F32), -1e9)
  weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
  return matmul(out, p["out"]["w"]) + p["out"]["b"]


def apply_block(x: jax.Array, p: dict[str, Any], heads: int,
                matmul: Callable = jnp.matmul) -> jax.Array:
  """One pre-LN transformer block: attention and a 4x GELU MLP, residuals.

  ``matmul(x, w)`` runs the four dense layers (a float8 matmul, say); the
  attention products stay ``jnp.einsum``.
  """
  x = x + _attention(layer_norm(x, p["ln1"]), p, heads, matmul)
  h = layer_norm(x, p["ln2"])
  h = jax.nn.gelu(matmul(h, p["fc"]["w"]) + p["fc"]["b"], approximate=True)
  return x + (matmul(h, p["proj"]["w"]) + p["proj"]["b"])


def apply_lm(params: Params, tokens: jax.Array, cfg: LMConfig,
             matmul: Callable = jnp.matmul) -> jax.Array:
  """Logits ``(batch, seq, vocab)`` for int32 ``tokens``; tied output embedding.

  ``matmul`` runs the blocks' dense layers (see ``apply_block``), not the head.
  """
  x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
  for block in params["blocks"]:
    x = apply_block(x, block, cfg.heads, matmul)
  x = layer_norm(x, params["ln_f"])
  return x @ params["embed"].T
