"""The vocabulary of autocast's per-operation rules.

``jmp_lite.autocast(fn, dtype, rules={primitive: rule})`` merges user rules
over :data:`DEFAULT_RULES`. A rule is one of :data:`RULE_NAMES` or a callable
``rule(ctx, *args, **params)`` receiving a :class:`RuleContext`. The op lists
(which primitive runs in half precision, which in float32, which as it comes)
are documented, next to torch.autocast's, in ``docs/autocast.md``.

Example:
  >>> import jax, jmp_lite.autocast_rules as rules
  >>> rules.DEFAULT_RULES[jax.lax.exp_p], rules.DEFAULT_RULES[jax.lax.dot_general_p]
  ('f32', 'lower')
  >>> "recurse" in rules.RULE_NAMES
  True
"""

from jmp_lite._src.autocast.rules import RULE_NAMES
from jmp_lite._src.autocast.rules import RuleContext
from jmp_lite._src.autocast.table import DEFAULT_RULES

__all__ = ("DEFAULT_RULES", "RULE_NAMES", "RuleContext")
