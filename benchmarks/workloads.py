"""Every benchmark workload, defined once, at every size.

A :class:`Workload` bundles a plain-JAX model of :mod:`models.jax_models`
(params float32), a synthetic batch and a float32 cross-entropy loss;
:func:`loss_fn` gives that loss computed three ways:

* ``"f32"``: everything in float32;
* ``"policy"``: cast by hand with a ``jmp_lite.Policy``
  (``policy.cast_to_compute((params, x))``; the model follows its inputs'
  dtype, computing norm statistics and the softmax in float32);
* ``"autocast"``: the float32 loss under ``jmp_lite.autocast(loss, policy)``;
* ``"with_policy"``: the model under ``jmp_lite.with_policy(apply, policy)``,
  the route that runs a policy's float8 recipe (``m=fp8``...) in its matmuls
  (a cast by hand cannot).

:data:`SIZES` is the size table: ``"cpu"`` (the committed CPU figures:
seconds per workload on two cores), ``"quick"`` (smoke tests), ``"gpu"``
(ResNet-50 and GPT-2 small: the GPU suite) and ``"tiny"`` (the GPU suite's
code paths at the smallest size, its dry run on a CPU). The suites measure
``mlp``, ``resnet`` and ``transformer`` (:data:`NAMES`); the wrapper-overhead
study adds the small ``conv`` net, the GPU suite the Mixture-of-Experts LM
``moe`` (:data:`GPU_NAMES`; sizes ``quick``, ``tiny`` and ``gpu`` only).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import jmp_lite
from benchmarks.common import Batch
from benchmarks.common import Params
from models import jax_models as models
from models import moe as moe_models

NAMES = ("mlp", "resnet", "transformer")
#: The GPU suite's workloads: :data:`NAMES` and the Mixture-of-Experts LM
#: (``moe``, GPU suite only: the CPU suite and the studies keep :data:`NAMES`).
GPU_NAMES = NAMES + ("moe",)


@dataclasses.dataclass(frozen=True)
class Workload:
  """A model, its batch and its loss.

  Attributes:
    name: ``"mlp"``, ``"conv"``, ``"resnet"``, ``"transformer"`` or ``"moe"``.
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


def _lm_batch(key: jax.Array, batch: int, cfg: models.LMConfig | moe_models.MoEConfig) -> Batch:
  tokens = jax.random.randint(key, (batch, cfg.seq_len + 1), 0, cfg.vocab, jnp.int32)
  return {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def mlp(batch: int, sizes: tuple[int, ...]) -> Workload:
  """A ReLU MLP of layer widths ``sizes`` (input and output included)."""
  return Workload(
      name="mlp",
      description=f"MLP {'-'.join(map(str, sizes))}, batch {batch}",
      init=functools.partial(models.init_mlp, sizes=sizes),
      apply=models.apply_mlp,
      make_batch=functools.partial(_classifier_batch, shape=(batch, sizes[0]), classes=sizes[-1]),
      examples=batch,
      spec={"sizes": list(sizes), "batch": batch},
  )


def conv(batch: int, sizes: tuple[int, int, int, int]) -> Workload:
  """Two 3x3 convolutions and a dense layer; ``sizes``: (image side,
  channels 1, channels 2, classes)."""
  side, c1, c2, classes = sizes
  return Workload(
      name="conv",
      description=f"conv {side}x{side}x1 -> 3x3x{c1} -> 3x3x{c2}/2 -> {classes}, batch {batch}",
      init=functools.partial(models.init_conv, sizes=sizes),
      apply=models.apply_conv,
      make_batch=functools.partial(_classifier_batch, shape=(batch, side, side, 1),
                                   classes=classes),
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


def moe(batch: int, cfg: moe_models.MoEConfig) -> Workload:
  """The Mixture-of-Experts LM of :mod:`models.moe` (router, top-k, tokens
  sorted by expert, ``jax.lax.ragged_dot`` experts); GPU suite only."""
  return Workload(
      name="moe",
      description=f"{cfg.describe()}, batch {batch}",
      init=functools.partial(moe_models.init_moe, cfg=cfg),
      apply=functools.partial(moe_models.apply_moe, cfg=cfg),
      make_batch=functools.partial(_lm_batch, batch=batch, cfg=cfg),
      examples=batch,
      tokens=batch * cfg.seq_len,
      spec={"config": dataclasses.asdict(cfg), "batch": batch},
  )


_MLP = (784, 1024, 1024, 10)
_MLP_QUICK = (16, 32, 32, 10)
_LM_TINY = models.LMConfig(vocab=32, layers=1, width=16, heads=2, seq_len=8)
# 8 experts, top-2, the experts' dimensions multiples of 32 (every recipe
# applies to the grouped matmuls, MX's and FP4's 32-wide blocks included; the
# router's N = 8 experts keeps it out, as at the GPU size); 2 x 8 = 16 tokens,
# 32 token copies.
_MOE_TINY = moe_models.MoEConfig(vocab=32, layers=1, width=32, hidden=64, experts=8,
                                 seq_len=8)

#: The size table: every workload at every size, built on demand.
SIZES: dict[str, dict[str, Callable[[], Workload]]] = {
    "cpu": {
        "mlp": lambda: mlp(256, _MLP),
        "conv": lambda: conv(64, (28, 16, 32, 10)),
        # ResNet-18 depth, widths quartered, 32x32 images, batch 8: tens of
        # ms per step on 2 cores.
        "resnet": lambda: resnet(8, 32, models.ResNetConfig(
            blocks=(2, 2, 2, 2), widths=(16, 32, 64, 128), bottleneck=False,
            imagenet_stem=False, stem_width=16, classes=10)),
        "transformer": lambda: transformer(8, models.LMConfig(
            vocab=256, layers=2, width=128, heads=4, seq_len=64)),
    },
    "quick": {
        "mlp": lambda: mlp(8, _MLP_QUICK),
        "conv": lambda: conv(4, (8, 4, 8, 10)),
        "resnet": lambda: resnet(2, 8, models.ResNetConfig(
            blocks=(1, 1), widths=(4, 8), bottleneck=False, imagenet_stem=False,
            stem_width=4, classes=10)),
        "transformer": lambda: transformer(2, _LM_TINY),
        "moe": lambda: moe(2, _MOE_TINY),
    },
    "gpu": {
        "mlp": lambda: mlp(4096, (784, 4096, 4096, 4096, 10)),
        # ResNet-50 and GPT-2 small.
        "resnet": lambda: resnet(128, 224, models.ResNetConfig(
            blocks=(3, 4, 6, 3), widths=(64, 128, 256, 512), bottleneck=True,
            imagenet_stem=True, stem_width=64, classes=1000)),
        "transformer": lambda: transformer(8, models.LMConfig(
            vocab=50257, layers=12, width=768, heads=12, seq_len=1024)),
        # Mixtral-like MoE feed-forward at a single GPU's size: 4 layers of 8
        # experts (1024 -> 4096 -> 1024, GELU), top-2, 8 x 1024 = 8192
        # tokens per batch (16384 token copies through the experts).
        "moe": lambda: moe(8, moe_models.MoEConfig(
            vocab=32768, layers=4, width=1024, hidden=4096, experts=8, seq_len=1024)),
    },
    "tiny": {
        # The GPU shapes' code paths (bottleneck blocks, ImageNet stem, tied
        # embeddings) at the smallest size: one stage, one block, so that the
        # dry run's many compilations stay short on a CPU.
        # Batch 16: float8 matmuls need M, N and K multiples of 16, so that
        # the float8 modes run float8 matmuls at this size too.
        "mlp": lambda: mlp(16, _MLP_QUICK),
        "resnet": lambda: resnet(2, 16, models.ResNetConfig(
            blocks=(1,), widths=(4,), bottleneck=True, imagenet_stem=True,
            stem_width=4, classes=10)),
        "transformer": lambda: transformer(2, _LM_TINY),
        "moe": lambda: moe(2, _MOE_TINY),
    },
}


def make_workloads(size: str, names: tuple[str, ...] | list[str] = NAMES) -> list[Workload]:
  """The workloads ``names`` at ``size`` (a key of :data:`SIZES`), in that order."""
  if size not in SIZES:
    raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
  missing = [n for n in names if n not in SIZES[size]]
  if missing:
    raise ValueError(f"no workload {', '.join(missing)} at size {size!r}; "
                     f"it has {', '.join(SIZES[size])}")
  return [SIZES[size][name]() for name in names]


def policy(compute: str, matmul: str | None = None) -> jmp_lite.Policy:
  """Params and outputs float32, compute in ``compute`` (``"f16"``, ``"bf16"``...),
  matmuls in the float8 recipe ``matmul`` (``"fp8"``, ``"mxfp8"``...) if given."""
  spec = f"p=f32,c={compute},o=f32" + (f",m={matmul}" if matmul else "")
  return jmp_lite.get_policy(spec)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean cross-entropy in float32 over every position."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def loss_fn(workload: Workload, mode: str, policy: jmp_lite.Policy | None = None):  # pylint: disable=redefined-outer-name
  """``(params, batch) -> float32 loss`` for ``mode`` ``"f32"``, ``"policy"``,
  ``"autocast"`` or ``"with_policy"``."""

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
  if mode == "with_policy":
    apply = jmp_lite.with_policy(workload.apply, policy)

    def with_policy_loss(params: Params, batch: Batch) -> jax.Array:
      return cross_entropy(apply(params, batch["x"]), batch["y"])

    return with_policy_loss
  raise ValueError(f"unknown loss mode {mode!r}; choose from f32, policy, autocast, "
                   "with_policy")


def setup(workload: Workload, seed: int) -> tuple[Params, Batch]:
  """Float32 params and a fixed synthetic batch."""
  key_params, key_batch = jax.random.split(jax.random.PRNGKey(seed))
  return workload.init(key_params), workload.make_batch(key_batch)
