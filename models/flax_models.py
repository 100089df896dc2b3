"""Flax models and data shared by the examples and the benchmarks.

Nothing here knows about precision: these are ordinary, unmodified Flax models
that jmp_lite's ``jmp_lite.linen.apply_policy`` / ``jmp_lite.nnx.apply_policy``
turn into mixed-precision ones.

* :class:`DigitsMLP`: a linen MLP (64 -> 256 -> 256 -> 10) for flat digits.
* :class:`DigitsCNN`: a small linen CNN with BatchNorm for 8x8 digit images.
* :class:`CharLM`: a small NNX decoder-only transformer over bytes.
* :func:`load_digits_data`: scikit-learn's digits, a fixed 1437/360 split;
  :func:`load_flat_digits`: the same as flat pixel vectors, in a dict.
* :func:`load_stdlib_text`: text from the Python standard library's sources.
* :func:`char_vocab` / :func:`encode` / :func:`decode`: the byte-level
  vocabulary. Text is encoded as its UTF-8 bytes, so the vocabulary always has
  256 entries and any string round-trips.
"""

from __future__ import annotations

import glob
import os

from flax import nnx
import flax.linen as nn
import jax.numpy as jnp
import numpy as np

DIGITS_TEST_SIZE = 360  # 1797 digits: 1437 to train on, 360 to test on.
SPLIT_SEED = 0  # The train/test split is fixed; examples' --seed changes the rest.
BYTE_VOCAB_SIZE = 256


class DigitsMLP(nn.Module):
  """A small multi-layer perceptron: 64 -> 256 -> 256 -> 10 with relu."""

  hidden: int = 256
  num_classes: int = 10

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.hidden)(x))
    x = nn.relu(nn.Dense(self.hidden)(x))
    return nn.Dense(self.num_classes)(x)


class DigitsCNN(nn.Module):
  """Conv 32 3x3 -> BN -> relu -> Conv 64 3x3/2 -> BN -> relu -> 128 -> 10.

  Call it as ``model.apply(variables, x, train=True, mutable=["batch_stats"])``
  to train (batch statistics, running averages updated) and as
  ``model.apply(variables, x, train=False)`` to evaluate. ``x`` has shape
  ``(N, 8, 8, 1)``; the result is ``(N, num_classes)`` logits.

  Attributes:
    num_classes: number of output logits.
  """

  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.Conv(32, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.relu(x)
    x = nn.Conv(64, (3, 3), strides=(2, 2))(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.relu(x)
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(128)(x))
    return nn.Dense(self.num_classes)(x)


def causal_attention(query, key, value, mask=None, **unused_kwargs):
  """Scaled dot-product attention; the softmax runs in float32.

  Matmuls run in the dtype of ``query``/``key``/``value`` (the compute dtype
  under a policy); the logits are cast to float32 for the mask and the
  softmax, and the weights back to the value dtype. A drop-in
  ``attention_fn`` for ``nnx.MultiHeadAttention`` (without dropout). Flax's
  default ``attention_fn`` calls ``jax.nn.dot_product_attention``, which on
  CPU (jax 0.10.2) fails to lower float16 inputs (it asks for the
  ``F16_F16_F32`` dot algorithm, which the CPU backend does not support).

  Args:
    query: ``(B, T, H, D)``.
    key: ``(B, S, H, D)``.
    value: ``(B, S, H, D)``.
    mask: boolean, broadcastable to ``(B, H, T, S)``; True where attending.
    **unused_kwargs: the other arguments Flax passes (dropout, dtype...).

  Returns:
    ``(B, T, H, D)`` in the dtype of ``value``.
  """
  scale = jnp.asarray(1.0 / np.sqrt(query.shape[-1]), query.dtype)
  logits = jnp.einsum("bthd,bshd->bhts", query * scale, key)
  logits = logits.astype(jnp.float32)
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  weights = nnx.softmax(logits, axis=-1).astype(value.dtype)
  return jnp.einsum("bhts,bshd->bthd", weights, value)


class Block(nnx.Module):
  """A pre-LayerNorm transformer block: causal self-attention, then a 4x MLP."""

  def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
        num_heads=num_heads, in_features=d_model, decode=False,
        attention_fn=causal_attention, rngs=rngs
    )
    self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
    self.up = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
    self.down = nnx.Linear(4 * d_model, d_model, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class CharLM(nnx.Module):
  """A small decoder-only transformer language model.

  Token and learned position embeddings, ``num_layers`` pre-LayerNorm blocks
  (causal multi-head self-attention with :func:`causal_attention`, and a 4x
  gelu MLP), a final LayerNorm and an output projection. ``model(tokens)``
  maps int tokens ``(N, T)``, with ``T <= max_len``, to logits
  ``(N, T, vocab_size)``.

  Args:
    vocab_size: number of token ids (256 for :func:`encode`'s bytes).
    d_model: width of the residual stream.
    num_heads: attention heads per block.
    num_layers: number of blocks.
    max_len: longest sequence (number of position embeddings).
    rngs: the parameter initialisation keys.
  """

  def __init__(self, vocab_size: int, *, d_model: int = 128,
               num_heads: int = 4, num_layers: int = 2, max_len: int = 128,
               rngs: nnx.Rngs):
    self.max_len = max_len
    self.tok_embed = nnx.Embed(vocab_size, d_model, rngs=rngs)
    self.pos_embed = nnx.Embed(max_len, d_model, rngs=rngs)
    self.blocks = nnx.List(
        [Block(d_model, num_heads, rngs=rngs) for _ in range(num_layers)]
    )
    self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
    self.head = nnx.Linear(d_model, vocab_size, rngs=rngs)

  def __call__(self, tokens):
    length = tokens.shape[-1]
    if length > self.max_len:
      raise ValueError(f"sequence length {length} > max_len {self.max_len}")
    x = self.tok_embed(tokens) + self.pos_embed(jnp.arange(length))
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.ln_f(x))


def load_digits_data(seed: int = 0):
  """Loads scikit-learn's digits (bundled, no download), split 1437/360.

  Args:
    seed: the seed of the stratified train/test split.

  Returns:
    ``(x_train, y_train, x_test, y_test)``: float32 images scaled to [0, 1] of
    shape ``(n, 8, 8, 1)`` and int32 labels.
  """
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  from sklearn.model_selection import train_test_split  # pylint: disable=g-import-not-at-top

  digits = load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  x_train, x_test, y_train, y_test = train_test_split(
      x, y, test_size=DIGITS_TEST_SIZE, random_state=seed, stratify=y
  )
  return x_train, y_train, x_test, y_test


def flat_digits(x_train, y_train, x_test, y_test) -> dict[str, np.ndarray]:
  """The digits split (as :func:`load_digits_data` returns it) as
  a dict of flat pixel vectors.

  Returns:
    ``x_train``, ``y_train``, ``x_test``, ``y_test``: float32 pixels in
    [0, 1], shape ``(n, 64)``, and int32 labels.
  """
  return dict(x_train=x_train.reshape(len(x_train), -1), y_train=y_train,
              x_test=x_test.reshape(len(x_test), -1), y_test=y_test)



def load_flat_digits() -> dict[str, np.ndarray]:
  """scikit-learn's digits (bundled with it, no download), split 1437/360.

  Returns:
    ``x_train``, ``y_train``, ``x_test``, ``y_test``: float32 pixels scaled to
    [0, 1] (shape ``(n, 64)``) and int32 labels. The split is stratified and
    always the same.
  """
  return flat_digits(*load_digits_data(SPLIT_SEED))


def load_stdlib_text(max_chars: int = 2_000_000) -> str:
  """Text of the Python standard library's own ``*.py`` files (no download).

  The top-level ``*.py`` files of the directory holding ``os.py`` are read in
  sorted order as UTF-8 (undecodable bytes dropped) and concatenated, so the
  result is the same on every run of the same Python.

  Args:
    max_chars: the text is truncated to this many characters.

  Returns:
    The text, at most ``max_chars`` characters.
  """
  stdlib = os.path.dirname(os.__file__)
  parts, total = [], 0
  for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
    with open(path, encoding="utf-8", errors="ignore") as f:
      parts.append(f.read())
    total += len(parts[-1])
    if total >= max_chars:
      break
  return "".join(parts)[:max_chars]


def char_vocab(text: str):
  """The byte-level vocabulary: every text maps to its UTF-8 bytes.

  Args:
    text: unused beyond a type check; the vocabulary does not depend on it,
      so any string (including generated ones) can be encoded.

  Returns:
    ``(stoi, vocab_size)``: ``stoi`` maps a byte value to its token id (the
    identity on 0..255, as an int32 array) and ``vocab_size`` is 256.
  """
  if not isinstance(text, str):
    raise TypeError(f"char_vocab expects a str, got {type(text).__name__}")
  return np.arange(BYTE_VOCAB_SIZE, dtype=np.int32), BYTE_VOCAB_SIZE


def encode(text: str) -> np.ndarray:
  """The token ids of ``text``: its UTF-8 bytes, as int32."""
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode(tokens) -> str:
  """The text of byte token ids (invalid UTF-8 replaced by U+FFFD)."""
  return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode(
      "utf-8", errors="replace"
  )
