"""report.json (everything, for dashboards) and report.md (the tables a person reads) of one gpucheck run."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

REPORT_VERSION = 1


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.2f}"
    text = str(v).replace("|", "\\|").replace("\n", " ")
    return text


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write(out_dir: Path, doc: dict[str, Any]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    pj, pm = out_dir / "report.json", out_dir / "report.md"
    pj.write_text(json.dumps(_jsonable(doc), indent=1) + "\n")
    pm.write_text(markdown(doc))
    return pj, pm


def markdown(doc: dict[str, Any]) -> str:
    parts = [f"# pykern GPU check: {doc['status']}", "",
             f"exit code {doc['exit_code']}, {doc['seconds']:.0f} s, `{doc['command']}`, started {doc['started']}", ""]
    dev = doc["device"]
    parts += ["## Device", ""]
    if not dev.get("gpu"):
        parts += [f"**No GPU**: {dev.get('reason', '')}", ""]
    rows = [("name", dev.get("name")), ("compute capability", ".".join(map(str, dev.get("cc", [])))),
            ("arch", dev.get("arch")), ("driver (CUDA)", dev.get("driver_version")),
            ("memory", f"{dev.get('memory_bytes', 0) / 2**30:.1f} GiB" if dev.get("memory_bytes") else None),
            ("NVRTC", dev.get("nvrtc")), ("compile target", doc.get("limits", {}).get("arch"))]
    attrs = dev.get("attributes", {})
    rows += [(k.lower(), v) for k, v in attrs.items()]
    peaks = doc.get("peaks") or {}
    if peaks:
        rows += [("peak DRAM bandwidth", f"{peaks['bandwidth'] / 1e12:.3f} TB/s" if peaks.get("bandwidth") else None),
                 ("peak bf16 tensor (dense)", f"{peaks['bf16_tensor'] / 1e12:.1f} TFLOP/s"
                  if peaks.get("bf16_tensor") else None),
                 ("peak fp32", f"{peaks['fp32'] / 1e12:.1f} TFLOP/s" if peaks.get("fp32") else None),
                 ("peak note", " ".join(x for x in (peaks.get("part"), peaks.get("note")) if x))]
    parts += [table(("property", "value"), [r for r in rows if r[1] not in (None, "", "0.0")]), ""]
    parts += ["## Backends", "", table(("backend", "usable", "why not"),
                                       [(b["backend"], "yes" if b["usable"] else "no", b["why"])
                                        for b in doc.get("backends", [])]), ""]

    lim = doc.get("limits")
    if lim:
        parts += ["## Kernel launch limits", "",
                  f"{lim.get('status')}: {lim.get('failed', 0)} of {len(lim.get('rows', []))} kernels cannot launch "
                  f"as the ops launch them on this device (arch {lim.get('arch')}).", ""]
        parts += [table(("kernel", "regs", "static smem", "max threads", "launches (threads/dyn smem)",
                         "min blocks/SM", "spill", "status", "problems"),
                        [(r["kernel"], r["registers"], r["static_smem"], r["max_threads"],
                          " ".join(f"{t}/{s}" for t, s in r["launches"]) or "-", r["min_blocks_per_sm"],
                          r["spill_bytes"], r["status"], "; ".join(r["problems"]) or r.get("note", ""))
                         for r in lim.get("rows", [])]), ""]
        for e in lim.get("errors", []):
            parts += [f"- {e}"]
        parts += [""]

    dt = doc.get("difftest")
    if dt:
        parts += ["## Difftest (nvrtc vs numba vs float64)", "", f"{dt.get('status')}: {dt.get('message', '')}", ""]
        if dt.get("note"):
            parts += [dt["note"], ""]
        if dt.get("cases"):
            parts += [table(("case", "kernels", "backends", "max_abs", "max_rel", "verdict"),
                            [(c["id"], ",".join(c["kernels"]), "|".join(b["label"] for b in c["backends"]),
                              max((b["max_abs"] for b in c["backends"] if isinstance(b["max_abs"], float)),
                                  default=None),
                              max((b["max_rel"] for b in c["backends"] if isinstance(b["max_rel"], float)),
                                  default=None), c["verdict"]) for c in dt["cases"]]), ""]
        for f in dt.get("failures", []):
            parts += [f"- {f}"]
        parts += [""]

    pt = doc.get("pytest")
    if pt:
        parts += ["## pytest -m gpu", "", f"{pt.get('status')}: {pt.get('message', '')}", ""]
        if pt.get("counts"):
            parts += [table(tuple(pt["counts"]), [tuple(pt["counts"].values())]), ""]

    sz = doc.get("sanitizer")
    if sz:
        parts += ["## compute-sanitizer", "", f"{sz.get('status')}: {sz.get('message', '')}", ""]
        if sz.get("findings"):
            parts += ["### Findings", "", table(("tool", "kernel", "case", "message"),
                                                [(f["tool"], f["kernel"], f["case"],
                                                  f["message"] + (" — " + "; ".join(f["details"][:3])
                                                                  if f.get("details") else ""))
                                                 for f in sz["findings"]]), ""]
        if sz.get("runs"):
            clean = [r for r in sz["runs"] if r["status"] == "clean"]
            other = [r for r in sz["runs"] if r["status"] != "clean"]
            parts += [f"{len(clean)} runs clean; report.json lists every run's command.", ""]
            if other:
                parts += ["### Runs that were not clean", "",
                          table(("tool", "kernel", "case", "status", "seconds", "note"),
                                [(r["tool"], r["kernel"], r["case"], r["status"], r["seconds"], r["message"])
                                 for r in other]), ""]

    bn = doc.get("bench")
    if bn:
        parts += ["## Benchmarks", "", f"{bn.get('status')}: {bn.get('message', '')}", ""]
        if bn.get("rows"):
            parts += [table(("op", "shape", "dtype", "impl", "median us", "rate", "unit", "% of peak", "status"),
                            [(r["op"], r["shape"], r["dtype"], r["impl"], r["median_us"], r["rate"], r["unit"],
                              r["pct_peak"], r["status"] + (f" ({r['message']})" if r["message"] else ""))
                             for r in bn["rows"]]), ""]

    parts += ["## Failures", ""]
    parts += [f"- {f}" for f in doc.get("failures", [])] or ["none"]
    return "\n".join(parts) + "\n"
