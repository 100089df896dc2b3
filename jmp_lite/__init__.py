"""jmp_lite: mixed precision for JAX, Flax and optax.

Immutable precision policies, loss scaling that lives inside the optimizer,
operation-level autocast, and the precision controls large models need. A
drop-in successor to DeepMind's jmp: ``import jmp_lite as jmp`` runs code
written for jmp.

Example:
  >>> import jax.numpy as jnp, optax, jmp_lite
  >>> policy = jmp_lite.get_policy("params=f32,compute=f16,output=f32")
  >>> opt = jmp_lite.loss_scaling(optax.adam(1e-3), jmp_lite.DynamicLossScale(2.0**15))
"""

# pylint: disable=g-importing-member
from jmp_lite._src import checks as _checks
from jmp_lite._src import parallel as _parallel
# jmp's API (drop-in).
from jmp_lite._src.dtypes import half_dtype
from jmp_lite._src.loss_scale import DynamicLossScale
from jmp_lite._src.loss_scale import LossScale
from jmp_lite._src.loss_scale import NoOpLossScale
from jmp_lite._src.loss_scale import StaticLossScale
from jmp_lite._src.policy import cast_to_full
from jmp_lite._src.policy import cast_to_half
from jmp_lite._src.policy import get_policy
from jmp_lite._src.policy import Policy
from jmp_lite._src.tree import all_finite
from jmp_lite._src.tree import select_tree
# Policies on functions, float32 islands.
from jmp_lite._src.apply import in_float32
from jmp_lite._src.apply import with_policy
# The optimizer side.
from jmp_lite._src.loss_scaling import get_loss_scale
from jmp_lite._src.loss_scaling import loss_scaling
from jmp_lite._src.loss_scaling import LossScaleState
from jmp_lite._src.loss_scaling import scaled_value_and_grad
from jmp_lite._src.master_weights import get_master_params
from jmp_lite._src.master_weights import master_weights
from jmp_lite._src.master_weights import with_state_dtype
from jmp_lite._src.parallel import pmean_value_and_grad
from jmp_lite._src.residuals import save_half_residuals
# Operation-level precision.
from jmp_lite._src.autocast import autocast
from jmp_lite._src.autocast import op_dtypes

# The diagnostics layer (jit-side statistics; advice and report on the host)
# as a public submodule: jmp_lite.diagnostics.tensor_stats(...).
from jmp_lite import diagnostics  # noqa: E402,F401  pylint: disable=g-bad-import-order
# Float8 recipes and the float8 matmul: jmp_lite.fp8.Fp8Config(...).
from jmp_lite import fp8  # noqa: E402,F401  pylint: disable=g-bad-import-order

__version__ = "0.1.0"

__all__ = (
    "DynamicLossScale",
    "LossScale",
    "LossScaleState",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "autocast",
    "cast_to_full",
    "cast_to_half",
    "get_loss_scale",
    "get_master_params",
    "get_policy",
    "half_dtype",
    "in_float32",
    "loss_scaling",
    "master_weights",
    "op_dtypes",
    "pmean_value_and_grad",
    "save_half_residuals",
    "scaled_value_and_grad",
    "select_tree",
    "with_policy",
    "with_state_dtype",
)

# The old spellings (deprecated: they go in a later release).
__getattr__ = _checks.old_names("jmp_lite", renamed={
    "grouped_value_and_grad": (
        "jmp_lite.pmean_value_and_grad(value_and_grad_fn, num_groups=...) "
        "(the same float32 reduction under jax.jit, same results)",
        _parallel.grouped_value_and_grad),
})
