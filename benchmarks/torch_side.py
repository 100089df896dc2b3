"""The GPU suite's PyTorch side-by-side: the JAX workloads in PyTorch, under torch.amp.

Imported only when ``import torch`` works (PyTorch is an optional,
benchmark-only dependency: the ``bench`` extra). Each model mirrors
``models/jax_models.py`` layer for layer (same shapes and initialisation,
manual attention with a float32 softmax, batch norm in training mode, tied
embeddings), so a step has the same matmul/conv FLOPs and parameters; a case
trains it eagerly with Adam under one of the suite's modes:

* ``f32``: TF32 off for matmuls and cuDNN convolutions; ``tf32``: TF32 on;
* ``bf16``: ``torch.autocast(device, torch.bfloat16)``, no scaler;
* ``f16``: ``torch.autocast(device, torch.float16)`` + ``torch.amp.GradScaler``
  (initial scale 2**15, growth every 2000 finite steps: the defaults of
  ``jmp_lite.DynamicLossScale``);
* ``fp8`` / ``fp8_rowwise``: torchao's float8 training
  (``torchao.float8.convert_to_float8_training`` with the recipe
  ``"tensorwise"`` / ``"rowwise"``) under ``torch.autocast(device,
  torch.bfloat16)``. Converted: every ``nn.Linear`` whose dimensions are
  multiples of 16 (torchao's requirement), except the MLP's output layer; the
  LM's head is its tied embedding, no ``nn.Linear``. jmp_lite's float8
  policies keep the same matmuls out. Eager, like the other modes (torchao
  recommends ``torch.compile`` for its float8 speed: these rows are a lower
  bound). Needs torchao; the GPU suite skips them, with the reason, without it.

Without CUDA, cases run on the CPU: that tests the code, its figures mean
nothing.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from models import jax_models

HALF_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16,
               "fp8": torch.bfloat16, "fp8_rowwise": torch.bfloat16}
#: torchao's float8 training recipes, by mode.
TORCHAO_RECIPES = {"fp8": "tensorwise", "fp8_rowwise": "rowwise"}
INITIAL_SCALE = 2.0**15


def _linear(din: int, dout: int, std: float) -> nn.Linear:
  """Initialised like ``jax_models``: normal(std) weights, zero bias."""
  layer = nn.Linear(din, dout)
  nn.init.normal_(layer.weight, std=std)
  nn.init.zeros_(layer.bias)
  return layer


def _conv_bn(cin: int, cout: int, k: int, stride: int) -> nn.Sequential:
  """He-normal convolution without bias ("SAME" padding) and batch norm."""
  conv = nn.Conv2d(cin, cout, k, stride, k // 2, bias=False)
  nn.init.normal_(conv.weight, std=math.sqrt(2.0 / (k * k * cin)))
  return nn.Sequential(conv, nn.BatchNorm2d(cout))


class Residual(nn.Module):
  """A ResNet block: ``relu(body(x) + shortcut(x))``."""

  def __init__(self, body: nn.Module, shortcut: nn.Module | None):
    super().__init__()
    self.body, self.shortcut = body, shortcut or nn.Identity()

  def forward(self, x):
    return F.relu(self.body(x) + self.shortcut(x))


def resnet(cfg: jax_models.ResNetConfig) -> nn.Sequential:
  """``jax_models.apply_resnet`` (basic or bottleneck blocks), channels last."""
  k, s = (7, 2) if cfg.imagenet_stem else (3, 1)
  layers: list[nn.Module] = [_conv_bn(3, cfg.stem_width, k, s), nn.ReLU()]
  if cfg.imagenet_stem:
    layers.append(nn.MaxPool2d(3, 2, 1))
  cin = cfg.stem_width
  for stage, (width, count) in enumerate(zip(cfg.widths, cfg.blocks)):
    cout = 4 * width if cfg.bottleneck else width
    for i in range(count):
      stride = 2 if (i == 0 and stage > 0) else 1
      if cfg.bottleneck:
        body = [_conv_bn(cin, width, 1, 1), nn.ReLU(), _conv_bn(width, width, 3, stride),
                nn.ReLU(), _conv_bn(width, cout, 1, 1)]
      else:
        body = [_conv_bn(cin, width, 3, stride), nn.ReLU(), _conv_bn(width, cout, 3, 1)]
      project = cin != cout or (i == 0 and stage > 0)
      layers.append(Residual(nn.Sequential(*body),
                             _conv_bn(cin, cout, 1, stride) if project else None))
      cin = cout
  layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(),
             _linear(cin, cfg.classes, 1 / math.sqrt(cin))]
  return nn.Sequential(*layers).to(memory_format=torch.channels_last)


class LM(nn.Module):
  """``jax_models.apply_lm``: pre-LN blocks, causal attention with a float32
  softmax, a 4x GELU MLP, tied output embedding."""

  def __init__(self, cfg: jax_models.LMConfig):
    super().__init__()
    d, self.heads = cfg.width, cfg.heads
    self.embed = nn.Embedding(cfg.vocab, d)
    nn.init.normal_(self.embed.weight, std=0.02)
    self.pos = nn.Parameter(torch.randn(cfg.seq_len, d) * 0.01)
    self.blocks = nn.ModuleList(nn.ModuleDict({
        "ln1": nn.LayerNorm(d), "qkv": _linear(d, 3 * d, 0.02), "out": _linear(d, d, 0.02),
        "ln2": nn.LayerNorm(d), "fc": _linear(d, 4 * d, 0.02),
        "proj": _linear(4 * d, d, 0.02)}) for _ in range(cfg.layers))
    self.ln_f = nn.LayerNorm(d)
    self.register_buffer("causal", torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).tril())

  def forward(self, tokens):
    b, t = tokens.shape
    x = self.embed(tokens) + self.pos[:t]
    d = x.shape[-1]
    for p in self.blocks:
      q, k, v = p["qkv"](p["ln1"](x)).view(b, t, 3 * self.heads, d // self.heads).split(
          self.heads, dim=2)
      scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
      weights = scores.float().masked_fill(~self.causal[:t, :t], -1e9).softmax(-1)
      attn = torch.einsum("bhqk,bkhd->bqhd", weights.to(v.dtype), v).reshape(b, t, d)
      x = x + p["out"](attn)
      x = x + p["proj"](F.gelu(p["fc"](p["ln2"](x)), approximate="tanh"))
    return self.ln_f(x) @ self.embed.weight.T


def make_model(kind: str, spec: dict[str, Any]) -> nn.Module:
  """The float32 model of a workload spec (``Workload.spec``), on the default device.

  Raises:
    ValueError: for an unknown ``kind``.
  """
  if kind == "mlp":
    sizes = spec["sizes"]
    layers = [m for a, b in zip(sizes[:-1], sizes[1:])
              for m in (_linear(a, b, 1 / math.sqrt(a)), nn.ReLU())]
    return nn.Sequential(*layers[:-1])
  if kind == "resnet":
    return resnet(jax_models.ResNetConfig(**{k: tuple(v) if isinstance(v, list) else v
                                             for k, v in spec["config"].items()}))
  if kind == "transformer":
    return LM(jax_models.LMConfig(**spec["config"]))
  raise ValueError(f"unknown workload {kind!r}; choose from mlp, resnet, transformer")


def make_batch(kind: str, spec: dict[str, Any], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
  """A synthetic batch ``(x, y)`` on the CPU: the shapes of the JAX workload's."""
  gen = torch.Generator().manual_seed(seed)
  batch = spec["batch"]
  if kind == "transformer":
    cfg = spec["config"]
    tokens = torch.randint(0, cfg["vocab"], (batch, cfg["seq_len"] + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
  if kind == "resnet":
    x = torch.randn(batch, 3, spec["image"], spec["image"], generator=gen)
    return (x.contiguous(memory_format=torch.channels_last),
            torch.randint(0, spec["config"]["classes"], (batch,), generator=gen))
  sizes = spec["sizes"]
  return (torch.randn(batch, sizes[0], generator=gen),
          torch.randint(0, sizes[-1], (batch,), generator=gen))


def convert_to_float8(model: nn.Module, kind: str, mode: str) -> list[str]:
  """Swaps ``model``'s eligible ``nn.Linear`` layers for torchao's float8
  ones (recipe ``TORCHAO_RECIPES[mode]``), in place; returns their names."""
  # pylint: disable=import-outside-toplevel
  from torchao.float8 import Float8LinearConfig
  from torchao.float8 import convert_to_float8_training
  linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
  head = linears[-1] if kind == "mlp" else None  # the LM's head is no nn.Linear

  def eligible(module: nn.Module, fqn: str) -> bool:
    return (isinstance(module, nn.Linear) and fqn != head
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)

  config = Float8LinearConfig.from_recipe_name(TORCHAO_RECIPES[mode])
  converted = [name for name in linears if eligible(model.get_submodule(name), name)]
  convert_to_float8_training(model, config=config, module_filter_fn=eligible)
  return converted


def set_tf32(enabled: bool) -> None:
  """Lets float32 matmuls and cuDNN convolutions use TF32 (or forbids it).

  PyTorch >= 2.9 has ``fp32_precision`` settings and raises if they are mixed
  with the legacy ``allow_tf32`` flags in one process, so exactly one of the
  two APIs is used: the new one where it exists.
  """
  cudnn_conv = getattr(torch.backends.cudnn, "conv", None)
  if hasattr(torch.backends, "fp32_precision") and hasattr(cudnn_conv, "fp32_precision"):
    torch.backends.cuda.matmul.fp32_precision = cudnn_conv.fp32_precision = (
        "tf32" if enabled else "ieee")
  else:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled


def run_case(kind: str, spec: dict[str, Any], mode: str, steps: int, warmup: int,
             seed: int) -> dict[str, Any]:
  """Trains one workload under one mode, timing ``steps`` steps one by one.

  Returns:
    A JSON-able dict: ``step_time_s`` (median) and every step time,
    ``peak_bytes`` (CUDA: ``max_memory_allocated`` over the timed steps), the
    final loss and loss scale, the steps ``GradScaler`` skipped, the torch
    version and the device.
  """
  if mode not in ("f32", "tf32", *HALF_DTYPES):
    raise ValueError(f"unknown mode {mode!r} for the PyTorch side; choose from f32, tf32, "
                     f"{', '.join(HALF_DTYPES)}")
  device = "cuda" if torch.cuda.is_available() else "cpu"
  set_tf32(mode == "tf32")
  torch.backends.cudnn.benchmark = True
  torch.manual_seed(seed)
  model = make_model(kind, spec).to(device).train()
  float8_layers = (convert_to_float8(model, kind, mode) if mode in TORCHAO_RECIPES
                   else None)
  x, y = (t.to(device) for t in make_batch(kind, spec, seed))
  opt = torch.optim.Adam(model.parameters(), lr=1e-3)
  dtype = HALF_DTYPES.get(mode)
  scaler = torch.amp.GradScaler(device, init_scale=INITIAL_SCALE, enabled=mode == "f16")
  skipped, times = 0, []
  for i in range(warmup + steps):
    if i == warmup and device == "cuda":
      torch.cuda.synchronize()
      torch.cuda.reset_peak_memory_stats()
    scale, start = scaler.get_scale(), time.perf_counter()
    with torch.autocast(device, dtype, enabled=dtype is not None):
      logits = model(x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    if device == "cuda":
      torch.cuda.synchronize()
    if i >= warmup:
      times.append(time.perf_counter() - start)
    skipped += int(scaler.get_scale() < scale)  # GradScaler backs off exactly on a skip.
  return {
      "mode": mode,
      "step_time_s": float(np.median(times)),
      "step_times_s": [float(t) for t in times],
      "peak_bytes": int(torch.cuda.max_memory_allocated()) if device == "cuda" else None,
      "final_loss": float(loss),
      "loss_scale": float(scaler.get_scale()) if scaler.is_enabled() else None,
      "skipped_steps": skipped,
      "torch": torch.__version__,
      "float8_layers": float8_layers,
      "torchao": _torchao_version() if mode in TORCHAO_RECIPES else None,
      "device": torch.cuda.get_device_name() if device == "cuda" else device,
  }


def _torchao_version() -> str:
  import torchao  # pylint: disable=import-outside-toplevel
  return torchao.__version__
