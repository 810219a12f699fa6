"""exp, and the silu and softmax built on it, composed from arithmetic for MLX's CPU backend.

MLX's CPU `exp` calls the scalar `std::exp` once per element, many times the cost of a multiply, and
`silu`, `sigmoid` and `softmax` are built on it (docs/performance.md, "Where prefill time goes").
Here exp(x) = 2^n * e^r with n = round(x / ln 2) and r = x - n ln 2 (|r| <= ln(2) / 2): 2^n is
written straight into a float's exponent bits and e^r is its Taylor polynomial of degree 7.
`mx.compile` fuses the ops into a few loops (seven kernels in all) that g++ compiles the first time
they run on a machine (once: MLX keeps them in its temporary folder); where no compiler is
found the same ops run unfused, a little faster than `mx.exp`.
"""

import math

import mlx.core as mx

LOG2_E = 1.4426950408889634
LN2_HIGH, LN2_LOW = 0.693145751953125, 1.428606765330187e-06  # ln 2 split so that n * LN2_HIGH is exact
ROUNDING = 1.5 * 2**23  # adding it leaves no fraction bits in a float32 (for |t| < 2^22)
EXP_COEFFICIENTS = tuple(1 / math.factorial(i) for i in range(8))  # e^r's Taylor series, lowest first


def exp(x: mx.array) -> mx.array:
    """e^x for float32 x, to 2e-7 relative (about one float32 ulp) up to 88.3; infinity from 88.4, 0 below -88."""
    x = mx.clip(x, -127 * math.log(2), 128 * math.log(2))  # n = -127 has exponent bits 0 (the value 0), 128 infinity's
    n = (x * LOG2_E + ROUNDING) - ROUNDING  # round(x / ln 2): floor() is a scalar call in MLX's compiled CPU code
    r = (x - n * LN2_HIGH) - n * LN2_LOW  # |r| <= ln(2) / 2
    c = EXP_COEFFICIENTS
    r2 = r * r
    r4 = r2 * r2  # Estrin's scheme: a shallow graph, which MLX fuses into fewer compiled kernels than Horner's
    low = (c[0] + c[1] * r) + (c[2] + c[3] * r) * r2
    high = (c[4] + c[5] * r) + (c[6] + c[7] * r) * r2
    return (low + high * r4) * ((n.astype(mx.int32) + 127) << 23).view(mx.float32)


@mx.compile
def silu(x: mx.array) -> mx.array:
    """x * sigmoid(x) = x / (1 + e^-x)."""
    return x / (1 + exp(-x))


@mx.compile
def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis (entries of -inf get weight 0)."""
    e = exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
