#!/usr/bin/env python
"""The exact GELU's Phi fit (kernels_cu/norm_act_loss.cu, pk_gelu_tail), reproduced with NumPy alone.

    python tools/gelu_phi_fit.py [--degree 7] [--clamp 6] [--tau 1e-3]

With a = |x|, Phi(-a) = 2^(-a^2 log2(e) / 2 + r(a)), r(a) = log2(Phi(-a) e^(a^2/2)). A polynomial of r on
[0, clamp] is fitted by iteratively reweighted least squares (Lawson's minimax) to the error in
e = Phi(-a), weighted (e + tau) ln 2: absolute near 0, relative (about 1 / tau of it) in the x < 0 tail. It
prints the float32 coefficients (highest degree first, as the kernel's Horner steps take them), the fit's
weighted bound, and the error of a float32 evaluation (fma, exact exp2) against float64 over [-12, 12].
"""
from __future__ import annotations

import argparse
import math
from typing import Sequence

import numpy as np


def _phi_tail(a: np.ndarray) -> np.ndarray:
    return np.array([0.5 * math.erfc(v / math.sqrt(2.0)) for v in a])


def fit(degree: int, clamp: float, tau: float, iters: int = 400) -> tuple[float, np.ndarray]:
    """(weighted max error, float32 coefficients lowest degree first)."""
    a = np.linspace(0.0, clamp, 8000)
    e = _phi_tail(a)
    r = np.log2(e) + a * a / 2.0 / math.log(2.0)
    w = (e + tau) * math.log(2.0)
    v = np.vander(a, degree + 1, increasing=True)
    lw = np.ones_like(a)
    best: tuple[float, np.ndarray] | None = None
    for _ in range(iters):
        sw = w * np.sqrt(lw)
        c = np.linalg.lstsq(v * sw[:, None], r * sw, rcond=None)[0]
        err = np.abs(w * (v @ c - r))
        if best is None or err.max() < best[0]:
            best = (float(err.max()), c)
        lw = lw * err
        lw /= lw.sum()
    assert best is not None
    return best[0], best[1].astype(np.float32)


def phi_float32(x: np.ndarray, c: np.ndarray, clamp: float) -> np.ndarray:
    """The kernel's steps in float32 (an fma rounds once; exp2 exact, as the host backend's ex2)."""
    f32 = np.float32

    def fma(p, q, s):
        return (p.astype(np.float64) * q + s).astype(f32)

    x = x.astype(f32)
    a = np.minimum(np.abs(x), f32(clamp))
    r = np.full_like(a, c[-1])
    for ck in c[-2::-1]:
        r = fma(r, a, f32(ck))
    xk = (x * f32(-0.5 / math.log(2.0))).astype(f32)
    e = np.exp2(fma(x, xk, r).astype(np.float64)).astype(f32)
    return np.where(x < 0, e, (f32(1.0) - e).astype(f32))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/gelu_phi_fit.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--degree", type=int, default=7)
    ap.add_argument("--clamp", type=float, default=6.0)
    ap.add_argument("--tau", type=float, default=1e-3)
    args = ap.parse_args(argv)
    bound, c = fit(args.degree, args.clamp, args.tau)
    print(f"weighted minimax bound {bound:.3g}")
    for ck in c[::-1]:
        print(f"    {float(ck):.9e}f")
    x = np.linspace(-12.0, 12.0, 400_001).astype(np.float32)
    ref = np.array([0.5 * math.erfc(-v / math.sqrt(2.0)) for v in x.astype(np.float64)])
    got = phi_float32(x, c, args.clamp).astype(np.float64)
    tail = ref >= 1e-8
    print(f"max |Phi - Phi_exact| {np.abs(got - ref).max():.3g}; "
          f"max relative error where Phi >= 1e-8 {np.max(np.abs(got[tail] / ref[tail] - 1.0)):.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
