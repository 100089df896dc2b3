"""The GPU suite's PyTorch side-by-side: the same MLP, ResNet and LM in PyTorch.

Imported only when ``import torch`` works. Each model mirrors
``benchmarks/models.py`` layer for layer (same shapes, manual attention with a
causal mask, batch norm in training mode, tied embeddings); a case trains it
with Adam under one of the suite's modes:

* ``f32``: ``allow_tf32 = False`` for matmuls and cuDNN;
* ``tf32``: ``allow_tf32 = True``;
* ``bf16``: ``torch.autocast("cuda", torch.bfloat16)``, no scaler;
* ``f16``: ``torch.autocast("cuda", torch.float16)`` + ``torch.amp.GradScaler``.

Models run eagerly (no ``torch.compile``), channels-last for the ResNet.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from benchmarks import models as jax_models


class MLP(nn.Module):

  def __init__(self, sizes: tuple[int, ...]):
    super().__init__()
    self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

  def forward(self, x):
    for i, layer in enumerate(self.layers):
      x = layer(x)
      if i < len(self.layers) - 1:
        x = F.relu(x)
    return x


def _conv_bn(cin: int, cout: int, k: int, stride: int) -> nn.Sequential:
  return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout))


class Block(nn.Module):

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
    self.head = nn.Linear(cin, cfg.classes)

  def forward(self, x):
    return self.head(self.features(x).mean(dim=(2, 3)))


class TransformerBlock(nn.Module):

  def __init__(self, d: int, heads: int):
    super().__init__()
    self.heads = heads
    self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
    self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
    self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

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

  def __init__(self, cfg: jax_models.LMConfig):
    super().__init__()
    self.embed = nn.Embedding(cfg.vocab, cfg.width)
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


def build(kind: str, spec: dict[str, Any], device: str):
  """The model and a synthetic batch ``(x, y)`` for a workload spec."""
  gen = torch.Generator(device="cpu").manual_seed(0)
  if kind == "mlp":
    sizes, batch = tuple(spec["sizes"]), spec["batch"]
    model = MLP(sizes)
    x = torch.randn(batch, sizes[0], generator=gen)
    y = torch.randint(0, sizes[-1], (batch,), generator=gen)
  elif kind == "resnet":
    cfg = jax_models.ResNetConfig(**{k: tuple(v) if isinstance(v, list) else v
                                     for k, v in spec["config"].items()})
    model = ResNet(cfg).to(memory_format=torch.channels_last)
    x = torch.randn(spec["batch"], 3, spec["image"], spec["image"], generator=gen)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, cfg.classes, (spec["batch"],), generator=gen)
  elif kind == "transformer":
    cfg = jax_models.LMConfig(**spec["config"])
    model = LM(cfg)
    tokens = torch.randint(0, cfg.vocab, (spec["batch"], cfg.seq_len + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]
  else:
    raise ValueError(f"unknown workload {kind!r}")
  return model.to(device), x.to(device), y.to(device)


def run_case(kind: str, spec: dict[str, Any], mode: str, steps: int) -> dict[str, Any]:
  """Trains ``steps`` timed steps (after warm-up) under ``mode``; returns figures."""
  device = "cuda"
  torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
  torch.backends.cudnn.allow_tf32 = mode == "tf32"
  torch.backends.cudnn.benchmark = True
  model, x, y = build(kind, spec, device)
  opt = torch.optim.Adam(model.parameters(), lr=1e-3)
  dtype = {"bf16": torch.bfloat16, "f16": torch.float16}.get(mode)
  scaler = torch.amp.GradScaler("cuda", init_scale=2.0**15, enabled=mode == "f16")

  def step():
    ctx = torch.autocast("cuda", dtype) if dtype is not None else contextlib.nullcontext()
    with ctx:
      logits = model(x)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss

  for _ in range(3):
    step()
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    loss = step()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
  return {
      "step_time_s": float(np.median(times)),
      "step_times_s": [float(t) for t in times],
      "peak_bytes": int(torch.cuda.max_memory_allocated()),
      "final_loss": float(loss),
      "torch": torch.__version__,
  }
