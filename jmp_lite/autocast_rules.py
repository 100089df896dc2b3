"""The vocabulary of autocast's per-operation rules.

``jmp_lite.autocast(fn, dtype, op_rules={primitive: rule})`` merges user
rules over :data:`DEFAULT_OP_RULES`. A rule is one of the names ``"lower"``
(run in the compute dtype), ``"f32"`` (run in float32), ``"promote"`` (run in
the widest dtype the inputs arrive in), ``"passthrough"`` (run as traced) and
``"recurse"`` (autocast the body of a higher-order primitive), or a callable ``rule(ctx, *args, **params)``
receiving an :class:`OpRuleContext`. (Per-module rules for Flax models are
``jmp_lite.linen.ModuleRules`` / ``jmp_lite.nnx.ModuleRules``.) The op lists
(which primitive runs in half precision, which in float32, which as it comes)
are documented, next to torch.autocast's, in ``docs/autocast.md``.

Example:
  >>> import jax, jmp_lite.autocast_rules as rules
  >>> rules.DEFAULT_OP_RULES[jax.lax.exp_p], rules.DEFAULT_OP_RULES[jax.lax.dot_general_p]
  ('f32', 'lower')
"""

from jmp_lite._src import checks as _checks
from jmp_lite._src.autocast.default_rules import DEFAULT_OP_RULES
from jmp_lite._src.autocast.rules import OpRuleContext

__all__ = ("DEFAULT_OP_RULES", "OpRuleContext")

#: Public names that went, and what replaced them (for one release).
_REMOVED = {
    "OP_RULE_NAMES": (
        "jmp_lite.autocast_rules.OP_RULE_NAMES was removed after 0.1.0: the rule "
        "names are the strings 'lower', 'f32', 'promote', 'passthrough' and "
        "'recurse' (see this module's docstring); the rules in use are the "
        "values of jmp_lite.autocast_rules.DEFAULT_OP_RULES."),
}

__getattr__ = _checks.old_names("jmp_lite.autocast_rules", removed=_REMOVED)
