#!/usr/bin/env python
"""SASS instruction mix of pykern's kernels, per kernel and arch, from `cuobjdump -sass` (no GPU needed).

    python tools/sass_report.py --kernels 'attention_fwd*' --arch sm_80 --arch sm_90 [--json]

Each kernel source is compiled with pykern's own compiler (or read from its cache) for every arch, the
cubin is disassembled with cuobjdump (the `nvidia-cuda-cuobjdump` wheel puts it in
site-packages/nvidia/cu13/bin; a `cuobjdump` on PATH or $CUOBJDUMP also works), and the opcodes are
counted into the groups that tell how a kernel will run on a GPU: tensor-core MMAs (HMMA, of which
HMMA_BF16 take bf16 inputs: HMMA.16816.F32.BF16, the rest f16 ones; HGMMA),
ldmatrix (LDSM), cp.async (LDGSTS), global loads and stores by width, hardware bf16/f16 packing (F2FP, of
which F2FP_F16 are the f16 ones: F2FP.F16.F32.PACK_AB, printed F2FP.PACK_AB on sm_80), f16 -> fp32
widening (HADD2_F32: HADD2.F32),
FFMA, MUFU (ex2, rcp...), barriers, shuffles and local memory (LDL/STL: spills or stack arrays).

Tests load this file by path and call `instruction_mix(kernels, archs)`.

`--inflight` prints, per kernel and arch, the 16-byte global loads (LDG.E.128) a thread issues before the first
instruction that reads one of their registers, batch by batch in address order (a linear scan: branches are
not followed): the loads in flight a thread keeps. `--loops` prints, per kernel and arch, the steady-state loop metric of matmul-shaped kernels (see
docs/design.md, "Judging GPU speed without a GPU"): among the backward branches whose body holds
MMAs and no inner loop, the one with the most MMAs (the leanest of equals); its warp-instructions (NOPs excluded) per
m16n8k16-equivalent MMA (HMMA.16816 counts 1, HMMA.1688 1/2, HGMMA m64nNk16 N/8, QGMMA m64nNk32 2N/8:
the fp8 wgmma's k32 is two k16s' flops, as QMMA.16832 counts 2).
"""
from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

# The columns of the table, in order; `total` is every instruction (NOPs excluded).
COLUMNS = ("HMMA", "HMMA_BF16", "HGMMA", "LDSM", "LDGSTS", "LDG32", "LDG64", "LDG128", "LDGsub", "STG32", "STG64", "STG128",
           "STGsub", "F2FP", "F2FP_F16", "HADD2_F32", "FFMA", "MUFU", "BAR", "SHFL", "LDL", "STL", "total")

# Modifiers may hold lower case: HGMMA.64x128x16.F32.BF16 (its shape must reach _mma_weight whole).
_INSN = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9_]+)*)")
_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")


class CuobjdumpUnavailable(RuntimeError):
    """No cuobjdump binary could be found (install the nvidia-cuda-cuobjdump wheel)."""


def find_cuobjdump() -> str:
    """Path of a cuobjdump binary: $CUOBJDUMP, PATH, then the nvidia-cuda-cuobjdump wheel's bin folder."""
    env = os.environ.get("CUOBJDUMP")
    if env and os.access(env, os.X_OK):
        return env
    found = shutil.which("cuobjdump")
    if found:
        return found
    roots = []
    try:
        import nvidia  # the namespace package that the NVIDIA wheels install into

        roots += list(getattr(nvidia, "__path__", []))
    except ImportError:
        pass
    roots += [os.path.join(p, "nvidia") for p in sys.path if p]
    for root in roots:
        for cand in sorted(glob.glob(os.path.join(root, "*", "bin", "cuobjdump"))) + \
                sorted(glob.glob(os.path.join(root, "cuda_cuobjdump", "bin", "cuobjdump"))):
            if os.access(cand, os.X_OK):
                return cand
    raise CuobjdumpUnavailable("cuobjdump not found: pip install nvidia-cuda-cuobjdump (or set CUOBJDUMP)")


def _width(mods: str) -> str:
    """32 / 64 / 128 / 'sub' (8- or 16-bit) from an LDG/STG modifier string like '.E.128' or '.E.U16'."""
    parts = mods.split(".")
    if "128" in parts:
        return "128"
    if "64" in parts:
        return "64"
    if any(p in ("U8", "S8", "U16", "S16") for p in parts):
        return "sub"
    return "32"


def classify(opcode: str, mods: str) -> str | None:
    """The column one SASS instruction counts in (besides `total`), or None."""
    if opcode in ("HMMA", "QMMA", "HGMMA", "LDSM", "LDGSTS", "F2FP", "FFMA", "MUFU", "BAR", "SHFL", "LDL", "STL"):
        return opcode
    if opcode in ("LDG", "STG"):
        return opcode + _width(mods)
    return None


def count_sass(text: str) -> dict[str, Counter]:
    """{kernel: Counter(column -> count)} from cuobjdump -sass output of one cubin."""
    out: dict[str, Counter] = {}
    cur: Counter | None = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = out.setdefault(m.group(1), Counter())
            continue
        if cur is None:
            continue
        m = _INSN.match(line)
        if not m:
            continue
        op, mods = m.group(1), m.group(2)
        if op == "NOP":
            continue
        cur["total"] += 1
        col = classify(op, mods)
        if col:
            cur[col] += 1
        if op == "HMMA" and ".BF16" in mods:  # bf16 inputs; HMMA.16816.F32 alone is f16 x f16 -> f32
            cur["HMMA_BF16"] += 1
        elif op == "F2FP" and ".PACK_AB" in mods and ".BF16" not in mods:  # the f16 pack (no .BF16)
            cur["F2FP_F16"] += 1
        elif op == "HADD2" and mods.startswith(".F32"):
            cur["HADD2_F32"] += 1
    return out


_ADDR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRA = re.compile(r"(?:@!?U?P[T0-9]+\s+)?BRA(?:\.[A-Z.]+)?\s+(?:`?\(?\.?L?_?[^ ]*\)?\s*)?(0x[0-9a-f]+)")


def _mma_weight(op: str, mods: str) -> float:
    """m16n8k16-equivalents of one tensor-core instruction (0 for anything else)."""
    if op == "HMMA":
        if ".16816" in mods:
            return 1.0
        if ".1688" in mods:
            return 0.5
        return 1.0
    if op == "QMMA":  # fp8 mma.sync (sm_89, sm_120): m16n8k32 is two m16n8k16s' flops
        return 2.0 if ".16832" in mods else 1.0
    if op == "HGMMA":
        m = re.search(r"\.64x(\d+)x16", mods)
        return int(m.group(1)) / 8 if m else 0.0
    if op == "QGMMA":  # fp8 wgmma (sm_90a): a warp's share of m64nNk32 is 2 N/8 m16n8k16s' flops
        m = re.search(r"\.64x(\d+)x32", mods)
        return 2 * int(m.group(1)) / 8 if m else 0.0
    return 0.0


def _instructions(text: str) -> dict[str, list[tuple[int, str, str, str]]]:
    """{kernel: [(address, opcode, operands, raw text)]} of a cuobjdump -sass listing, in address order."""
    funcs: dict[str, list[tuple[int, str, str, str]]] = {}
    cur: list | None = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        if cur is None:
            continue
        a = _ADDR.match(line)
        i = _INSN.match(line)
        if a and i:
            cur.append((int(a.group(1), 16), i.group(1), i.group(2), a.group(2)))
    return funcs


def _back_branches(insns: Sequence[tuple[int, str, str, str]]) -> list[tuple[int, int]]:
    """(target, branch address) of every backward BRA of one kernel's instructions: its loops."""
    backs = []
    for addr, op, _mods, body in insns:
        if op == "BRA":
            b = _BRA.search(body)
            if b and int(b.group(1), 16) <= addr:
                backs.append((int(b.group(1), 16), addr))
    return backs


def steady_state_loops(text: str) -> dict[str, dict[str, Any]]:
    """{kernel: {insns, mma, per_mma, start, end, ldsm, ldgsts, bar}} of each kernel's steady-state loop:
    the backward branch whose body [target, branch] holds MMAs and no other backward branch (no inner
    loop; an mbarrier try-wait's retry does not count as one), the one with the most MMAs if several (of those, the fewest instructions: boundary-tile
    copies of the loop, e.g. masked ones, are longer). Kernels without such a loop are absent."""
    funcs = _instructions(text)
    out: dict[str, dict[str, Any]] = {}
    for name, insns in funcs.items():
        backs = _back_branches(insns)
        # An mbarrier wait's retry (a SYNCS try-wait and the branch back to it, a few instructions) is a wait,
        # not a loop: ptxas places it inline in some kernels and out of line in others, and a loop holding one
        # is still flat.
        spins = {(lo, hi) for lo, hi in backs
                 if hi - lo <= 4 * 16 and any(lo <= a <= hi and op == "SYNCS" for a, op, _, _ in insns)}
        best = None
        for lo, hi in backs:
            if (lo, hi) in spins:
                continue
            if any(lo <= l2 and h2 <= hi and (l2, h2) != (lo, hi) and (l2, h2) not in spins for l2, h2 in backs):
                continue  # holds an inner loop
            body = [x for x in insns if lo <= x[0] <= hi and x[1] != "NOP"]
            mma = sum(_mma_weight(op, mods) for _, op, mods, _ in body)
            # Among loops with as many MMAs, the leanest: the others are the same tile loop's boundary
            # variants (a masked diagonal or ragged tile), which run once or twice per CTA.
            if mma and (best is None or mma > best["mma"] or (mma == best["mma"] and len(body) < best["insns"])):
                best = {"insns": len(body), "mma": mma, "per_mma": round(len(body) / mma, 3),
                        "start": hex(lo), "end": hex(hi),
                        "ldsm": sum(op == "LDSM" for _, op, _, _ in body),
                        "ldgsts": sum(op == "LDGSTS" for _, op, _, _ in body),
                        "bar": sum(op == "BAR" for _, op, _, _ in body)}
        if best:
            out[name] = best
    return out


_REG = re.compile(r"\bR(\d+)(?:\.64)?\b")


def load_batches(text: str, width: str = "128") -> dict[str, list[int]]:
    """{kernel: [n, ...]}: for each run of global loads of `width` bits (LDG.E.128 by default), how many are
    issued, in address order, before the first instruction that reads a register one of them writes (or a
    barrier): the loads a thread has in flight before it waits on the first. A linear scan of the listing
    (branches are not followed), so a batch split by a predicated branch counts as two."""
    regs_of = {"128": 4, "64": 2, "32": 1, "sub": 1}
    out: dict[str, list[int]] = {}
    for name, insns in _instructions(text).items():
        batches: list[int] = []
        pending: set[int] = set()
        n = 0
        for _addr, op, mods, body in insns:
            operands = body.split(";")[0]
            operands = operands[operands.find(op) + len(op) + len(mods):] if op in operands else operands
            if op == "LDG" and _width(mods) == width:
                toks = [int(t) for t in _REG.findall(operands)]
                if toks:
                    dst, srcs = toks[0], toks[1:]
                    if pending & set(srcs):  # an address from an earlier load of the batch: a dependent load
                        batches.append(n)
                        pending, n = set(), 0
                    pending |= set(range(dst, dst + regs_of[width]))
                    n += 1
                continue
            if not pending:
                continue
            toks = [int(t) for t in _REG.findall(operands)]
            reads = toks if op in ("STG", "STS", "ST", "RED", "ATOM", "BRA") else toks[1:]
            if op in ("BAR", "EXIT", "RET") or pending & set(reads):
                batches.append(n)
                pending, n = set(), 0
        if n:
            batches.append(n)
        out[name] = batches
    return out


def _targets(src: Path, archs: Sequence[str]) -> list[tuple[str, str]]:
    """(arch asked, target compiled) for one source: a source built only for arch-specific targets
    (`// pykern: arch sm_90a`) is compiled for the one a GPU of the asked arch runs (sm_90 -> sm_90a), and left out
    for archs it has none for."""
    from pykern.registry import source_archs

    only = source_archs(src.read_text(encoding="utf-8", errors="replace"), str(src))
    if not only:
        return [(a, a) for a in archs]
    return [(a, a + "a" if a + "a" in only else a) for a in archs if a in only or a + "a" in only]


def _cubins(kernels: str | Sequence[str], archs: Iterable[str]) -> Iterator[tuple[list[str], str, Any, str]]:
    """(names, arch, module, SASS text) for each source with kernels matching the glob(s) and each of the archs
    it builds for (its `a` target where the source names one), compiled through pykern's cache (a hit when
    already compiled); PTX-only targets are passed over."""
    from pykern import cache, compiler
    from pykern.registry import parse_file, source_files

    globs = [kernels] if isinstance(kernels, str) else list(kernels)
    archs = compiler.expand_archs(list(archs))
    tool = find_cuobjdump()
    for src in source_files():
        names = [s.name for s in parse_file(src) if any(fnmatch.fnmatchcase(s.name, g) for g in globs)]
        if not names:
            continue
        for arch, target in _targets(src, archs):
            mod = cache.get_module(src, target)
            if mod.kind == "cubin":
                yield names, arch, mod, disassemble(mod.image, tool)


def loop_metrics(kernels: str | Sequence[str] = "*", archs: Iterable[str] = ("sm_80", "sm_90")
                 ) -> dict[str, dict[str, dict[str, Any]]]:
    """{kernel: {arch: steady_state_loops row}} for the registered kernels matching the glob(s)."""
    result: dict[str, dict[str, dict[str, Any]]] = {}
    for names, arch, mod, sass in _cubins(kernels, archs):
        loops = steady_state_loops(sass)
        for k in names:
            if k in loops:
                result.setdefault(k, {})[arch] = loops[k]
    return result


def inflight_metrics(kernels: str | Sequence[str] = "*", archs: Iterable[str] = ("sm_80", "sm_90")
                     ) -> dict[str, dict[str, dict[str, Any]]]:
    """{kernel: {arch: {ldg128_max, ldg128_batches}}}: load_batches of 16-byte global loads (the largest batch is
    the most loads a thread of the kernel has in flight before it waits on one) for the kernels matching the
    glob(s)."""
    result: dict[str, dict[str, dict[str, Any]]] = {}
    for names, arch, mod, sass in _cubins(kernels, archs):
        batches = load_batches(sass)
        for k in names:
            b = batches.get(k, [])
            result.setdefault(k, {})[arch] = {"ldg128_max": max(b, default=0), "ldg128_batches": b}
    return result


def disassemble(image: bytes, cuobjdump: str | None = None) -> str:
    tool = cuobjdump or find_cuobjdump()
    with tempfile.TemporaryDirectory(prefix="pykern-sass-") as d:
        p = Path(d) / "m.cubin"
        p.write_bytes(image)
        r = subprocess.run([tool, "-sass", str(p)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"cuobjdump failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def instruction_mix(kernels: str | Sequence[str] = "*", archs: Iterable[str] = ("sm_80", "sm_90"),
                    *, with_resources: bool = False) -> dict[str, dict[str, dict[str, Any]]]:
    """{kernel: {arch: {column: count}}} for every registered kernel matching the glob(s).

    Compiles through pykern's cache (a hit when already compiled). With with_resources, each entry
    also carries the compiler's registers / spill_stores / spill_loads / shared_bytes.
    """
    result: dict[str, dict[str, dict[str, Any]]] = {}
    for names, arch, mod, sass in _cubins(kernels, archs):
        counts = count_sass(sass)
        for k in names:
            row: dict[str, Any] = {c: int(counts.get(k, Counter()).get(c, 0)) for c in COLUMNS}
            if with_resources and k in mod.resources:
                res = mod.resources[k].to_dict()
                row.update({f: res.get(f) for f in ("registers", "spill_stores", "spill_loads", "shared_bytes")})
            result.setdefault(k, {})[arch] = row
    return result


def _table(mix: dict[str, dict[str, dict[str, Any]]], columns: Sequence[str]) -> str:
    head = ["kernel", "arch", *columns]
    body = [[k, a, *(str(v.get(c, "")) for c in columns)] for k in sorted(mix) for a, v in mix[k].items()]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, body)])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/sass_report.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", action="append", metavar="GLOB", help="kernel name glob (repeatable; default *)")
    ap.add_argument("--arch", action="append", metavar="ARCH", help="sm_XX or 'all' (repeatable; default sm_80, sm_90)")
    ap.add_argument("--resources", action="store_true", help="add registers / spills / shared memory columns")
    ap.add_argument("--json", action="store_true", help="print JSON {kernel: {arch: {column: n}}}")
    ap.add_argument("--loops", action="store_true",
                    help="steady-state loop metric: warp-instructions per m16n8k16 MMA of the MMA loop")
    ap.add_argument("--inflight", action="store_true",
                    help="16-byte global loads issued before the first use of one (per batch, in address order)")
    args = ap.parse_args(argv)
    kernels, archs = args.kernels or ["*"], args.arch or ["sm_80", "sm_90"]
    if args.inflight:
        report, cols = partial(inflight_metrics, kernels, archs), ["ldg128_max", "ldg128_batches"]
    elif args.loops:
        report = partial(loop_metrics, kernels, archs)
        cols = ["insns", "mma", "per_mma", "ldsm", "ldgsts", "bar", "start", "end"]
    else:
        report = partial(instruction_mix, kernels, archs, with_resources=args.resources)
        cols = [*(["registers", "spill_stores", "shared_bytes"] if args.resources else []), *COLUMNS]
    try:
        rows = report()
    except CuobjdumpUnavailable as e:
        print(f"sass_report: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=2) if args.json else _table(rows, cols))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())


def inner_loops(text: str, innermost: bool = True) -> dict[str, list[dict[str, Any]]]:
    """{kernel: [{start, end, insns, ops}]} of each innermost loop (a backward branch whose body
    [target, branch] holds no other backward branch), NOPs left out; ops counts opcodes with their
    modifiers (e.g. 'LDS.128', 'LDGSTS.E.BYPASS.128'). For loops without MMAs (decode attention), where
    steady_state_loops finds nothing: tools/bench_decode.py models per-CTA issue from these bodies.
    innermost=False lists every loop (outer ones too), each with "bar" (barriers) and "inner" (the
    instructions of the innermost loops it holds)."""
    funcs = _instructions(text)
    out: dict[str, list[dict[str, Any]]] = {}
    for name, insns in funcs.items():
        backs = _back_branches(insns)
        rows = []
        leaves = [(lo, hi) for lo, hi in backs
                  if not any(lo <= l2 and h2 <= hi and (l2, h2) != (lo, hi) for l2, h2 in backs)]
        for lo, hi in (leaves if innermost else backs):
            body = [x for x in insns if lo <= x[0] <= hi and x[1] != "NOP"]
            row = {"start": hex(lo), "end": hex(hi), "insns": len(body),
                   "ops": dict(Counter(op + mods for _, op, mods, _ in body))}
            if not innermost:
                row["bar"] = sum(op == "BAR" for _, op, _, _ in body)
                row["inner"] = sum(sum(1 for x in body if l2 <= x[0] <= h2) for l2, h2 in leaves
                                   if lo <= l2 and h2 <= hi)
            rows.append(row)
        out[name] = rows
    return out
