"""The float64 NumPy model behind docs/moe.md's backward accuracy table.

The experts backward of `ops.moe_experts_backward` on the docs' shape (40 tokens, hidden 32, intermediate 24,
E = 4, k = 2, `_experts_inputs` with seed 8), with each intermediate operand of a product passed through a chosen
representation before the product, then compared with the float64 reference: the figure is the worst
|err| / (atol + rtol |ref|) over each gradient, under the op's bf16 / f16 tolerance row (over 1 fails).

Operands (where they enter a product) and representations:
- gu: the recomputed gate / up; h_y: h before y = h @ down^T; dys: w * dy before grad_down_proj;
  h_w: h before grad_down_proj; dgu_w: d(gate_up) before grad_gate_up_proj; dgu_dx: d(gate_up) before d(x_perm);
- "f32": rounded to fp32 (an fp32 operand, or an fp32 tensor-core result); "r16": rounded to the inputs' 16-bit
  type; "bf16x2" / "f16x2": split hi = round(v), lo = round(v - hi), the product taken as hi * B + lo * B (fp32
  accumulation of exact products is modelled as exact); "f16x2s": the f16 split as the kernels make it (moe_split16),
  lo = round((v - hi) * 2^11) / 2^11, so a lo part stays above f16's 2^-24 subnormal floor.

The second table repeats the split rows with dy scaled by 2^-12 (a gradient of a mean over thousands of tokens is
that small): the intermediates w * dy and d(gate_up) then sit near 2^-14 and below, where an unscaled f16 lo part is
subnormal. The tolerance's atol scales with them (the figures compare err / (atol * s + rtol |ref|)), so the row
measures relative accuracy at that magnitude.

    python tools/moe_backward_accuracy.py            # the tables
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pykern.arrays import bfloat16  # noqa: E402
from pykern.difftest.cases.moe import (_experts_inputs, np_act, np_act_grad, np_moe_experts_backward,  # noqa: E402
                                       f64)
from pykern.tolerance import tolerance  # noqa: E402

OPERANDS = ("gu", "h_y", "dys", "h_w", "dgu_w", "dgu_dx")
NAMES = ("grad_x", "grad_gate_up_proj", "grad_down_proj", "grad_topk_weights")


def represent(v: np.ndarray, how: str, kind: str) -> np.ndarray:
    if how == "f64":
        return v
    if how == "f32":
        return v.astype(np.float32).astype(np.float64)
    if how == "r16":
        return v.astype(bfloat16() if kind == "bf16" else np.float16).astype(np.float64)
    part = {"bf16x2": bfloat16(), "f16x2": np.float16, "f16x2s": np.float16}[how]
    v = v.astype(np.float32).astype(np.float64)  # the split takes the fp32 intermediate
    hi = v.astype(part).astype(np.float64)
    scale = 2.0 ** 11 if how == "f16x2s" else 1.0
    lo = ((v - hi) * scale).astype(part).astype(np.float64) / scale
    return hi + lo


def model(dy, x, gate_up, down, ids, w, activation: str, kind: str, scheme: dict[str, str]) -> tuple:
    """The backward with operand o represented as scheme.get(o, "f32")."""
    q = lambda o, v: represent(v, scheme.get(o, "f32"), kind)  # noqa: E731
    dy, x, gate_up, down, w = f64(dy), f64(x), f64(gate_up), f64(down), f64(w)
    inter = down.shape[2]
    dx, dgu_w, ddown, dw = np.zeros_like(x), np.zeros_like(gate_up), np.zeros_like(down), np.zeros(w.shape)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            gu = q("gu", gate_up[e] @ x[t])
            g, u = gu[:inter], gu[inter:]
            h = np_act(g, activation) * u
            dw[t, j] = dy[t] @ (down[e] @ q("h_y", h))
            dys = w[t, j] * dy[t]
            ddown[e] += np.outer(q("dys", dys), q("h_w", h))
            dh = w[t, j] * (down[e].T @ dy[t])  # dy and down exact: the fp32-result tensor-core product
            dgu = np.concatenate([dh * u * np_act_grad(g, activation), dh * np_act(g, activation)])
            dgu_w[e] += np.outer(q("dgu_w", dgu), x[t])
            dx[t] += gate_up[e].T @ q("dgu_dx", dgu)
    return dx, dgu_w, ddown, dw


def worst(got: tuple, ref: tuple, kind: str, s: float = 1.0) -> list[float]:
    atol, rtol = tolerance("moe_experts_backward", kind)
    return [float((np.abs(g - r) / (atol * s + rtol * np.abs(r))).max()) for g, r in zip(got, ref)]


SCHEMES = {
    "today (tensor cores: gate/up and d(h) fp32-result, d(x_perm) r16)": {"dgu_dx": "r16"},
    "gate/up rounded to 16 bits": {"gu": "r16", "dgu_dx": "r16"},
    "h before y rounded": {"h_y": "r16", "dgu_dx": "r16"},
    "w*dy before grad_down rounded": {"dys": "r16", "dgu_dx": "r16"},
    "h before grad_down rounded": {"h_w": "r16", "dgu_dx": "r16"},
    "d(gate_up) before grad_gate_up rounded": {"dgu_w": "r16", "dgu_dx": "r16"},
    "split bf16 hi+lo: every fp32 operand": {o: "bf16x2" for o in ("h_y", "dys", "h_w", "dgu_w")} | {"dgu_dx": "r16"},
    "split f16 hi+lo: every fp32 operand": {o: "f16x2" for o in ("h_y", "dys", "h_w", "dgu_w")} | {"dgu_dx": "r16"},
    "split f16 hi+lo, lo scaled 2^11 (the kernels)": {o: "f16x2s" for o in ("h_y", "dys", "h_w", "dgu_w")}
    | {"dgu_dx": "r16"},
}
SMALL = ("split bf16 hi+lo: every fp32 operand", "split f16 hi+lo: every fp32 operand",
         "split f16 hi+lo, lo scaled 2^11 (the kernels)")


def table(labels, s: float) -> None:
    print("| scheme | " + " | ".join(f"{k} {a}" for k in ("bf16", "f16") for a in ("silu", "gelu_tanh"))
          + " |\n|---|---|---|---|---|")
    for label in labels:
        scheme = SCHEMES[label]
        cells = []
        for kind in ("bf16", "f16"):
            for act in ("silu", "gelu_tanh"):
                x, gu, dn, ids, w, dy = _experts_inputs(np.random.default_rng(8), kind, 40, 32, 24, 4, 2)
                if s != 1.0:  # dy scaled exactly (a power of two; f16 keeps its bits above 2^-14)
                    dy = (dy.astype(np.float64) * s).astype(dy.dtype)
                ref = np_moe_experts_backward(dy, x, gu, dn, ids, w, act)
                r = worst(model(dy, x, gu, dn, ids, w, act, kind, scheme), ref, kind, s)
                i = int(np.argmax(r))
                cells.append(f"{r[i]:.2f} ({NAMES[i]})")
        print(f"| {label} | " + " | ".join(cells) + " |")


def main() -> None:
    table(SCHEMES, 1.0)
    print("\ndy scaled by 2^-12:\n")
    table(SMALL, 2.0 ** -12)


if __name__ == "__main__":
    main()
