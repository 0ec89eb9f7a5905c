"""``OperationContext``: what an operation's forward keeps for its backward.

Arrays (and pytrees of arrays: ``ScaledTensor``, ``QuantizerSet``, residual tuples) go through
``save_for_backward``; every other attribute set on the context is a static fact (a config, a
shape, a flag). The context is a pytree whose children are the saved values and whose static
data are the facts, so a ``Sequential``'s contexts cross its ``custom_vjp`` as its residuals.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["OperationContext"]

_OWN = ("_saved", "_facts")


def _is_array(leaf) -> bool:
    return isinstance(leaf, jax.Array) or hasattr(leaf, "__jax_array__")


@jax.tree_util.register_pytree_node_class
class OperationContext:
    """The forward's record for one basic operation's backward.

    ``ctx.save_for_backward(*values)`` keeps arrays (or pytrees of them) and
    ``ctx.saved_tensors`` returns them; ``ctx.name = value`` records a static fact (hashable
    Python data: no arrays, which must be saved). ``ctx.training`` says whether a backward will
    run (set by ``Sequential``: ``False`` under no differentiation, where an op may skip what
    only its backward reads).

    Example:
      >>> import jax.numpy as jnp
      >>> from te_jax import ops
      >>> ctx = ops.OperationContext(training=True)
      >>> ctx.save_for_backward(jnp.ones((4, 8)))       # arrays: saved
      >>> ctx.features = 8                             # static facts: attributes
      >>> ctx.features, ctx.training, ctx.saved_tensors[0].shape
      (8, True, (4, 8))
    """

    def __init__(self, training: bool = True):
        object.__setattr__(self, "_saved", ())
        object.__setattr__(self, "_facts", {"training": bool(training)})

    def save_for_backward(self, *values: Any) -> None:
        """Keep ``values`` (arrays or pytrees of arrays) for the backward, replacing any kept."""
        object.__setattr__(self, "_saved", tuple(values))

    @property
    def saved_tensors(self) -> tuple:
        """What ``save_for_backward`` kept, in order."""
        return self._saved

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            raise AttributeError(f"OperationContext: {name!r} is reserved")
        if any(_is_array(leaf) for leaf in jax.tree.leaves(value)):
            raise TypeError(
                f"OperationContext: ctx.{name} holds an array; arrays cross to the backward "
                "through ctx.save_for_backward(...) (attributes are static facts)"
            )
        self._facts[name] = value

    def __getattr__(self, name: str) -> Any:
        facts = object.__getattribute__(self, "_facts")
        if name in facts:
            return facts[name]
        raise AttributeError(f"OperationContext has no fact {name!r} (set it in the forward)")

    def tree_flatten(self):
        return (self._saved,), tuple(sorted(self._facts.items(), key=lambda kv: kv[0]))

    @classmethod
    def tree_unflatten(cls, facts, children):
        ctx = object.__new__(cls)
        object.__setattr__(ctx, "_saved", tuple(children[0]))
        object.__setattr__(ctx, "_facts", dict(facts))
        return ctx

    def __repr__(self) -> str:
        facts = ", ".join(f"{k}={v!r}" for k, v in self._facts.items())
        return f"OperationContext({facts}; {len(self._saved)} saved)"
