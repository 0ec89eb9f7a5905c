"""The base of te_jax's integer enums."""

from __future__ import annotations

import enum

__all__ = ["NamedIntEnum"]


class NamedIntEnum(enum.IntEnum):
    """An ``IntEnum`` (its value is an FFI attribute) that prints as ``Class.NAME``.

    Since Python 3.11 an ``IntEnum`` prints as its number (``str(ActivationType.SWIGLU) == "4"``);
    te_jax's enums print their names, in ``str``, ``print`` and f-strings alike, and still compare
    and convert as integers.
    """

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __format__(self, format_spec: str) -> str:
        return format(str(self), format_spec)
