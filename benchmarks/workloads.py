"""The three benchmark workloads (MLP, ResNet, transformer LM) at every size.

A :class:`Workload` bundles params, a synthetic batch and a float32
cross-entropy loss; :func:`loss_fn` gives that loss computed three ways:

* ``"f32"``: everything in float32;
* ``"policy"``: cast by hand with a ``jmp_lite.Policy``
  (``policy.cast_to_compute((params, x))``; the model follows its inputs'
  dtype, computing norm statistics and the softmax in float32);
* ``"autocast"``: the float32 loss under ``jmp_lite.autocast(loss, policy)``.

Sizes: ``"cpu"`` (the committed CPU figures: seconds per workload on two
cores), ``"quick"`` (smoke test), ``"gpu"`` (ResNet-50 and GPT-2 small) and
``"tiny"`` (the GPU suite's dry run on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import jmp_lite
from benchmarks import models
from benchmarks.common import Batch
from benchmarks.common import Params

SIZES = ("quick", "cpu", "tiny", "gpu")
NAMES = ("mlp", "resnet", "transformer")


@dataclasses.dataclass(frozen=True)
class Workload:
  """A model, its batch and its loss.

  Attributes:
    name: ``"mlp"``, ``"resnet"`` or ``"transformer"``.
    description: model shape and batch, for the tables.
    init: ``key -> float32 params``.
    apply: ``(params, x) -> logits``.
    make_batch: ``key -> {"x", "y"}`` (float32 inputs or int32 tokens; int32
      labels).
    examples: examples per batch (images, or sequences for the LM).
    tokens: tokens per batch for the LM, else ``None``.
    spec: the shape as plain data (for the PyTorch side-by-side).
  """

  name: str
  description: str
  init: Callable[[jax.Array], Params]
  apply: Callable[[Params, jax.Array], jax.Array]
  make_batch: Callable[[jax.Array], Batch]
  examples: int
  tokens: int | None = None
  spec: dict[str, Any] = dataclasses.field(default_factory=dict)


def _classifier_batch(key: jax.Array, shape: tuple[int, ...], classes: int) -> Batch:
  kx, ky = jax.random.split(key)
  return {"x": jax.random.normal(kx, shape, jnp.float32),
          "y": jax.random.randint(ky, shape[:1], 0, classes, jnp.int32)}


def _lm_batch(key: jax.Array, batch: int, cfg: models.LMConfig) -> Batch:
  tokens = jax.random.randint(key, (batch, cfg.seq_len + 1), 0, cfg.vocab, jnp.int32)
  return {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def mlp(batch: int, sizes: tuple[int, ...]) -> Workload:
  return Workload(
      name="mlp",
      description=f"MLP {'-'.join(map(str, sizes))}, batch {batch}",
      init=functools.partial(models.init_mlp, sizes=sizes),
      apply=models.apply_mlp,
      make_batch=functools.partial(_classifier_batch, shape=(batch, sizes[0]), classes=sizes[-1]),
      examples=batch,
      spec={"sizes": list(sizes), "batch": batch},
  )


def resnet(batch: int, image: int, cfg: models.ResNetConfig) -> Workload:
  return Workload(
      name="resnet",
      description=f"{cfg.describe()}, {image}x{image}x3, batch {batch}",
      init=functools.partial(models.init_resnet, cfg=cfg),
      apply=functools.partial(models.apply_resnet, cfg=cfg),
      make_batch=functools.partial(
          _classifier_batch, shape=(batch, image, image, 3), classes=cfg.classes),
      examples=batch,
      spec={"config": dataclasses.asdict(cfg), "batch": batch, "image": image},
  )


def transformer(batch: int, cfg: models.LMConfig) -> Workload:
  return Workload(
      name="transformer",
      description=f"{cfg.describe()}, batch {batch}",
      init=functools.partial(models.init_lm, cfg=cfg),
      apply=functools.partial(models.apply_lm, cfg=cfg),
      make_batch=functools.partial(_lm_batch, batch=batch, cfg=cfg),
      examples=batch,
      tokens=batch * cfg.seq_len,
      spec={"config": dataclasses.asdict(cfg), "batch": batch},
  )


RESNET18_CPU = models.ResNetConfig(
    blocks=(2, 2, 2, 2), widths=(16, 32, 64, 128), bottleneck=False,
    imagenet_stem=False, stem_width=16, classes=10)
RESNET50 = models.ResNetConfig(
    blocks=(3, 4, 6, 3), widths=(64, 128, 256, 512), bottleneck=True,
    imagenet_stem=True, stem_width=64, classes=1000)
GPT2_SMALL = models.LMConfig(vocab=50257, layers=12, width=768, heads=12, seq_len=1024)


def make_workloads(size: str) -> list[Workload]:
  """The MLP, ResNet and transformer workloads at ``size`` (see module doc)."""
  if size == "cpu":
    return [
        mlp(256, (784, 1024, 1024, 10)),
        resnet(8, 32, RESNET18_CPU),
        transformer(8, models.LMConfig(vocab=256, layers=2, width=128, heads=4, seq_len=64)),
    ]
  if size == "gpu":
    return [
        mlp(4096, (784, 4096, 4096, 4096, 10)),
        resnet(128, 224, RESNET50),
        transformer(8, GPT2_SMALL),
    ]
  if size == "quick":
    return [
        mlp(8, (16, 32, 32, 10)),
        resnet(2, 8, models.ResNetConfig(
            blocks=(1, 1), widths=(4, 8), bottleneck=False, imagenet_stem=False,
            stem_width=4, classes=10)),
        transformer(2, models.LMConfig(vocab=32, layers=1, width=16, heads=2, seq_len=8)),
    ]
  if size == "tiny":
    # The GPU shapes' code paths (bottleneck blocks, ImageNet stem, tied
    # embeddings) at the smallest size: one stage, one block, so that the
    # dry run's many compilations stay short on a CPU.
    return [
        mlp(8, (16, 32, 32, 10)),
        resnet(2, 16, models.ResNetConfig(
            blocks=(1,), widths=(4,), bottleneck=True, imagenet_stem=True,
            stem_width=4, classes=10)),
        transformer(2, models.LMConfig(vocab=32, layers=1, width=16, heads=2, seq_len=8)),
    ]
  raise ValueError(f"unknown size {size!r}; choose from {SIZES}")


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean cross-entropy in float32 over every position."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def loss_fn(workload: Workload, mode: str, policy: jmp_lite.Policy | None = None):
  """``(params, batch) -> float32 loss`` for ``mode`` ``"f32"``, ``"policy"`` or ``"autocast"``."""

  def f32_loss(params: Params, batch: Batch) -> jax.Array:
    return cross_entropy(workload.apply(params, batch["x"]), batch["y"])

  if mode == "f32":
    return f32_loss
  if mode == "policy":

    def policy_loss(params: Params, batch: Batch) -> jax.Array:
      params, x = policy.cast_to_compute((params, batch["x"]))
      return cross_entropy(workload.apply(params, x), batch["y"])

    return policy_loss
  if mode == "autocast":
    return jmp_lite.autocast(f32_loss, policy)
  raise ValueError(f"unknown loss mode {mode!r}")


def setup(workload: Workload, seed: int) -> tuple[Params, Batch]:
  """Float32 params and a fixed synthetic batch."""
  key_params, key_batch = jax.random.split(jax.random.PRNGKey(seed))
  return workload.init(key_params), workload.make_batch(key_batch)


def param_count(params: Params) -> int:
  return int(sum(x.size for x in jax.tree_util.tree_leaves(params)))
