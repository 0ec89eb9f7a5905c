"""IEEE-754 float32 arithmetic that does not depend on the backend's denormal mode.

XLA:CPU runs compiled code with denormals flushed: a subnormal float32 operand is read as zero
(DAZ) and a subnormal result is written as zero (FTZ), in ``jit`` and eager alike.
docs/numerics.md asks for float32 arithmetic, and the GPU kernels (and NumPy) keep subnormals, so
the quantization reference cannot use plain ``*``, ``/``, ``==`` or ``max`` wherever a subnormal
can occur: a tensor of tiny values (amax ~1e-38) gets a scale near float32 max, and ``1/scale``,
``y * scale`` and the MXFP8 multiplier ``2^-127`` all touch the subnormal range.

The helpers here work on the bit patterns with integer ops, which no denormal mode affects:

* ``abs_max``, ``reduce_max``, ``is_zero`` and ``is_positive`` compare bits;
* ``ldexp`` (``x · 2^k``) and ``div`` round into the subnormal range exactly (round to nearest,
  ties to even), like IEEE hardware without flushing;
* ``mul`` is exact except that a product below the normal range (< 2^-126) may be rounded twice:
  every caller casts it to an FP8/FP4 format straight after, where it becomes a signed zero
  either way.

One trap: LLVM, which compiles XLA:CPU's kernels assuming IEEE denormals, rewrites integer tests
on a float's bits into float compares when it can (``(bits & 0x7fffffff) == 0`` becomes
``x == 0.0``), and XLA then runs that compare with a subnormal read as zero. So nothing here
tests ``bits == 0``: zero is "normalised significand == 0" (through a count of leading zeros,
which LLVM does not see through), and the remaining tests on exponent fields (subnormal, inf,
NaN) give the same answer either way. (An ``optimization_barrier`` does not help: XLA:CPU removes
it before fusion.) Operands that may be subnormal are only ever read through their bits.

A float32 is ``±M · 2^(e-23)`` with an integer significand ``M`` in ``[2^23, 2^24)`` (subnormals
are normalised by a count of leading zeros); ``split`` and ``_compose`` convert between the two.
Native float ops are used only on normal operands with a normal result, where they are exact.

Operands are float32 arrays (``mul`` and ``div`` also take Python/NumPy scalar constants);
every function is elementwise (the ``*max`` functions reduce) and jittable.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "bits",
    "from_bits",
    "split",
    "abs_max",
    "reduce_max",
    "is_zero",
    "is_positive",
    "ldexp",
    "mul",
    "div",
    "div_by_int",
    "true_divide",
]

_U32 = jnp.uint32
_I32 = jnp.int32
# Typed constants: a bare Python int above 2^31 does not convert to a JAX operand.
_SIGN = np.uint32(0x80000000)
_ABS = np.uint32(0x7FFFFFFF)
_ABS_I = np.int32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)
_INF_BITS_I = np.int32(0x7F800000)
_NAN_BITS = np.uint32(0x7FC00000)
_FRAC = np.uint32(0x007FFFFF)
_FRAC_I = np.int32(0x007FFFFF)
_HIDDEN_I = np.int32(0x00800000)
_ONE_BITS = np.uint32(0x3F800000)  # 1.0f: exponent field of a significand in [1, 2)
_NEG_INF_KEY = np.int32(-0x7F800001)  # reduce_max's key of -inf


def _f32(x) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        raise TypeError(f"te_jax.quantize.ieee expects float32, got {x.dtype}")
    return x


def bits(x) -> jax.Array:
    """The float32 bit pattern of ``x`` as uint32."""
    return lax.bitcast_convert_type(_f32(x), _U32)


def from_bits(u) -> jax.Array:
    """The float32 whose bit pattern is the uint32 ``u``."""
    return lax.bitcast_convert_type(jnp.asarray(u, _U32), jnp.float32)


class _Parts(NamedTuple):
    """A float32 taken apart with integer ops: ``|x| = m · 2^(e-23)``."""

    sign: jax.Array  # uint32: the sign bit in place
    m: jax.Array  # int32 significand in [2^23, 2^24) for finite nonzero x (subnormals
    #               normalised), 0 for ±0, garbage for inf/NaN
    e: jax.Array  # int32 unbiased exponent
    zero: jax.Array
    inf: jax.Array
    nan: jax.Array


def _parts(x) -> _Parts:
    u = bits(x)
    mag = u & _ABS
    biased = (mag >> 23).astype(_I32)
    frac = (u & _FRAC).astype(_I32)
    sub = biased == 0
    # A subnormal's leading one is at bit 31 - clz(frac); shifting by clz - 8 moves it to bit 23.
    shift = jnp.where(sub, lax.clz(frac) - 8, 0)
    m = jnp.where(sub, frac << shift, frac | _HIDDEN_I)
    e = jnp.where(sub, -126 - shift, biased - 127)
    # Zero is tested on the normalised significand, not as (bits & 0x7fffffff) == 0: see the
    # module doc. The exponent-field tests (subnormal, inf, NaN) mean the same with or without
    # denormals read as zero, so they are safe even if LLVM turns them into float compares.
    return _Parts(u & _SIGN, m, e, m == 0, mag == _INF_BITS, mag > _INF_BITS)


def _normal_parts(x):
    """``(M, e)`` of a float32 known to be normal (a product or quotient of significands)."""
    u = bits(x)
    return (u & _FRAC).astype(_I32) | _HIDDEN_I, (u >> 23).astype(_I32) - 127


def _static_parts(x) -> _Parts:
    """``_parts`` of a constant (a Python or NumPy scalar), computed now: the traced graph
    then holds literals instead of the integer ops that take a float apart."""
    u = int(np.asarray(x, np.float32).view(np.uint32))
    mag, frac = u & 0x7FFFFFFF, u & 0x7FFFFF
    biased = mag >> 23
    if biased == 0:
        shift = 24 - frac.bit_length() if frac else 24
        m, e = frac << shift, -126 - shift
    else:
        m, e = frac | 0x800000, biased - 127
    return _Parts(
        np.uint32(u & 0x80000000),
        np.int32(m),
        np.int32(e),
        np.bool_(m == 0),
        np.bool_(mag == 0x7F800000),
        np.bool_(mag > 0x7F800000),
    )


def _is_static(x) -> bool:
    return isinstance(x, (int, float, np.floating)) or (isinstance(x, np.ndarray) and x.ndim == 0)


def _operand_parts(x) -> _Parts:
    """``_parts`` of an operand: a float32 array, or a constant taken apart in Python."""
    return _static_parts(x) if _is_static(x) else _parts(_f32(x))


def split(x) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(sign_bits, M, e)`` with ``|x| = M · 2^(e-23)``, ``M`` in ``[2^23, 2^24)``.

    Exact for subnormals (normalised). ``M = 0`` for ±0; inf and NaN give garbage.
    """
    p = _parts(x)
    return p.sign, p.m, p.e


def abs_max(x, axis=None) -> jax.Array:
    """``max |x|`` over ``axis`` (all axes by default), exact for subnormals; 0 when empty.

    For non-negative floats the bit patterns order like the values, and a NaN's pattern exceeds
    infinity's, so an integer max of ``bits & 0x7fffffff`` is the float max with NaN propagated.
    """
    mag = lax.bitcast_convert_type(bits(x) & _ABS, _I32)
    return lax.bitcast_convert_type(jnp.max(mag, axis=axis, initial=0), jnp.float32)


def reduce_max(x, axis=None) -> jax.Array:
    """``max x`` over ``axis``, exact for subnormals, NaN if any element is NaN; -inf when empty.

    Maps each pattern to an int32 that orders like the value (negatives: magnitude bits
    flipped), takes the integer max and maps back.
    """
    u = lax.bitcast_convert_type(bits(x), _I32)
    nan = jnp.any((u & _ABS_I) > _INF_BITS_I, axis=axis)
    key = jnp.where(u < 0, u ^ _ABS_I, u)  # flipping the magnitude bits reverses the negatives
    top = jnp.max(key, axis=axis, initial=_NEG_INF_KEY)
    top = lax.bitcast_convert_type(jnp.where(top < 0, top ^ _ABS_I, top), _U32)
    return from_bits(jnp.where(nan, _NAN_BITS, top))


def is_zero(x) -> jax.Array:
    """``x == ±0``, with a subnormal read as nonzero."""
    return _parts(x).zero


def is_positive(x) -> jax.Array:
    """``x > 0`` (false for NaN), with a subnormal read as nonzero."""
    p = _parts(x)
    return (p.sign == 0) & ~p.zero & ~p.nan


def _rne_shift(m, s):
    """``round_half_even(m / 2^s)`` for int32 ``m >= 0`` and ``1 <= s <= 25``."""
    q = m >> s
    rem = m & ((1 << s) - 1)
    half = 1 << (s - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + up.astype(_I32)


def _compose(sign, m, e):
    """The float32 nearest ``±m · 2^(e-23)`` (``m`` in ``[2^23, 2^24)`` or 0), IEEE-rounded.

    Above float32 max it is ±inf; below 2^-126 the significand is shifted into the subnormal
    range with round-half-even (a carry into 2^-126 gives the right bits, as the subnormal
    pattern of ``k · 2^-149`` is ``k`` itself for every ``k <= 2^24``).
    """
    normal = (((e + 127) << 23) | (m & _FRAC_I)).astype(_U32)
    sub = _rne_shift(m, jnp.clip(-126 - e, 1, 25)).astype(_U32)
    mag = jnp.where(e > 127, _INF_BITS, jnp.where(e >= -126, normal, sub))
    mag = jnp.where(m == 0, _U32(0), mag)
    return from_bits(sign | mag)


def _significand(m):
    """``m / 2^23`` as a float32 in ``[1, 2)`` (built from bits, so always normal)."""
    return from_bits((m & _FRAC_I).astype(_U32) | _ONE_BITS)


# The long division's steps between optimisation barriers on XLA:CPU. Without them XLA fuses the
# whole 24-step chain, and where its operands are themselves exact products / quotients (NVFP4's
# y·S / block_scale) XLA:CPU's compile time explodes (>45 s; 1.7 s with them). The barriers change
# no value: each one only makes (q, r) a fusion boundary. Other backends get none: on XLA:GPU
# each boundary is a kernel launch, six per division of delayed scaling's scalar state update.
_DIV_STEPS_PER_FUSION = 4


def _cpu_fusion_boundary(q, r):
    """``(q, r)`` unchanged; on XLA:CPU behind an ``optimization_barrier`` (see above)."""
    return lax.platform_dependent(
        q, r, cpu=lambda q, r: lax.optimization_barrier((q, r)), default=lambda q, r: (q, r)
    )


def _significand_quotient(ma, mb):
    """``rne(ma / mb)`` for int32 significands in ``[2^23, 2^24)``, as ``(M, e)``: the quotient is
    ``M · 2^(e-23)`` with ``M`` in ``[2^23, 2^24)``, ``e`` in ``{-1, 0}``.

    Integer long division, 24 quotient bits and the remainder for the rounding: no float division
    at all, because no backend's is reliable here: XLA rewrites a division by a broadcast value
    into a multiplication by the reciprocal (rounding twice: a third of ``x / 6`` are an ulp off
    on XLA:CPU), and XLA:GPU's float32 division is not correctly rounded (``div.full.f32``).
    """
    lt = ma < mb
    r = jnp.where(lt, ma << 1, ma)  # in [mb, 2 mb), < 2^25
    e = jnp.where(lt, -1, 0)
    q = jnp.zeros_like(ma)
    for i in range(24):
        bit = r >= mb
        q = (q << 1) | bit.astype(_I32)
        r = (r - jnp.where(bit, mb, 0)) << 1  # twice the remainder, < 2^26
        if i % _DIV_STEPS_PER_FUSION == _DIV_STEPS_PER_FUSION - 1 and i < 23:
            q, r = _cpu_fusion_boundary(q, r)
    q = q + ((r > mb) | ((r == mb) & ((q & 1) == 1))).astype(_I32)  # ties to even
    carry = q >> 24  # rounded up to 2^24
    return jnp.where(carry == 1, _HIDDEN_I, q), e + carry


def true_divide(a, b) -> jax.Array:
    """``a / b`` rounded once, on every backend (an alias of ``div``, kept for the name)."""
    return div(a, b)


def _special(sign, nan, inf):
    """NaN, signed infinity or signed zero: the results with a zero/inf/NaN operand."""
    return from_bits(jnp.where(nan, _NAN_BITS, jnp.where(inf, sign | _INF_BITS, sign)))


def ldexp(x, k) -> jax.Array:
    """``x · 2^k`` rounded once (IEEE, subnormal results included); ``k`` an integer array.

    Zeros, infinities and NaN pass through unchanged.
    """
    x = _f32(x)
    p = _parts(x)
    k = jnp.asarray(k, _I32)
    # Clamp so the exponent sum cannot wrap; anything beyond ±300 is inf or 0 anyway.
    out = _compose(p.sign, p.m, p.e + jnp.clip(k, -300, 300))
    return jnp.where(p.zero | p.inf | p.nan, _special(p.sign, p.nan, p.inf), out)


def mul(a, b) -> jax.Array:
    """``a · b`` in float32, exact for normal results whatever the operands (subnormal
    included); a result below 2^-126 keeps its sign but may be rounded twice (see module doc).
    """
    # Parts of each operand at its own shape (a scalar scale is taken apart once).
    pa, pb = _operand_parts(a), _operand_parts(b)
    sign = pa.sign ^ pb.sign
    # Both significands in [1, 2): their product is normal and rounded once, in [1, 4).
    mp, ep = _normal_parts(_significand(pa.m) * _significand(pb.m))
    out = _compose(sign, mp, ep + pa.e + pb.e)
    inf = pa.inf | pb.inf
    nan = pa.nan | pb.nan | (pa.inf & pb.zero) | (pa.zero & pb.inf)
    special = nan | inf | pa.zero | pb.zero
    return jnp.where(special, _special(sign, nan, inf), out)


def div_by_int(x, c: int) -> jax.Array:
    """``x / c`` for float32 ``x`` and a constant integer ``1 <= c <= 127``, correctly rounded
    (subnormal results included), with far fewer ops than ``div``.

    A result below 2^-126 comes from integer arithmetic: then ``x < c · 2^-126 <= 2^-119`` is a
    whole number ``n`` of 2^-149 (``n < 2^30``), and the result is ``rne(n / c)`` of them.
    Otherwise both ``x`` and the result are normal and a native division is exact.
    """
    if not (isinstance(c, int) and 1 <= c <= 127):
        raise ValueError(f"div_by_int: c must be an int in [1, 127], got {c!r}")
    x = _f32(x)
    u = bits(x)
    biased = ((u & _ABS) >> 23).astype(_I32)
    frac = (u & _FRAC).astype(_I32)
    # x in units of 2^-149: frac for a subnormal, (frac | 2^23) · 2^(biased-1) for a normal x.
    n = jnp.where(biased == 0, frac, (frac | _HIDDEN_I) << jnp.clip(biased - 1, 0, 6))
    tiny = (biased < 8) & (n < (c << 23))  # x < c · 2^-126 (the shift is exact below 2^-119)
    q, r = n // c, n % c
    q = q + ((2 * r > c) | ((2 * r == c) & ((q & 1) == 1))).astype(_I32)
    small = from_bits((u & _SIGN) | q.astype(_U32))
    return jnp.where(tiny, small, div(x, np.float32(c)))


def _mul_24x24(a, b):
    """The exact product of int32 ``a, b < 2^24`` as ``(hi, lo)``: ``a·b = hi·2^24 + lo``,
    ``0 <= lo < 2^24`` (12-bit limbs keep every partial product inside int32)."""
    a1, a0 = a >> 12, a & 0xFFF
    b1, b0 = b >> 12, b & 0xFFF
    mid = a1 * b0 + a0 * b1  # < 2^25
    low = a0 * b0 + ((mid & 0xFFF) << 12)  # < 2^25
    return a1 * b1 + (mid >> 12) + (low >> 24), low & 0xFFFFFF


def _shl_wide(m, s):
    """``m · 2^s`` as ``(hi, lo)`` like ``_mul_24x24``, for int32 ``m < 2^24``, ``0 <= s <= 24``."""
    lo = (m.astype(_U32) << s.astype(_U32)).astype(_I32) & 0xFFFFFF  # low 24 bits survive
    return m >> (24 - s), lo


def div(a, b) -> jax.Array:
    """``a / b`` in float32, correctly rounded for every result, subnormal included.

    The significands' quotient ``q = (ma/mb)`` in ``(0.5, 2)`` is a native division (normal
    operands, rounded once). A normal result is ``q`` with the exponents added. A subnormal
    result is ``n · 2^-149`` with ``n = rne(x)``, ``x = (ma/mb) · 2^sh < 2^23``: ``q · 2^sh``
    rounds ``x`` to a grid of at most 1/2, so it picks ``n`` on its own except when it lands
    exactly on a half-integer, where an exact integer comparison of ``ma · 2^(sh+1)`` with
    ``(2n+1) · mb`` says which side ``x`` is on.
    """
    a_bits, b_bits = _constant_bits(a), _constant_bits(b)
    return _div_traced_once(
        None if a_bits is not None else a, None if b_bits is not None else b, a_bits, b_bits
    )


def _constant_bits(x) -> int | None:
    """A constant operand's float32 bit pattern (a static argument that tells -0.0 from 0.0 and
    is equal to itself for NaN), or None for an array."""
    return int(np.asarray(x, np.float32).view(np.uint32)) if _is_static(x) else None


@functools.partial(jax.jit, static_argnums=(2, 3))
def _div_traced_once(a, b, a_bits, b_bits):
    """``_div`` traced once per operand shape and constant, not at each call (its long division
    is a few hundred ops); XLA inlines the call, so the compiled program is the same. A
    constant operand comes as its bits and is a constant again here."""

    def operand(x, u):
        return np.uint32(u).view(np.float32) if x is None else x

    return _div(operand(a, a_bits), operand(b, b_bits))


def _div(a, b) -> jax.Array:
    """``div``'s computation (``a``, ``b``: float32 arrays or constants)."""
    pa, pb = _operand_parts(a), _operand_parts(b)
    ma, mb = pa.m, pb.m
    sign = pa.sign ^ pb.sign
    mq, eq = _significand_quotient(ma, mb)  # ma / mb in (0.5, 2), rounded once
    e = eq + pa.e - pb.e
    normal = _compose(sign, mq, e)

    # Subnormal results (e < -126): |a/b| = x · 2^-149, x = (ma/mb) · 2^sh, sh <= 23.
    sh = pa.e - pb.e + 149
    shc = jnp.clip(sh, -1, 23)  # sh <= -2 gives x < 1/2: n = 0
    xf = _compose(_U32(0), mq, eq + shc)  # q · 2^sh, exact (normal, >= 1/4)
    f = jnp.floor(xf)
    frac = xf - f  # exact
    fi = f.astype(_I32)
    l_hi, l_lo = _shl_wide(ma, shc + 1)  # ma · 2^(sh+1)
    r_hi, r_lo = _mul_24x24(2 * fi + 1, mb)  # (2f+1) · mb
    above = (l_hi > r_hi) | ((l_hi == r_hi) & (l_lo > r_lo))
    at = (l_hi == r_hi) & (l_lo == r_lo)
    up_at_half = above | (at & ((fi & 1) == 1))  # ties to even
    up = (frac > 0.5) | ((frac == 0.5) & up_at_half)
    n = jnp.where(sh >= -1, fi + up.astype(_I32), 0)
    tiny = from_bits(sign | n.astype(_U32))
    out = jnp.where(e < -126, tiny, normal)

    nan = pa.nan | pb.nan | (pa.zero & pb.zero) | (pa.inf & pb.inf)
    inf = pa.inf | pb.zero  # x/0 and inf/x; the NaN cases are taken first
    special = nan | pa.inf | pb.inf | pa.zero | pb.zero
    return jnp.where(special, _special(sign, nan, inf), out)
