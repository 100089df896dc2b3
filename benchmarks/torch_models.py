"""The GPU suite's PyTorch side-by-side: the same MLP, ResNet and LM in PyTorch.

Imported only when ``import torch`` works (PyTorch is an optional,
benchmark-only dependency). Each model mirrors ``benchmarks/models.py`` layer
for layer (same shapes, manual attention with a causal mask, batch norm in
training mode, tied embeddings), so the step has the same matmul/conv FLOPs;
a case trains it with Adam under one of the suite's modes:

* ``f32``: TF32 off for matmuls and cuDNN convolutions;
* ``tf32``: TF32 on;
* ``bf16``: ``torch.autocast(device, torch.bfloat16)``, no scaler;
* ``f16``: ``torch.autocast(device, torch.float16)`` + ``torch.amp.GradScaler``
  (initial scale 2**15, growth every 2000 finite steps: the defaults of
  ``jmp_lite.DynamicLossScale``).

Models run eagerly (no ``torch.compile``), channels-last for the ResNet. On a
machine without CUDA, cases run on the CPU: that tests the code, its figures
mean nothing.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from benchmarks import models as jax_models

MODES = ("f32", "tf32", "bf16", "f16")
HALF_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
INITIAL_SCALE = 2.0**15


def _linear(din: int, dout: int, std: float) -> nn.Linear:
  """A linear layer initialised like ``benchmarks/models.py``: normal(std), zero bias."""
  layer = nn.Linear(din, dout)
  nn.init.normal_(layer.weight, std=std)
  nn.init.zeros_(layer.bias)
  return layer


class MLP(nn.Module):
  """ReLU MLP (``models.apply_mlp``)."""

  def __init__(self, sizes: tuple[int, ...]):
    super().__init__()
    self.layers = nn.ModuleList(
        _linear(a, b, 1 / math.sqrt(a)) for a, b in zip(sizes[:-1], sizes[1:]))

  def forward(self, x):
    for i, layer in enumerate(self.layers):
      x = layer(x)
      if i < len(self.layers) - 1:
        x = F.relu(x)
    return x


def _conv_bn(cin: int, cout: int, k: int, stride: int) -> nn.Sequential:
  """Convolution (He-normal, no bias; "SAME" padding) + batch norm."""
  conv = nn.Conv2d(cin, cout, k, stride, k // 2, bias=False)
  nn.init.normal_(conv.weight, std=math.sqrt(2.0 / (k * k * cin)))
  return nn.Sequential(conv, nn.BatchNorm2d(cout))


class Block(nn.Module):
  """Basic (3x3-3x3) or bottleneck (1x1-3x3-1x1) residual block."""

  def __init__(self, cin: int, width: int, stride: int, bottleneck: bool, project: bool):
    super().__init__()
    cout = 4 * width if bottleneck else width
    if bottleneck:
      self.body = nn.Sequential(
          _conv_bn(cin, width, 1, 1), nn.ReLU(), _conv_bn(width, width, 3, stride),
          nn.ReLU(), _conv_bn(width, cout, 1, 1))
    else:
      self.body = nn.Sequential(
          _conv_bn(cin, width, 3, stride), nn.ReLU(), _conv_bn(width, cout, 3, 1))
    self.proj = _conv_bn(cin, cout, 1, stride) if project else None

  def forward(self, x):
    shortcut = self.proj(x) if self.proj is not None else x
    return F.relu(self.body(x) + shortcut)


class ResNet(nn.Module):
  """ResNet (``models.apply_resnet``) on NCHW (channels-last) images."""

  def __init__(self, cfg: jax_models.ResNetConfig):
    super().__init__()
    k, s = (7, 2) if cfg.imagenet_stem else (3, 1)
    layers: list[nn.Module] = [_conv_bn(3, cfg.stem_width, k, s), nn.ReLU()]
    if cfg.imagenet_stem:
      layers.append(nn.MaxPool2d(3, 2, 1))
    cin = cfg.stem_width
    for stage, (width, count) in enumerate(zip(cfg.widths, cfg.blocks)):
      cout = 4 * width if cfg.bottleneck else width
      for i in range(count):
        stride = 2 if (i == 0 and stage > 0) else 1
        project = cin != cout or (i == 0 and stage > 0)
        layers.append(Block(cin, width, stride, cfg.bottleneck, project))
        cin = cout
    self.features = nn.Sequential(*layers)
    self.head = _linear(cin, cfg.classes, 1 / math.sqrt(cin))

  def forward(self, x):
    return self.head(self.features(x).mean(dim=(2, 3)))


class TransformerBlock(nn.Module):
  """Pre-LN block: causal attention and a 4x GELU MLP (``models.apply_block``)."""

  def __init__(self, d: int, heads: int):
    super().__init__()
    self.heads = heads
    self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
    self.qkv, self.out = _linear(d, 3 * d, 0.02), _linear(d, d, 0.02)
    self.fc, self.proj = _linear(d, 4 * d, 0.02), _linear(4 * d, d, 0.02)

  def forward(self, x, causal):
    b, t, d = x.shape
    q, k, v = self.qkv(self.ln1(x)).view(b, t, 3 * self.heads, d // self.heads).split(
        self.heads, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
    scores = scores.float().masked_fill(~causal, -1e9)
    weights = scores.softmax(-1).to(v.dtype)
    attn = torch.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
    x = x + self.out(attn)
    return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class LM(nn.Module):
  """Decoder-only LM with a tied output embedding (``models.apply_lm``)."""

  def __init__(self, cfg: jax_models.LMConfig):
    super().__init__()
    self.embed = nn.Embedding(cfg.vocab, cfg.width)
    nn.init.normal_(self.embed.weight, std=0.02)
    self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.width) * 0.01)
    self.blocks = nn.ModuleList(TransformerBlock(cfg.width, cfg.heads) for _ in range(cfg.layers))
    self.ln_f = nn.LayerNorm(cfg.width)
    self.register_buffer("causal", torch.ones(cfg.seq_len, cfg.seq_len, dtype=torch.bool).tril())

  def forward(self, tokens):
    t = tokens.shape[1]
    x = self.embed(tokens) + self.pos[:t]
    for block in self.blocks:
      x = block(x, self.causal[:t, :t])
    return self.ln_f(x) @ self.embed.weight.T


def make_model(kind: str, spec: dict[str, Any]) -> nn.Module:
  """The float32 model of a workload spec, on the default device.

  Args:
    kind: ``"mlp"``, ``"resnet"`` or ``"transformer"``.
    spec: the workload's shape as plain data (``Workload.spec`` in
      ``benchmarks/workloads.py``).

  Raises:
    ValueError: for an unknown ``kind``.
  """
  if kind == "mlp":
    return MLP(tuple(spec["sizes"]))
  if kind == "resnet":
    cfg = jax_models.ResNetConfig(**{k: tuple(v) if isinstance(v, list) else v
                                     for k, v in spec["config"].items()})
    return ResNet(cfg).to(memory_format=torch.channels_last)
  if kind == "transformer":
    return LM(jax_models.LMConfig(**spec["config"]))
  raise ValueError(f"unknown workload {kind!r}; choose from mlp, resnet, transformer")


def make_batch(kind: str, spec: dict[str, Any], seed: int = 0):
  """A synthetic batch ``(x, y)`` on the CPU: the shapes of the JAX workload's."""
  gen = torch.Generator(device="cpu").manual_seed(seed)
  if kind == "mlp":
    sizes, batch = spec["sizes"], spec["batch"]
    return (torch.randn(batch, sizes[0], generator=gen),
            torch.randint(0, sizes[-1], (batch,), generator=gen))
  if kind == "resnet":
    x = torch.randn(spec["batch"], 3, spec["image"], spec["image"], generator=gen)
    y = torch.randint(0, spec["config"]["classes"], (spec["batch"],), generator=gen)
    return x.contiguous(memory_format=torch.channels_last), y
  if kind == "transformer":
    cfg = spec["config"]
    tokens = torch.randint(0, cfg["vocab"], (spec["batch"], cfg["seq_len"] + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
  raise ValueError(f"unknown workload {kind!r}; choose from mlp, resnet, transformer")


def build(kind: str, spec: dict[str, Any], device: str, seed: int = 0):
  """The model and a synthetic batch ``(x, y)`` for a workload spec, on ``device``.

  Args:
    kind: ``"mlp"``, ``"resnet"`` or ``"transformer"``.
    spec: the workload's shape (``Workload.spec``).
    device: a torch device name, e.g. ``"cuda"`` or ``"cpu"``.
    seed: seeds the parameters and the batch.

  Returns:
    ``(model, x, y)``; params float32.
  """
  torch.manual_seed(seed)
  model = make_model(kind, spec)
  x, y = make_batch(kind, spec, seed)
  return model.to(device), x.to(device), y.to(device)


def set_tf32(enabled: bool) -> None:
  """Lets float32 matmuls and cuDNN convolutions use TF32 (or forbids it).

  PyTorch >= 2.9 has ``fp32_precision`` settings and raises if they are mixed
  with the legacy ``allow_tf32`` flags in one process, so exactly one of the
  two APIs is used: the new one where it exists.
  """
  cudnn_conv = getattr(torch.backends.cudnn, "conv", None)
  if hasattr(torch.backends, "fp32_precision") and hasattr(cudnn_conv, "fp32_precision"):
    precision = "tf32" if enabled else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    cudnn_conv.fp32_precision = precision
  else:
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def default_device() -> str:
  """``"cuda"`` when PyTorch sees a CUDA device, else ``"cpu"``."""
  return "cuda" if torch.cuda.is_available() else "cpu"


def run_case(kind: str, spec: dict[str, Any], mode: str, steps: int,
             device: str | None = None, warmup: int = 3, seed: int = 0) -> dict[str, Any]:
  """Trains one workload under one mode and times it.

  Args:
    kind: ``"mlp"``, ``"resnet"`` or ``"transformer"``.
    spec: the workload's shape (``Workload.spec``).
    mode: ``"f32"``, ``"tf32"``, ``"bf16"`` or ``"f16"`` (see the module doc).
    steps: timed steps, each waited for; the median is reported.
    device: ``"cuda"`` or ``"cpu"`` (default: CUDA when available). On the
      CPU the TF32 settings do nothing and no peak memory is reported: that
      is for testing the code, not for figures.
    warmup: untimed steps first (cuDNN autotuning, allocator warm-up).
    seed: seeds the parameters and the batch.

  Returns:
    A JSON-able dict: ``step_time_s`` (median), every step time,
    ``peak_bytes`` (CUDA: ``max_memory_allocated`` over the timed steps, which
    includes params and optimizer state), the final loss and loss scale, the
    number of steps ``GradScaler`` skipped, the torch version and device.

  Raises:
    ValueError: for an unknown ``mode`` or ``kind``.
  """
  if mode not in MODES:
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
  device = device or default_device()
  cuda = device.startswith("cuda")
  set_tf32(mode == "tf32")
  torch.backends.cudnn.benchmark = True
  model, x, y = build(kind, spec, device, seed)
  model.train()
  opt = torch.optim.Adam(model.parameters(), lr=1e-3)
  dtype = HALF_DTYPES.get(mode)
  device_type = device.split(":")[0]
  scaler = torch.amp.GradScaler(device_type, init_scale=INITIAL_SCALE, enabled=mode == "f16")

  def sync() -> None:
    if cuda:
      torch.cuda.synchronize(device)

  def step() -> torch.Tensor:
    with torch.autocast(device_type, dtype, enabled=dtype is not None):
      logits = model(x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss.detach()

  skipped = 0

  def count_skipped(scale_before: float | None) -> None:
    # GradScaler lowers the scale exactly when it skipped the step.
    nonlocal skipped
    if scale_before is not None:
      skipped += int(scaler.get_scale() < scale_before)

  def current_scale() -> float | None:
    return scaler.get_scale() if scaler.is_enabled() else None

  for _ in range(warmup):
    before = current_scale()
    step()
    count_skipped(before)
  sync()
  if cuda:
    torch.cuda.reset_peak_memory_stats(device)
  times = []
  for _ in range(steps):
    before = current_scale()
    start = time.perf_counter()
    loss = step()
    sync()
    times.append(time.perf_counter() - start)
    count_skipped(before)
  return {
      "mode": mode,
      "step_time_s": float(np.median(times)),
      "step_times_s": [float(t) for t in times],
      "peak_bytes": int(torch.cuda.max_memory_allocated(device)) if cuda else None,
      "final_loss": float(loss),
      "loss_scale": float(scaler.get_scale()) if scaler.is_enabled() else None,
      "skipped_steps": skipped,
      "torch": torch.__version__,
      "device": torch.cuda.get_device_name(device) if cuda else device,
  }
