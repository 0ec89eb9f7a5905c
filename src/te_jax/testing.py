"""Helpers for te_jax's tests, benchmarks and examples (not for models): reading what a compiled
program does.

``hlo_collectives(text)`` lists the collectives of compiled HLO text, e.g.
``jax.jit(step).lower(*args).compile().as_text()``: what a sharded step communicates. The tests
check collective counts with it, the benchmarks and ``examples/train_sharded.py`` print them.
"""

from __future__ import annotations

import re

__all__ = ["hlo_collectives"]


_COLLECTIVE_KINDS = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
# "name = TYPE KIND(ARGS)"; TYPE may be a tuple (XLA:GPU combines collectives), nested and with
# /*index=N*/ comments, so it is everything between "= " and the kind.
_COLLECTIVE = re.compile(
    r"= (?P<type>[^\n]*?) (?P<kind>"
    + "|".join(_COLLECTIVE_KINDS)
    + r")(?P<start>-start)?\((?P<args>[^)]*)\)"
)


def _tuple_elements(hlo_type: str) -> list[str] | None:
    """The top-level elements of an HLO tuple type, or None where the type is not a tuple."""
    t = re.sub(r"/\*index=\d+\*/", "", hlo_type).strip()
    if not t.startswith("("):
        return None
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(t):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 1:
            parts.append(t[start:i].strip())
            start = i + 1
    parts.append(t[start:-1].strip())
    return parts


def _async_result(kind: str, hlo_type: str, n_operands: int) -> str:
    """The result type of an async ``-start``: XLA types it ``(operands, results, ...)`` (the
    operands a tuple when there are several, or a 1-tuple for an all-reduce; a
    collective-permute adds context scalars); a start typed as its result alone is returned
    as is."""
    parts = _tuple_elements(hlo_type)
    if parts is None or len(parts) < 2:
        return hlo_type
    first = _tuple_elements(parts[0])
    if kind == "collective-permute" or (first is None and n_operands == 1 and len(parts) == 2):
        return parts[1]
    if first is not None and len(first) == n_operands and len(parts) == 2:
        return parts[1]
    return hlo_type


def hlo_collectives(hlo_text: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """``(kind, result type, operand names)`` of each collective in compiled HLO text, e.g.
    ``jax.jit(step).lower(*args).compile().as_text()``: what a sharded step communicates.

    Kinds: ``all-gather``, ``all-reduce``, ``reduce-scatter``, ``all-to-all``,
    ``collective-permute``. An async pair (``-start`` / ``-done``) counts once, under its kind,
    with the type of its result (XLA types the start ``(operands, results)``). The result type
    is HLO's text (a tuple for a combined collective), the operands their names without ``%``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from te_jax.testing import hlo_collectives
      >>> hlo_collectives("%ar = f32[8]{0} all-reduce(%x), replica_groups={}, to_apply=%sum")
      [('all-reduce', 'f32[8]{0}', ('x',))]
      >>> hlo_collectives(jax.jit(jnp.sin).lower(jnp.ones(8)).compile().as_text())  # one device
      []
    """
    out = []
    for m in _COLLECTIVE.finditer(hlo_text):
        operands = tuple(a.strip().lstrip("%") for a in m["args"].split(",") if a.strip())
        hlo_type = m["type"]
        if m["start"]:
            hlo_type = _async_result(m["kind"], hlo_type, len(operands))
        out.append((m["kind"], hlo_type, operands))
    return out
