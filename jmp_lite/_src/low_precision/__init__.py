"""Float8: formats, scaled quantizers and a float8 ``dot_general``.

The stateless core of jmp_lite's float8 support:

* :mod:`~jmp_lite._src.low_precision.formats`: the e4m3/e5m2 formats, saturating casts
  and E8M0 (MX) scales;
* :mod:`~jmp_lite._src.low_precision.scaling`: quantizers per tensor, row, tile, block
  and MX block (current scaling, or a given scale for delayed scaling), and
  the pure amax-history helpers of delayed scaling;
* :mod:`~jmp_lite._src.low_precision.recipes`: the recipes as data (a layer below the
  policy): :class:`Fp8Config`, the named recipes and their text, and the one
  granularity vocabulary;
* :mod:`~jmp_lite._src.low_precision.fp8_matmul`: :func:`fp8_dot_general`, the float8 matmul
  with its float8 backward pass.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jmp_lite._src import low_precision as fp8
  >>> matmul = jax.jit(lambda x, w: fp8.fp8_dot_general(
  ...     x, w, (((1,), (0,)), ((), ())), config=fp8.Fp8Config()))
  >>> matmul(jnp.ones((2, 16)), jnp.ones((16, 4)))[0, 0]
  Array(16., dtype=float32)
"""

from jmp_lite._src.low_precision.recipes import AMAX_ALGORITHMS
from jmp_lite._src.low_precision.recipes import Fp8Config
from jmp_lite._src.low_precision.recipes import GRANULARITIES
from jmp_lite._src.low_precision.recipes import MATMUL_GRANULARITIES
from jmp_lite._src.low_precision.recipes import SCALING_MODES
from jmp_lite._src.low_precision.formats import decode_e8m0
from jmp_lite._src.low_precision.formats import E4M3
from jmp_lite._src.low_precision.formats import E5M2
from jmp_lite._src.low_precision.formats import encode_e8m0
from jmp_lite._src.low_precision.formats import FORMAT_NAMES
from jmp_lite._src.low_precision.formats import Fp8Format
from jmp_lite._src.low_precision.formats import get_format
from jmp_lite._src.low_precision.formats import saturating_cast
from jmp_lite._src.low_precision.fp8_matmul import DelayedScales
from jmp_lite._src.low_precision.fp8_matmul import fp8_dot_general
from jmp_lite._src.low_precision.fp8_matmul import NATIVE_MX_CUSTOM_CALL
from jmp_lite._src.low_precision.scaling import dequantize
from jmp_lite._src.low_precision.scaling import quantize
from jmp_lite._src.low_precision.scaling import Quantized
from jmp_lite._src.low_precision.scaling import scale_from_amax
from jmp_lite._src.low_precision.scaling import scale_from_history
from jmp_lite._src.low_precision.scaling import update_amax_history

__all__ = (
    "AMAX_ALGORITHMS",
    "DelayedScales",
    "E4M3",
    "E5M2",
    "FORMAT_NAMES",
    "Fp8Config",
    "Fp8Format",
    "GRANULARITIES",
    "MATMUL_GRANULARITIES",
    "NATIVE_MX_CUSTOM_CALL",
    "Quantized",
    "SCALING_MODES",
    "decode_e8m0",
    "dequantize",
    "encode_e8m0",
    "fp8_dot_general",
    "get_format",
    "quantize",
    "saturating_cast",
    "scale_from_amax",
    "scale_from_history",
    "update_amax_history",
)
