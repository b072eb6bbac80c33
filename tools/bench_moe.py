#!/usr/bin/env python
"""Mixture-of-experts experts block (bf16, tensor cores): modelled H100 table and GPU benchmark.

    python tools/bench_moe.py                  # modelled H100 table (no GPU needed: NVRTC + cuobjdump)
    python tools/bench_moe.py --json
    python tools/bench_moe.py --time           # on a GPU: pykern beside torch._grouped_mm and transformers'
                                               # "grouped_mm" experts, CUDA events (exit 3 without a GPU):
                                               # the experts forward and forward + backward, the gate_up
                                               # grouped GEMM in bf16 and FP8 (block-scaled)
    python tools/bench_moe.py --time --tokens 4096 --tokens 16384 --rows moe.json

Shapes: the experts of one layer, Mixtral-8x7B (H=4096, I=14336, E=8, k=2) and Qwen3-30B-A3B
(H=2048, I=768, E=128, k=8), at 1K, 4K, 16K and 64K tokens. Useful FLOPs: 6 * T * k * H * I
(gate_up and down projections of every routed slot).

Model (H100 SXM: 132 SMs, 990 TFLOP/s dense bf16, 3.35 TB/s), every term from our own counts:
  * kernels: moe_gemm_act_tc_bf16 (gate_up GEMM with act(gate) * up in its epilogue, K = H) and
    grouped_gemm_tc_bf16 (down GEMM, K = I); their steady-state loop metric (warp-instructions per
    m16n8k16 MMA, tools/sass_report.py --loops on sm_90) and registers come from the cubins NVRTC
    builds here;
  * clock: Hopper's dense bf16 peak is one m16n8k16-equivalent (4096 FLOPs) per SM per clock, so
    clock = 990e12 / (132 * 4096) = 1.83 GHz;
  * per-SM bounds, in MMAs per clock: issue 4 schedulers / (instructions per MMA); shared memory
    128 B/clk / (ldmatrix + cp.async bytes per MMA, from the tile config: 128x128x32 CTA tiles,
    four 64x64 warps, each warp reads its A and B fragments, the CTA's cp.async writes the A and B
    tiles); tensor pipe: mma.sync at 2/3 of the dense peak;
  * geometry: moe_align pads each expert's rows to 128; with random balanced routing an expert's
    slots are Binomial(T, k/E), so its row tiles are E[ceil(count / 128)] (the padding waste is
    printed); CTAs = row tiles x column tiles; waves over 132 SMs x CTAs/SM (registers, shared
    memory); the last wave's fill scales the compute terms; occupancy min(1, warps per SM / 8);
  * HBM: the minimum bytes (experts' weights hit once, activations once) at 3.35 TB/s, plus the
    gather / combine around the GEMMs;
  * time = sum over the two GEMMs of max(compute, HBM) + gather / combine; the binding term is the
    smallest bound. Executed FLOPs count whole 128x128 tiles (padding rows included). Pipeline fill
    and epilogues are outside the steady-state loop and not counted: short K (Qwen3's down GEMM,
    K = 768: 24 k-tiles) makes the model optimistic there.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

H100 = {"sms": 132, "peak": 990e12, "bw": 3.35e12, "schedulers": 4, "smem_bytes_per_clk": 128,
        "smem_per_sm": 228 * 1024, "regs_per_sm": 65536}
MMA_FLOPS = 4096  # one m16n8k16: 16 * 8 * 16 multiply-adds
CLOCK = H100["peak"] / (H100["sms"] * MMA_FLOPS)  # 1.83 GHz: one m16n8k16-equivalent per SM per clock
MMA_SYNC_FRACTION = 2.0 / 3.0
FULL_WARPS = 8  # warps per SM that keep the 4 tensor cores fed (one MMA chain per warp)
SHAPES = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8)}  # H, I, E, k
TOKENS = (1024, 4096, 16384, 65536)
GEMMS = (("gate_up+act", "moe_gemm_act_tc_bf16"), ("down", "grouped_gemm_tc_bf16"))
TERMS = ("issue", "smem", "tensor", "hbm")
LDSM_X4_BYTES = 32 * 16  # ldmatrix.x4: four 8x8 b16 matrices per warp
EXIT_OK, EXIT_NO_GPU = 0, 3  # as pykern.bench (pykern/bench/cli.py)


# --------------------------------------------------------------------------- kernel facts

def tile_config() -> dict[str, int]:
    """The tensor-core grouped GEMM's tile, from kernels_cu/moe.cu's #defines (four 64x64 warps, 2x2)."""
    text = (ROOT / "kernels_cu" / "moe.cu").read_text()
    d = {k: int(v) for k, v in re.findall(r"#define (GG_BM|GG_BK|GG_ST|GG_THREADS|GG_SR) (\d+)", text)}
    from pykern.ops.moe import TC_BN, TC_SMEM

    warps = d["GG_THREADS"] // 32
    bm, bn = d["GG_BM"], TC_BN
    cfg = {"bm": bm, "bn": bn, "bk": d["GG_BK"], "stages": d["GG_ST"], "threads": d["GG_THREADS"], "warps": warps,
           "wm": bm // 2, "wn": bn // 2, "smem": TC_SMEM}
    assert TC_SMEM == d["GG_ST"] * 2 * bm * d["GG_SR"] * 2, "pykern.ops.moe.TC_SMEM disagrees with moe.cu"
    return cfg


def smem_bytes_per_mma(cfg: dict[str, int]) -> dict[str, float]:
    """Shared-memory bytes per m16n8k16 MMA: each warp's ldmatrix of its A and B fragments per k-tile,
    and the CTA's cp.async writes of the A and B tiles per k-tile."""
    mma_warp = (cfg["wm"] // 16) * (cfg["wn"] // 8) * (cfg["bk"] // 16)
    ldsm = (cfg["wm"] + cfg["wn"]) * cfg["bk"] * 2 / mma_warp
    cp = (cfg["bm"] + cfg["bn"]) * cfg["bk"] * 2 / (mma_warp * cfg["warps"])
    return {"ldmatrix": ldsm, "cp_async": cp, "total": ldsm + cp}


def ctas_per_sm(regs: int, threads: int, smem: int) -> int:
    warps = -(-threads // 32)
    regs_per_warp = -(-(max(regs, 1) * 32) // 256) * 256
    by_regs = H100["regs_per_sm"] // (regs_per_warp * warps)
    by_smem = H100["smem_per_sm"] // (smem + 1024) if smem else 16
    return max(0, min(by_regs, by_smem, 16, 64 // warps))


def _sass_report() -> Any:
    spec = importlib.util.spec_from_file_location("pk_sass_report", ROOT / "tools" / "sass_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kernel_facts(arch: str = "sm_90") -> dict[str, dict[str, Any]]:
    """{kernel: loop metric, registers, CTAs/SM and the per-SM bounds (MMAs/clk) and TFLOP/s rates}."""
    from pykern import cache

    cfg = tile_config()
    sb = smem_bytes_per_mma(cfg)
    names = [k for _, k in GEMMS]
    loops = _sass_report().loop_metrics(names, [arch])
    mod = cache.get_module(ROOT / "kernels_cu" / "moe.cu", arch)
    out = {}
    for name in names:
        lm = loops[name][arch]
        regs = mod.resources[name].registers
        cps = ctas_per_sm(regs, cfg["threads"], cfg["smem"])
        per_clk = {"issue": H100["schedulers"] / lm["per_mma"], "smem": H100["smem_bytes_per_clk"] / sb["total"],
                   "tensor": MMA_SYNC_FRACTION}
        out[name] = {
            "per_mma": lm["per_mma"], "loop_insns": lm["insns"], "loop_mma": lm["mma"],
            # the SASS's own ldmatrix / cp.async counts per MMA, as bytes (all ldmatrix are .x4; 16 B cp.async)
            "sass_ldsm_bytes_per_mma": lm["ldsm"] * LDSM_X4_BYTES / lm["mma"],
            "sass_cp_async_bytes_per_mma": lm["ldgsts"] * 32 * 16 / lm["mma"],
            "tile_smem_bytes_per_mma": sb, "registers": regs, "ctas_per_sm": cps,
            "occupancy": min(1.0, cps * cfg["warps"] / FULL_WARPS),
            "mma_per_clk_per_sm": per_clk,
            "tflops": {t: v * MMA_FLOPS * CLOCK * H100["sms"] / 1e12 for t, v in per_clk.items()},
        }
    return out


# --------------------------------------------------------------------------- geometry and model

def expected_tiles(tokens: int, top_k: int, experts: int, bm: int) -> tuple[float, float]:
    """(E[row tiles of one expert], P(expert hit)) when its slot count is Binomial(tokens, k / E)."""
    p = top_k / experts
    if p >= 1.0:
        return float(-(-tokens // bm)), 1.0
    mean, sd = tokens * p, math.sqrt(tokens * p * (1 - p))
    lo, hi = max(0, int(mean - 12 * sd) - 1), min(tokens, int(mean + 12 * sd) + 2)
    lp, lq = math.log(p), math.log1p(-p)
    lg = math.lgamma(tokens + 1)
    tiles = mass = 0.0
    for c in range(lo, hi + 1):
        pr = math.exp(lg - math.lgamma(c + 1) - math.lgamma(tokens - c + 1) + c * lp + (tokens - c) * lq)
        tiles += pr * -(-c // bm)
        mass += pr
    return tiles / mass, 1.0 - math.exp(tokens * lq)


def model(name: str, tokens: int, facts: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """One modelled row: the experts block of `name` at `tokens` tokens on an H100."""
    hid, inter, experts, top_k = SHAPES[name]
    facts = facts or kernel_facts()
    cfg = tile_config()
    slots = tokens * top_k
    tiles_per_expert, p_hit = expected_tiles(tokens, top_k, experts, cfg["bm"])
    row_tiles = experts * tiles_per_expert
    rows = row_tiles * cfg["bm"]
    hit = experts * p_hit
    useful = 6.0 * slots * hid * inter
    el = 2  # bf16
    gemms = {
        # (N tiles, K, HBM bytes: weights of the experts hit, activations in and out)
        "gate_up+act": (-(-inter // (cfg["bn"] // 2)), hid,
                        hit * 2 * inter * hid * el + slots * hid * el + slots * inter * el),
        "down": (-(-hid // cfg["bn"]), inter, hit * hid * inter * el + slots * inter * el + slots * hid * el),
    }
    glue_bytes = (tokens * hid + slots * hid) * el * 2  # gather (x -> rows) and combine (rows -> out)
    out: dict[str, Any] = {"model": name, "tokens": tokens, "hidden": hid, "intermediate": inter, "experts": experts,
                           "top_k": top_k, "useful_flops": useful, "slots": slots, "padded_rows": rows,
                           "padding_waste": 1.0 - slots / rows, "gemms": {}}
    t_term = dict.fromkeys(TERMS, 0.0)
    t_pred = glue_bytes / H100["bw"]
    t_term["hbm"] += glue_bytes / H100["bw"]
    for label, kname in GEMMS:
        n_tiles, k, nbytes = gemms[label]
        f = facts[kname]
        k_exec = -(-k // cfg["bk"]) * cfg["bk"]
        executed = row_tiles * n_tiles * 2.0 * cfg["bm"] * cfg["bn"] * k_exec
        ctas = row_tiles * n_tiles
        slots_gpu = H100["sms"] * f["ctas_per_sm"]
        waves = ctas / slots_gpu
        fill = waves / math.ceil(waves) if waves > 0 else 1.0
        t_c = {t: executed / (f["tflops"][t] * 1e12 * f["occupancy"] * fill) for t in ("issue", "smem", "tensor")}
        t_h = nbytes / H100["bw"]
        t_c["hbm"] = t_h
        for t in TERMS:
            t_term[t] += t_c[t]
        t_g = max(t_c.values())
        t_pred += t_g
        out["gemms"][label] = {"kernel": kname, "ctas": ctas, "waves": waves, "last_wave_fill": fill,
                               "executed_flops": executed, "hbm_bytes": nbytes,
                               "bound_ms": {t: v * 1e3 for t, v in t_c.items()},
                               "binding": _binding({t: 1.0 / v for t, v in t_c.items()})}
    out["bounds_tflops"] = {t: useful / v / 1e12 for t, v in t_term.items()}
    out["binding"] = _binding(out["bounds_tflops"])
    out["model_ms"] = t_pred * 1e3
    out["model_tflops"] = useful / t_pred / 1e12
    return out


def _binding(rates: dict[str, float], tie: float = 0.005) -> str:
    """The smallest bound's term; terms within 0.5% of it are named with it ('smem=tensor')."""
    low = min(rates.values())
    return "=".join(t for t in TERMS if t in rates and rates[t] <= low * (1 + tie))


def model_rows() -> list[dict[str, Any]]:
    facts = kernel_facts()
    return [model(name, t, facts) for name in SHAPES for t in TOKENS]


# --------------------------------------------------------------------------- timing (--time)

def _cuda_timer(torch: Any) -> Callable[[Callable[[], Any]], float]:
    def run(fn: Callable[[], Any], iters: int = 10) -> float:
        fn()
        torch.cuda.synchronize()
        best = math.inf
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / iters)
        return best  # ms
    return run


def bench(tokens: tuple[int, ...]) -> list[dict[str, Any]]:
    """Measured ms and TFLOP/s on the GPU: pykern's moe_experts (direct and through transformers'
    experts registry) and grouped_gemm beside torch._grouped_mm and transformers' "grouped_mm"."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from pykern import ops
    from pykern.torch import hf_moe

    hf_moe._register_experts()
    timer = _cuda_timer(torch)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    rows = []
    for name, (hid, inter, experts, top_k) in SHAPES.items():
        cfg = MixtralConfig(hidden_size=hid, intermediate_size=inter, num_local_experts=experts,
                            num_experts_per_tok=top_k, hidden_act="silu")
        with torch.device(dev):
            mod = MixtralExperts(cfg).to(bf16)
        with torch.no_grad():
            mod.gate_up_proj.normal_(0, 0.02)
            mod.down_proj.normal_(0, 0.02)
        gu, dn = mod.gate_up_proj.detach(), mod.down_proj.detach()
        for t in tokens:
            x = torch.randn(t, hid, device=dev, dtype=bf16)
            w, ids = ops.moe_route(torch.randn(t, experts, device=dev), top_k)
            useful = 6.0 * t * top_k * hid * inter
            row: dict[str, Any] = {"model": name, "tokens": t, "useful_flops": useful}
            with torch.no_grad():
                row["pykern_moe_experts_ms"] = timer(lambda: ops.moe_experts(x, gu, dn, ids, w))
                cfg._experts_implementation = "pykern"
                # whether the registered forward took pykern's path (it falls back to "grouped_mm" for layouts it
                # does not cover): counted around one call
                took, real = [], hf_moe._moe.moe_experts
                hf_moe._moe.moe_experts = lambda *a, **k: (took.append(1), real(*a, **k))[1]  # noqa: E731
                try:
                    mod(x, ids.long(), w)
                finally:
                    hf_moe._moe.moe_experts = real
                row["pykern_registry_took_pykern"] = bool(took)
                row["pykern_registry_ms"] = timer(lambda: mod(x, ids.long(), w))
                cfg._experts_implementation = "grouped_mm"
                row["transformers_grouped_mm_ms"] = timer(lambda: mod(x, ids.long(), w))
            # forward + backward through the same module (gradients of x and both weights, as training takes
            # them): pykern's registered experts beside transformers' grouped_mm ones
            xr, g = x.detach().requires_grad_(), torch.randn(t, hid, device=dev, dtype=bf16)
            leaves = (xr, mod.gate_up_proj, mod.down_proj)

            def fwdbwd() -> Any:
                return torch.autograd.grad(mod(xr, ids.long(), w), leaves, g)

            for impl, key in (("pykern", "pykern_moe_fwdbwd_ms"), ("grouped_mm", "transformers_moe_fwdbwd_ms")):
                cfg._experts_implementation = impl
                try:
                    row[key] = timer(fwdbwd)
                except Exception as e:  # noqa: BLE001 - the other implementation's row still counts
                    row[key[:-3] + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            # the gate_up GEMM alone: ours on moe_align's padded rows, torch's on the unpadded ones
            sorted_slot, _, offsets, counts = ops.moe_align(ids, experts)
            a_pad = torch.randn(sorted_slot.shape[0], hid, device=dev, dtype=bf16)
            a = torch.randn(t * top_k, hid, device=dev, dtype=bf16)
            ends = torch.cumsum(counts, 0, dtype=torch.int32)
            gemm_flops = 2.0 * t * top_k * 2 * inter * hid
            row["pykern_grouped_gemm_ms"] = timer(lambda: ops.grouped_gemm(a_pad, gu, offsets))
            if hasattr(torch, "_grouped_mm"):
                row["torch_grouped_mm_ms"] = timer(lambda: torch._grouped_mm(a, gu.transpose(-2, -1), offs=ends))
            # the same gate_up GEMM in FP8 (DeepSeek-V3 scaling: 1 x 128 activation tiles, 128 x 128 weight blocks)
            try:
                a_q, a_s = ops.fp8_quantize(a_pad)
                b_q, b_s = _fp8_blocks(torch, gu)
                row["pykern_grouped_gemm_fp8_ms"] = timer(lambda: ops.grouped_gemm_fp8(a_q, a_s, b_q, b_s, offsets))
            except Exception as e:  # noqa: BLE001
                row["pykern_grouped_gemm_fp8_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            for key in [k for k in row if k.endswith("_ms")]:
                flops = (3 * useful if "fwdbwd" in key else gemm_flops if "gemm" in key or key.startswith("torch_")
                         else useful)
                row[key[:-3] + "_tflops"] = flops / (row[key] * 1e-3) / 1e12
            rows.append(row)
            del x, a, a_pad
    return rows


def _fp8_blocks(torch: Any, b: Any) -> tuple[Any, Any]:
    """(b_fp8 [E, N, K], b_scale [E, ceil(N / 128), K / 128]) of b: one scale per 128 x 128 block, amax / 448."""
    e, n, k = b.shape
    nb = -(-n // 128)
    pad = torch.nn.functional.pad(b.float(), (0, 0, 0, nb * 128 - n))
    blocks = pad.view(e, nb, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(2, 4)).clamp_min(1e-10) / 448.0
    q = (blocks / scale[:, :, None, :, None]).view(e, nb * 128, k)[:, :n]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


# --------------------------------------------------------------------------- main

def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'model':<15}{'tokens':>7}{'waste':>7}{'CTAs g1/g2':>14}{'waves g1/g2':>13}"
            + "".join(f"{t + ' TF/s':>12}" for t in TERMS) + f"{'model TF/s':>12}{'ms':>9}  binding")
    lines = [head, "-" * len(head)]
    for r in rows:
        g1, g2 = r["gemms"]["gate_up+act"], r["gemms"]["down"]
        lines.append(f"{r['model']:<15}{r['tokens']:>7}{100 * r['padding_waste']:>6.1f}%"
                     f"{g1['ctas']:>8.0f}/{g2['ctas']:<5.0f}{g1['waves']:>7.1f}/{g2['waves']:<5.1f}"
                     + "".join(f"{r['bounds_tflops'][t]:>12.0f}" for t in TERMS)
                     + f"{r['model_tflops']:>12.0f}{r['model_ms']:>9.3f}  {r['binding']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time", action="store_true", help="time on a CUDA GPU beside torch._grouped_mm / transformers")
    ap.add_argument("--tokens", type=int, action="append", help="token counts for --time (default 1K..64K)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rows", metavar="FILE",
                    help="--time: also write the timed rows (one per model and token count, flat *_ms / *_tflops "
                         "figures) to FILE as a JSON list (docs/measured/<date>/moe.json)")
    args = ap.parse_args(argv)
    if args.time:
        from pykern.bench.runner import torch_status

        ok, why = torch_status()
        if not ok:
            print(f"bench_moe --time needs a CUDA GPU (and torch with CUDA): {why}", file=sys.stderr)
            return EXIT_NO_GPU
    facts = kernel_facts()
    rows = [model(name, t, facts) for name in SHAPES for t in TOKENS]
    timed = bench(tuple(args.tokens or TOKENS)) if args.time else None
    if timed is not None and args.rows:
        with open(args.rows, "w") as f:
            json.dump(timed, f, indent=1)
    if args.json:
        print(json.dumps({"clock_hz": CLOCK, "kernels": facts, "model": rows, "timed": timed}, indent=2))
        return EXIT_OK
    print(f"kernels on sm_90 (clock {CLOCK / 1e9:.3f} GHz; bounds per kernel in TFLOP/s of executed MMAs):")
    for k, f in facts.items():
        sb = f["tile_smem_bytes_per_mma"]
        print(f"  {k:<22} {f['per_mma']:.3f} instr/MMA  {f['registers']} regs  {f['ctas_per_sm']} CTAs/SM  "
              f"smem {sb['ldmatrix']:.0f}+{sb['cp_async']:.0f} B/MMA (SASS {f['sass_ldsm_bytes_per_mma']:.0f}+"
              f"{f['sass_cp_async_bytes_per_mma']:.0f})  issue {f['tflops']['issue']:.0f}  smem "
              f"{f['tflops']['smem']:.0f}  tensor {f['tflops']['tensor']:.0f}")
    print("\nmodelled H100, experts block forward (useful FLOPs 6*T*k*H*I; waste: moe_align padding rows):")
    print(table(rows))
    if timed:
        print("\nmeasured (CUDA events, ms and TFLOP/s):")
        for t in timed:
            print(json.dumps(t))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
