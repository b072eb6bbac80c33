"""The summary figures of the measured reports (docs/measured/*.md) recomputed from the raw data beside each report.

Each test recomputes one summary sentence's figures (ranges over every shape the sentence speaks of) from the JSON /
text files the GPU run wrote, and finds them in the report's prose with a regex. A report whose sentence no longer
matches its data fails here, naming the report, the sentence's pattern and the figures the data gives; rewording a
covered sentence means updating its pattern here too. Nothing here needs a GPU: the data is already measured.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest

MEASURED = Path(__file__).resolve().parents[1] / "docs" / "measured"
DOCS = MEASURED.parent
R27 = "2026-11-27-h200"
R28 = "2026-11-28-h200"
R28B = "2026-11-28-h200-b"
D = "[–-]"  # the reports write ranges with an en dash (2026-11-27) or a hyphen (2026-11-28)
X = "[×x]"


def data(report: str, name: str) -> Any:
    return json.loads((MEASURED / report / name).read_text())


def prose(path: Path) -> str:
    """The page as one line: line breaks inside a sentence and bold markers do not split a pattern."""
    return re.sub(r"\s+", " ", path.read_text().replace("**", ""))


def f2(x: float) -> str:
    return f"{x:.2f}"


def f1(x: float) -> str:
    return f"{x:.1f}"


def f0(x: float) -> str:
    return f"{x:.0f}"


def e1(x: float) -> str:
    """3.1e-3, as the reports write a relative error."""
    mant, exp = f"{x:.1e}".split("e")
    return f"{mant}e{int(exp)}"


def rng(values: Iterable[float], fmt: Callable[[float], str] = f2) -> tuple[str, str]:
    v = list(values)
    assert v, "no data rows for this claim"
    return fmt(min(v)), fmt(max(v))


def expect(path: Path, pattern: str, *figures: str) -> None:
    """The first sentence matching `pattern` states exactly `figures` (its groups, in order)."""
    m = re.search(pattern, prose(path))
    assert m, f"{path.relative_to(DOCS.parent)}: no sentence matches {pattern!r} (the data gives {figures})"
    assert m.groups() == figures, (f"{path.relative_to(DOCS.parent)}: {m.group(0)!r} states {m.groups()}, "
                                   f"the data gives {figures}")


def report(name: str) -> Path:
    return MEASURED / f"{name}.md"


# --------------------------------------------------------------------------- 2026-11-27: attention

def attention() -> list[dict]:
    rows = data(R27, "attention.json")
    assert len(rows) == 18
    return rows


def ratio(r: dict, a: str, b: str, what: str) -> float:
    return r[a][f"{what}_tflops"] / r[b][f"{what}_tflops"]


def test_cudnn_is_the_strongest_attention_peer() -> None:
    rows = attention()
    assert all(ratio(r, "sdpa_cudnn", "sdpa_flash", w) > 1 for r in rows for w in ("fwd", "fwdbwd"))
    expect(report(R27), r"strongest peer is cuDNN: it is faster than FA2 in all (\d+) shapes", str(len(rows)))


def test_sm90a_forward_beside_cudnn_over_all_shapes() -> None:
    rows = attention()
    fwd = rng(ratio(r, "pykern", "sdpa_cudnn", "fwd") for r in rows)
    d128 = rng(ratio(r, "pykern", "sdpa_cudnn", "fwd") for r in rows if r["d"] == 128 and r["seq"] >= 4096)
    above = {(r["d"], r["seq"]) for r in rows if ratio(r, "pykern", "sdpa_cudnn", "fwd") > 1}
    assert above == {(64, 16384)}, above  # "above 1 only at d64 x 16k"
    fb = rng(ratio(r, "pykern", "sdpa_cudnn", "fwdbwd") for r in rows)
    expect(report(R27), rf"sm_90a forward runs at ([\d.]+){D}([\d.]+)× cuDNN's TFLOP/s: ([\d.]+){D}([\d.]+)× at d128 "
           rf"from 4k tokens up, above 1 only at d64 × 16k\. Forward \+ backward runs at ([\d.]+){D}([\d.]+)× cuDNN's",
           *fwd, *d128, *fb)
    # the same figures in the list of what is left
    expect(report(R27), rf"sm_90a forward is at ([\d.]+){D}([\d.]+)× cuDNN \(([\d.]+){D}([\d.]+)× at d128 from 4k "
           rf"tokens\), and forward \+ backward at ([\d.]+){D}([\d.]+)×", *fwd, *d128, *fb)


def test_sm90a_beside_fa2() -> None:
    rows = attention()
    fwd = rng(ratio(r, "pykern", "sdpa_flash", "fwd") for r in rows)
    fwd4k = rng(ratio(r, "pykern", "sdpa_flash", "fwd") for r in rows if r["seq"] >= 4096)
    fb = rng(ratio(r, "pykern", "sdpa_flash", "fwdbwd") for r in rows if r["d"] in (64, 128))
    expect(report(R27), rf"Beside FA2, the sm_90a forward runs at ([\d.]+){D}([\d.]+)× \(([\d.]+){D}([\d.]+)× from 4k "
           rf"tokens up\), and forward \+ backward at ([\d.]+){D}([\d.]+)× at d64/d128", *fwd, *fwd4k, *fb)
    d256 = rng(ratio(r, "pykern", "sdpa_flash", "fwdbwd") for r in rows if r["d"] == 256)
    expect(report(R27), rf"drags d256 training to ([\d.]+){D}([\d.]+)× FA2", *d256)
    expect(report(R27), rf"d256 backward\W* runs on mma\.sync: ([\d.]+){D}([\d.]+)× FA2", *d256)


def test_mma_sync_path_beside_fa2_and_cudnn() -> None:
    rows = attention()
    m = "pykern_mma_sync"
    fwd = rng(ratio(r, m, "sdpa_flash", "fwd") for r in rows)
    fwd_small = rng(ratio(r, m, "sdpa_flash", "fwd") for r in rows if r["d"] in (64, 128))
    fwd_256 = rng(ratio(r, m, "sdpa_flash", "fwd") for r in rows if r["d"] == 256)
    fb = rng(ratio(r, m, "sdpa_flash", "fwdbwd") for r in rows)
    c_fwd = rng(ratio(r, m, "sdpa_cudnn", "fwd") for r in rows)
    c_fb = rng(ratio(r, m, "sdpa_cudnn", "fwdbwd") for r in rows)
    expect(report(R27), rf"mma\.sync path is ([\d.]+){D}([\d.]+)× FA2 forward \(([\d.]+){D}([\d.]+)× at d64/d128, "
           rf"([\d.]+){D}([\d.]+)× at d256\) and ([\d.]+){D}([\d.]+)× FA2 forward \+ backward; beside cuDNN it is "
           rf"([\d.]+){D}([\d.]+)× forward and ([\d.]+){D}([\d.]+)× forward \+ backward",
           *fwd, *fwd_small, *fwd_256, *fb, *c_fwd, *c_fb)


def test_attention_model_against_the_measured_sm90a_forward() -> None:
    rows = [r for r in attention() if r["d"] == 128 and r["seq"] == 16384]
    measured = {r["causal"]: r["pykern"]["fwd_tflops"] for r in rows}
    # today's modelled bound, the 16K column of docs/attention_tc.md's H100 sm_90a forward rows
    model = {}
    for line in (DOCS / "attention_tc.md").read_text().splitlines():
        m = re.match(r"\| H100 SXM, sm_90a \(wgmma\) \| fwd \| 128 \| (no|yes) \| \d+ \| \d+ \| (\d+) \|", line)
        if m:
            model[m[1] == "yes"] = float(m[2])
    assert set(model) == {False, True}
    expect(report(R27), rf"\(([\d.]+){D}([\d.]+) in today's table, docs/attention_tc\.md\); we measured "
           rf"([\d.]+){D}([\d.]+) there, so the model is ([\d.]+){D}([\d.]+)× optimistic",
           *rng(model.values(), f0), *rng(measured.values(), f0),
           *rng((model[c] / measured[c] for c in (False, True)), f1))


def test_attention_forward_matches_sdpa_flash() -> None:
    worst = max(r[k]["rel_err_vs_first"] for r in attention() for k in ("pykern", "pykern_mma_sync"))
    expect(report(R27), r"Every forward matched SDPA flash within ([\d.]+e-\d) relative error", e1(worst))


def test_attention_host_time() -> None:
    rows = attention()
    dec = data(R27, "decode.json")
    sdpa = [r[k]["host_us"] for r in rows for k in ("sdpa_flash", "sdpa_cudnn")]
    expect(report(R27), rf"sm_90a path \| ([\d.]+){D}([\d.]+) µs \| ([\d.]+){D}([\d.]+) µs \|",
           *rng((r["pykern"]["host_us"] for r in rows), f0), *rng(sdpa, f0))
    expect(report(R27), rf"mma\.sync path \| ([\d.]+){D}([\d.]+) µs \|",
           *rng((r["pykern_mma_sync"]["host_us"] for r in rows), f0))
    expect(report(R27), rf"`PagedDecodePlan\.run` \| ([\d.]+){D}([\d.]+) µs \| ([\d.]+){D}([\d.]+) µs \|",
           *rng((r["pykern_host_us"] for r in dec), f0),
           *rng((r["sdpa_host_us"] for r in dec if r.get("sdpa_host_us")), f0))

    def vs_sdpa(k: str) -> list[float]:
        return [r[k]["host_us"] / min(r["sdpa_flash"]["host_us"], r["sdpa_cudnn"]["host_us"]) for r in rows]

    sm90, mma = vs_sdpa("pykern"), vs_sdpa("pykern_mma_sync")
    decode = [r["pykern_host_us"] / r["sdpa_host_us"] for r in dec if r.get("sdpa_host_us")]
    expect(report(R27), rf"Host overhead per call is ([\d.]+){D}([\d.]+)× SDPA's \(beside the faster SDPA backend of "
           rf"each shape: sm_90a forward ([\d.]+){D}([\d.]+)×, mma\.sync ([\d.]+){D}([\d.]+)×; `PagedDecodePlan\.run` "
           rf"([\d.]+){D}([\d.]+)×\)", *rng(sm90 + mma + decode, f1), *rng(sm90, f1), *rng(mma, f1),
           *rng(decode, f1))


# --------------------------------------------------------------------------- 2026-11-27: decode

def decode_cells(report_name: str, name: str = "decode.json") -> dict[tuple, dict[int, dict]]:
    cells: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for r in data(report_name, name):
        if r.get("what") == "decode":
            cells[(r["kv"], r["batch"], r["ctx"])][r["gqa"]] = r
    return cells


def spread(by_gqa: dict[int, dict]) -> float:
    gb = [r["pykern_GBps"] for r in by_gqa.values()]
    return 100 * (max(gb) / min(gb) - 1)


def copy_gbps(report_name: str) -> float:
    return next(r["GBps_read_plus_write"] for r in data(report_name, "ceilings.json") if r["what"] == "copy")


def test_decode_gqa_spread() -> None:
    cells = decode_cells(R27)
    assert sum(len(v) for v in cells.values()) == 66
    long = [spread(v) for (kv, b, c), v in cells.items() if b >= 8 and c >= 8192]
    short = {k: spread(v) for k, v in cells.items() if not (k[1] >= 8 and k[2] >= 8192)}
    worst = max(short, key=short.get)
    kv, b, c = worst
    expect(report(R27), rf"GQA 1, 4 and 8 give the same GB/s within ([\d.]+)% from batch 8 × 8k up \(batch ≥ 8 and ≥ "
           rf"8k keys\)\. At 1k keys or batch 1 they spread by up to ([\d.]+)% \((\w+) (\d+) × 1k: (\d+) GB/s at GQA 1, "
           rf"(\d+) at GQA 8\)", f1(max(long)), f1(max(short.values())), kv, str(b),
           f0(cells[worst][1]["pykern_GBps"]), f0(cells[worst][8]["pykern_GBps"]))
    assert c == 1024


def test_decode_percent_of_copy_and_fp8() -> None:
    cells = decode_cells(R27)
    copy = copy_gbps(R27)
    pct = lambda k: [100 * r["pykern_GBps"] / copy for r in cells[k].values()]  # noqa: E731
    busy = [p for k in (("bf16", 64, 8192), ("bf16", 64, 32768), ("bf16", 256, 1024)) for p in pct(k)]
    expect(report(R27), rf"bf16 at batch 64 × 8k / 32k and at batch 256 × 1k: (\d+){D}(\d+)% \(64 × 1k: (\d+){D}(\d+)%\)",
           *rng(busy, f0), *rng(pct(("bf16", 64, 1024)), f0))
    fp8 = max(p for k in cells if k[0] == "e4m3" for p in pct(k))
    assert fp8 < 64
    expect(report(R27), r"FP8 never passes (\d+)%", "64")
    expect(report(R27), r"FP8 decode never passes (\d+)% of copy bandwidth", "64")
    speedup = {(b, c, g): cells[("bf16", b, c)][g]["pykern_us"] / cells[("e4m3", b, c)][g]["pykern_us"]
               for (kv, b, c) in cells if kv == "e4m3" for g in cells[("e4m3", b, c)]}
    expect(report(R27), rf"Halving the bytes bought only ([\d.]+){D}([\d.]+)× over bf16 from batch 8 × 8k up "
           rf"\(([\d.]+){D}([\d.]+)× over all (\d+) cells\)",
           *rng(v for (b, c, g), v in speedup.items() if b >= 8 and c >= 8192), *rng(speedup.values()),
           str(len(speedup)))
    one_k = [r["pykern_us"] for kv in ("bf16", "e4m3") for r in cells[(kv, 1, 1024)].values()]
    expect(report(R27), rf"\(([\d.]+){D}([\d.]+) µs at batch 1 × 1k, any GQA and KV type\)", *rng(one_k, f1))


def test_decode_host_bottleneck() -> None:
    cells = decode_cells(R27)
    small = [r["pykern_us"] for (kv, b, c), v in cells.items() if b <= 8 and (c < 32768 or b == 1) for r in v.values()]
    host = [r["pykern_host_us"] for v in cells.values() for r in v.values()]
    big = [r["pykern_us"] for kv in ("bf16", "e4m3") for r in cells[(kv, 8, 32768)].values()]
    assert max(small) < min(host)  # the host is the bottleneck in every one of those cells
    expect(report(R27), rf"the decode kernels take (\d+){D}(\d+) µs, less than the host's (\d+){D}(\d+) µs, so the host "
           rf"is the bottleneck there \(batch 8 × 32k: (\d+){D}(\d+) µs\)", *rng(small, f0), *rng(host, f0),
           *rng(big, f0))


# --------------------------------------------------------------------------- 2026-11-27: memory-bound ops, MoE, model

def membound(report_name: str) -> dict[tuple[str, str], float]:
    rows = {}
    for line in (MEASURED / report_name / "membound.txt").read_text().splitlines():
        m = re.match(r"bench (\S+)\s+.+?\s+bf16 (\S+)\s+([\d.]+) us", line)
        if m:
            rows[(m[1], m[2])] = float(m[3])
    return rows


def test_membound_peers_that_beat_pykern_are_the_bold_ones() -> None:
    rows = membound(R27)
    table = {}  # op -> (torch cell, Liger cell) as the report's table writes them
    for line in (report(R27)).read_text().splitlines():
        m = re.match(r"\| (\w+)(?: fwd\+bwd)? \| [^|]+ \| [\d.]+ \| \d+ \| \d+% \| ([^|]+) \| ([^|]+) \|$", line)
        if m:
            table[m[1] + ("_fwd_bwd" if "fwd+bwd" in line else "")] = (m[2].strip(), m[3].strip())
    assert len(table) == 15
    faster = {(op, impl) for (op, impl), us in rows.items() if impl != "pykern" and op in table
              and us < rows[(op, "pykern")]}
    bold = {(op, impl) for op, cells in table.items() for impl, cell in zip(("torch", "liger"), cells)
            if cell.startswith("**")}
    assert bold == faster, (bold, faster)
    r = lambda op, impl: f2(rows[(op, "pykern")] / rows[(op, impl)])  # noqa: E731
    expect(report(R27), rf"Liger's layer_norm is ([\d.]+)× faster than ours \(torch's ([\d.]+)×\), and its silu_gate "
           rf"([\d.]+)×", r("layer_norm", "liger"), r("layer_norm", "torch"), r("silu_gate", "liger"))
    expect(report(R27), rf"torch's eager gelu and gelu_backward are ([\d.]+){D}([\d.]+)× faster than ours",
           *sorted((r("gelu", "torch"), r("gelu_backward", "torch"))))


def test_moe_grouped_gemm_beside_torch() -> None:
    rows = [json.loads(line) for line in (MEASURED / R27 / "moe.txt").read_text().splitlines()
            if line.startswith("{")]
    assert len(rows) == 4
    peers = ("torch_grouped_mm", "transformers_grouped_mm", "pykern_grouped_gemm")
    assert all(max(peers, key=lambda p: r[f"{p}_tflops"]) == "torch_grouped_mm" for r in rows)
    ratios = rng(r["pykern_grouped_gemm_tflops"] / r["torch_grouped_mm_tflops"] for r in rows)
    expect(report(R27), rf"grouped GEMM runs at ([\d.]+){D}([\d.]+)× of torch's Hopper grouped GEMM", *ratios)
    expect(report(R27), rf"MoE grouped GEMM\W* runs at ([\d.]+){D}([\d.]+)× of `torch\._grouped_mm`", *ratios)


def model_rows(report_name: str) -> tuple[dict, dict]:
    rows = {r["patched"]: r for r in data(report_name, "model.json")}
    return rows[False], rows[True]


def test_model_summary_2026_11_27() -> None:
    plain, patched = model_rows(R27)
    assert plain["greedy_tail"] == patched["greedy_tail"]
    expect(report(R27), r"uses (\d+)% less memory .* decodes ([\d.]+)× faster\. It trains (\d+)% slower\. Of the (\d+) "
           r"greedy tokens each decodes, the last (\d+) \(all that model\.json keeps\) are the same",
           f0(100 * (1 - patched["peak_GiB"] / plain["peak_GiB"])),
           f1(plain["decode_ms_per_token_b1"] / patched["decode_ms_per_token_b1"]),
           f0(100 * (1 - patched["train_tokens_per_s"] / plain["train_tokens_per_s"])),
           "64", str(len(plain["greedy_tail"])))


def test_tools_measure_gpu_decodes_64_tokens_and_keeps_8() -> None:
    # the "64 greedy tokens, the last 8 kept" above is what tools/measure_gpu.py model does
    src = (DOCS.parent / "tools" / "measure_gpu.py").read_text()
    assert "max_new_tokens=64" in src and 'row["greedy_tail"] = out[0, -8:]' in src


# --------------------------------------------------------------------------- 2026-11-28

def sampling(report_name: str, name: str) -> dict[tuple[str, int], dict]:
    return {(r["op"], r["batch"]): r for r in data(report_name, name) if r.get("what") == "sampling"}


TORCH_SAMPLING = "torch sort + top-k/top-p + multinomial"
TOPKP = ("top_k_sampling_from_probs k50", "top_p_sampling_from_probs p0.9", "top_k_top_p_sampling_from_probs k50 p0.9")
RENORM = ("top_k_renorm_probs k50", "top_p_renorm_probs p0.9")


def over_torch(s: dict, op: str, batch: int) -> float:
    return s[(TORCH_SAMPLING, batch)]["us"] / s[(op, batch)]["us"]


def test_sampling_beside_torch_2026_11_28() -> None:
    s = sampling(R28, "sampling.json")
    big = lambda ops: [over_torch(s, op, b) for op in ops for b in (64, 256)]  # noqa: E731
    ours = ("sampling_from_probs",) + TOPKP + RENORM
    slow = [1 / over_torch(s, op, 1) for op in TOPKP + RENORM]
    assert all(v > 1 for v in slow)
    expect(report(R28), rf"At batch 64 and 256 the ops beat torch's sort path ([\d.]+){D}([\d.]+)x \(sampling_from_probs "
           rf"([\d.]+){D}([\d.]+)x, the top-k / top-p ops ([\d.]+){D}([\d.]+)x, the renorms ([\d.]+){D}([\d.]+)x\); at "
           rf"batch 1 only sampling_from_probs is faster \(([\d.]+)x\), the others take ([\d.]+){D}([\d.]+)x torch's time",
           *rng(big(ours), f1), *rng(big(("sampling_from_probs",)), f1), *rng(big(TOPKP), f1), *rng(big(RENORM), f1),
           f1(over_torch(s, "sampling_from_probs", 1)), *rng(slow))
    host = [r["host_us"] for r in s.values() if "host_us" in r]
    expect(report(R28), rf"Host time a call: (\d+){D}(\d+) us\.", *rng(host, f0))
    before = sampling(R28, "sampling_host_copy_sync.json")["sampling_from_probs", 1]
    expect(report(R28), r"`sampling_host_copy_sync\.json`: (\d+) us GPU time and (\d+) us host time a call at batch 1",
           f0(round(before["us"], -1)), f0(before["host_us"]))


def test_decode_2026_11_28_ranges() -> None:
    cells = decode_cells(R28)
    rel = [r["rel_err"] for v in cells.values() for r in v.values() if "rel_err" in r]
    expect(report(R28), rf"relative error ([\d.]+e-\d) to ([\d.]+e-\d) \(bf16 and e4m3\)",
           e1(min(rel)), e1(max(rel)))
    copy = copy_gbps(R28)
    two = [r["pykern_GBps"] for kv, b, c in [("bf16", 64, 8192), ("bf16", 64, 32768)] for r in cells[(kv, b, c)].values()]
    one = [r["one_split_GBps"] for c in (8192, 32768) for r in cells[("bf16", 64, c)].values()]
    expect(report(R28), rf"at 8k and 32k keys (\d+)-(\d+) \((\d+)-(\d+)% of the copy, (\d+)-(\d+)% of the published "
           rf"peak\), the one-split launch beside it (\d+)-(\d+)", *rng(two, f0),
           *rng((100 * g / copy for g in two), f0), *rng((100 * g / 4800 for g in two), f0), *rng(one, f0))


def test_membound_2026_11_28_beside_2026_11_27() -> None:
    a, b = membound(R27), membound(R28)
    slow_ops = ("rms_norm", "rms_norm_backward", "add_rms_norm", "add_rms_norm_backward", "layer_norm",
                "layer_norm_backward", "rope", "rope_inverse", "embedding")
    same_ops = ("silu_gate", "silu_gate_backward", "gelu", "gelu_backward", "gelu_gate", "gelu_gate_backward",
                "softmax_backward", "transpose_2d", "embedding_backward", "cross_entropy_fwd_bwd")
    r = lambda op, impl: b[(op, impl)] / a[(op, impl)]  # noqa: E731
    pk = [r(op, "pykern") for op in slow_ops]
    lg = [r(op, "liger") for op in slow_ops if (op, "liger") in a and (op, "liger") in b]
    torch = [r(op, "torch") for op in slow_ops + same_ops]
    same = [abs(r(op, impl) - 1) * 100 for op in same_ops for impl in ("pykern", "torch", "liger")
            if (op, impl) in a and (op, impl) in b]
    assert min(pk) > 1.2 and max(same) < 6
    expect(report(R28), rf"Its pykern and Liger rows for the norms, rope and the embedding forward were ([\d.]+)-([\d.]+)x "
           rf"slower than on 2026-11-27 \(pykern ([\d.]+)-([\d.]+)x, Liger ([\d.]+)-([\d.]+)x\), with torch's rows at "
           rf"([\d.]+)-([\d.]+)x their earlier times", *rng(pk + lg, f1), *rng(pk), *rng(lg), *rng(torch))
    expect(report(R28), r"embedding backward and cross entropy rows agree with 2026-11-27 within (\d+)%", "6")


def test_model_2026_11_28() -> None:
    for name in (R28, R28B):
        plain, patched = model_rows(name)
        assert plain["greedy_tail"] == patched["greedy_tail"] and len(plain["greedy_tail"]) == 8
    expect(report(R28), r"the same last (\d+) greedy tokens \(of 64\)", "8")
    expect(report(R28B), r"The same last (\d+) greedy tokens \(of 64\)", "8")


# --------------------------------------------------------------------------- 2026-11-28, second run

def test_short_decode_one_split_against_two() -> None:
    rows = [r for r in data(R28B, "decode_small.json") if "two_split_us" in r]
    assert len(rows) == 6 and all(r["two_split_us"] > r["pykern_us"] for r in rows)
    gap = rng((r["two_split_us"] - r["pykern_us"] for r in rows), f1)
    expect(report(R28B), rf"one split was faster than two by ([\d.]+)-([\d.]+) us in all six cells", *gap)
    expect(DOCS / "serving.md", rf"two splits ([\d.]+)-([\d.]+) us slower", *gap)
    rel = [r["rel_err"] for r in data(R28B, "decode_small.json")]
    expect(report(R28B), r"relative error ([\d.]+e-\d) to ([\d.]+e-\d), 20 repeated runs", e1(min(rel)), e1(max(rel)))


def test_sampling_beside_torch_2026_11_28_second_run() -> None:
    s = sampling(R28B, "sampling.json")
    ours = ("sampling_from_probs",) + TOPKP + RENORM
    big = [over_torch(s, op, b) for op in ours for b in (64, 256)]
    sfp_big = [over_torch(s, "sampling_from_probs", b) for b in (64, 256)]
    at1 = {op: over_torch(s, op, 1) for op in ours}
    expect(report(R28B), rf"At batch 64 and 256 the ops beat torch's sort path ([\d.]+)-([\d.]+)x \(sampling_from_probs "
           rf"([\d.]+)-([\d.]+)x\); at batch 1 sampling_from_probs is ([\d.]+)x faster than it, top-k sampling ([\d.]+)x "
           rf"and top-k \+ top-p ([\d.]+)x, top_k_renorm_probs ([\d.]+)x, while top-p sampling takes ([\d.]+)x its time "
           rf"\(top_p_renorm_probs ([\d.]+)x\)",
           *rng(big, f1), *rng(sfp_big, f1), f1(at1["sampling_from_probs"]), f1(at1[TOPKP[0]]), f1(at1[TOPKP[2]]),
           f1(at1[RENORM[0]]), f1(1 / at1[TOPKP[1]]), f1(1 / at1[RENORM[1]]))
    top_p_over_top_k = [s[(TOPKP[1], b)]["us"] / s[(TOPKP[0], b)]["us"] for b in (1, 64, 256)]
    expect(report(R28B), rf"top-p sampling takes ([\d.]+)-([\d.]+)x top-k's time above", *rng(top_p_over_top_k, f1))
    host4 = [r["host_us"] for r in s.values() if "host_us" in r]
    host1 = [r["host_us"] for r in sampling(R28B, "sampling_block_scan_draw.json").values() if "host_us" in r]
    expect(report(R28B), rf"Host time a call (\d+)-(\d+) us\.", *rng(host4, f0))
    expect(report(R28B), rf"The H200's host spent (\d+)-(\d+) us a call in call 1's sampling ops \(`host_us` in "
           rf"`sampling_block_scan_draw\.json`; (\d+)-(\d+) us in call 4's `sampling\.json`\)",
           *rng(host1, f0), *rng(host4, f0))


def test_h200_l2_is_what_the_device_reported() -> None:
    """The H200's L2 is the size the device reported in every measured run (ceilings.json, `l2_bytes`), and each use
    of it agrees: the attention model's H200 (one constant), the sampling model's (which reads that one) and the
    reports' own words (60 MiB, not the 60 MB a datasheet-style round figure would be)."""
    import importlib.util

    from pykern.bench import attention_model as am

    reported = {next(r for r in data(name, "ceilings.json") if r["what"] == "device")["l2_bytes"]
                for name in (R27, R28, R28B)}
    assert reported == {62914560} == {am.H200.l2_bytes}
    spec = importlib.util.spec_from_file_location("sampling_model_l2", DOCS.parent / "tools" / "sampling_model.py")
    sm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sm)
    assert sm.L2_BYTES == am.H200.l2_bytes
    for name in (R27, R28, R28B):
        text = prose(report(name))
        assert "60 MiB L2" in text and "60 MB L2" not in text, name
    assert "62914560 bytes" in prose(report(R27))


@pytest.mark.parametrize("name", [R27, R28, R28B])
def test_every_data_file_a_report_cites_exists(name: str) -> None:
    text = report(name).read_text()
    cited = set(re.findall(r"([\w.-]+\.(?:json|txt))\b", text))
    assert cited, name
    missing = sorted(c for c in cited if not any((MEASURED / d / c).exists() for d in (R27, R28, R28B))
                     and c not in {"report.json"})
    assert not missing, f"{name}.md cites {missing}, which no docs/measured/ folder holds"
