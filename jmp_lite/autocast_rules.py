"""The vocabulary of autocast's per-operation rules.

``jmp_lite.autocast(fn, dtype, op_rules={primitive: rule})`` merges user
rules over :data:`DEFAULT_OP_RULES`. A rule is one of :data:`OP_RULE_NAMES`
or a callable ``rule(ctx, *args, **params)`` receiving an
:class:`OpRuleContext`. (Per-module rules for Flax models are
``jmp_lite.linen.ModuleRules`` / ``jmp_lite.nnx.ModuleRules``.) The op lists
(which primitive runs in half precision, which in float32, which as it comes)
are documented, next to torch.autocast's, in ``docs/autocast.md``.

Example:
  >>> import jax, jmp_lite.autocast_rules as rules
  >>> rules.DEFAULT_OP_RULES[jax.lax.exp_p], rules.DEFAULT_OP_RULES[jax.lax.dot_general_p]
  ('f32', 'lower')
  >>> "recurse" in rules.OP_RULE_NAMES
  True
"""

from jmp_lite._src.autocast.default_rules import DEFAULT_OP_RULES
from jmp_lite._src.autocast.rules import OP_RULE_NAMES
from jmp_lite._src.autocast.rules import OpRuleContext

__all__ = ("DEFAULT_OP_RULES", "OP_RULE_NAMES", "OpRuleContext")
