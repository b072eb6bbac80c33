"""`python -m pykern.precompile`: compile every kernel source for every requested arch, in parallel, into the cache.

Cache hits are found in this process first (cheap), only misses go to worker processes: NVRTC holds the
GIL for most of a compile, so threads would not overlap. With --out DIR the results are also written
as a read-only bundle for PYKERN_CUBIN_DIR.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .errors import ArgumentError, CacheMiss, PykernError


@dataclass
class JobResult:
    source: Path
    arch: str
    module: Any = None  # cache.CachedModule
    error: str = ""
    seconds: float = 0.0
    kernels: tuple[str, ...] = field(default_factory=tuple)


def _compile_job(source: str, arch: str, options: tuple[str, ...], defines: dict[str, str] | None,
                 cache_root: str) -> tuple[Any, str, float]:
    """Worker body (also run inline): (CachedModule or None, error text, seconds)."""
    from . import cache

    t0 = time.perf_counter()
    try:
        mod = cache.get_module(source, arch, options, defines=defines, cache_root=cache_root,
                               use_bundle=False, jit=True)
        return mod, "", time.perf_counter() - t0
    except (PykernError, OSError) as e:  # OSError: a source deleted or unreadable since it was listed
        return None, f"{type(e).__name__}: {e}", time.perf_counter() - t0


def _parse_define(text: str) -> tuple[str, str | None]:
    name, sep, value = text.partition("=")
    return name, (value if sep else None)


def _build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m pykern.precompile",
        description=(
            "Compile every kernel source (kernels_cu/*.cu and the folders in PYKERN_KERNEL_PATH) for every "
            "--arch with NVRTC, in parallel, into pykern's cache (or a bundle folder with --out). Progress "
            "goes to stderr; a table per kernel and arch (registers, spill bytes, shared memory, stack, hit "
            "or compiled, time) ends the run. Exits 1 with the compiler log if any compile fails. "
            "A second run with the same arguments is all cache hits."
        ),
    )
    ap.add_argument("--arch", action="append", required=True, metavar="ARCH",
                    help="target: sm_XX / sm_XXa / sm_XXf (cubin), compute_XX (PTX, no resource report), "
                         "or 'all' (every sm_XX this NVRTC supports). Repeat or comma-separate.")
    ap.add_argument("--kernels", metavar="GLOB", action="append",
                    help="only sources defining a kernel whose name matches GLOB (fnmatch, repeatable); "
                         "the table lists only matching kernels")
    ap.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1, metavar="N",
                    help="worker processes for the compiles (default: CPU count, %(default)s here)")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--cache-dir", metavar="DIR",
                       help="cache folder to fill (default: PYKERN_CACHE_DIR, else $XDG_CACHE_HOME/pykern, "
                            "else ~/.cache/pykern)")
    where.add_argument("--out", metavar="DIR",
                       help="also write a self-contained bundle folder to use as PYKERN_CUBIN_DIR "
                            "(compiles still go through the default cache)")
    ap.add_argument("--option", action="append", default=[], metavar="OPT",
                    help="extra NVRTC option, part of the cache key; write it as --option=-lineinfo. "
                         "The library looks up modules with the options its backend uses (none by default), "
                         "so only precompile with options the backend will ask for.")
    ap.add_argument("--define", action="append", default=[], metavar="NAME[=VALUE]",
                    help="preprocessor define, part of the cache key")
    ap.add_argument("--fail-on-spill", action="store_true", help="exit 1 if any kernel spills registers")
    ap.add_argument("--json", action="store_true", help="print the results as JSON on stdout (no table)")
    return ap


def _select(globs: Sequence[str] | None) -> list[tuple[Path, tuple[str, ...]]]:
    """(source, kernel names to report) for every source with a kernel matching one of the globs."""
    from .registry import parse_file, source_files

    out = []
    for f in source_files():
        names = tuple(s.name for s in parse_file(f))
        if globs:
            names = tuple(n for n in names if any(fnmatch.fnmatchcase(n, g) for g in globs))
            if not names:
                continue
        out.append((f, names))
    return out


def _fmt_row(cols: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths))).rstrip()


def _table(rows: list[dict[str, Any]]) -> str:
    head = ["kernel", "arch", "regs", "spill st/ld", "smem", "stack", "status", "time"]
    body = []
    for r in rows:
        if r["kind"] == "ptx":
            res = ["-", "-", "-", "-"]
        else:
            res = [str(r["registers"]), f"{r['spill_stores']}/{r['spill_loads']}", str(r["shared_bytes"]),
                   str(r["stack_bytes"])]
        body.append([r["kernel"], r["arch"], *res, r["status"], f"{r['seconds']:.2f}s"])
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = [_fmt_row(head, widths), _fmt_row(["-" * w for w in widths], widths)]
    lines += [_fmt_row(b, widths) for b in body]
    if any(r["kind"] == "ptx" for r in rows):
        lines.append("(compute_XX rows are PTX: registers and spills are decided by the driver's JIT, not known here)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from . import cache, compiler
    from .sources import load as load_source

    args = _build_parser().parse_args(argv)
    err = sys.stderr
    t_start = time.perf_counter()
    try:
        archs = compiler.expand_archs(args.arch)
        if not archs:
            raise ArgumentError(f"--arch: expected at least one arch, got {args.arch!r}")
        if args.jobs < 1:
            raise ArgumentError(f"--jobs: expected >= 1, got {args.jobs}")
        defines = dict(_parse_define(d) for d in args.define) or None
        options = tuple(args.option)
        for arch in archs:  # a bad --option/--define is a usage error, not one failure per source
            compiler.portable_options(arch, options, defines)
        selected = _select(args.kernels)
        if args.out:  # found out now, not as a traceback after every compile has run
            try:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                if not os.access(args.out, os.W_OK | os.X_OK):
                    raise PermissionError("not writable")
            except OSError as e:
                raise ArgumentError(f"--out: cannot create the bundle folder {args.out!r} ({e})") from None
    except (PykernError, OSError) as e:
        print(f"precompile: {e}", file=err)
        return 2
    if not selected:
        print(f"precompile: no kernel sources{' match ' + repr(args.kernels) if args.kernels else ' found'}",
              file=err)
        return 2
    root = Path(args.cache_dir).expanduser() if args.cache_dir else cache.cache_dir()
    jobs = [(src, arch) for src, _ in selected for arch in archs]
    names = dict(selected)
    results: dict[tuple[Path, str], JobResult] = {}
    done = 0

    def report(r: JobResult) -> None:
        nonlocal done
        done += 1
        status = "FAILED" if r.error else ("hit" if r.module.hit else "compiled")
        print(f"[{done}/{len(jobs)}] {r.arch:<10} {r.source.name:<24} {status} ({r.seconds:.2f}s)", file=err,
              flush=True)

    # Hits first, in this process: a warm run never starts a worker.
    misses = []
    for src, arch in jobs:
        t0 = time.perf_counter()
        try:
            mod = cache.get_module(src, arch, options, defines=defines, cache_root=root, use_bundle=False, jit=False)
        except CacheMiss:
            misses.append((src, arch))
            continue
        except (PykernError, OSError) as e:
            r = JobResult(src, arch, error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
        else:
            r = JobResult(src, arch, module=mod, seconds=time.perf_counter() - t0)
        results[(src, arch)] = r
        report(r)

    if misses:
        n_workers = min(args.jobs, len(misses))
        if n_workers == 1:
            for src, arch in misses:
                mod, e, secs = _compile_job(str(src), arch, options, defines, str(root))
                r = results[(src, arch)] = JobResult(src, arch, module=mod, error=e, seconds=secs)
                report(r)
        else:
            import multiprocessing

            # spawn: a forked child would inherit whatever NVRTC/driver state the parent has loaded.
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=n_workers, mp_context=ctx) as pool:
                futs = {pool.submit(_compile_job, str(src), arch, options, defines, str(root)): (src, arch)
                        for src, arch in misses}
                for fut in as_completed(futs):
                    src, arch = futs[fut]
                    try:
                        mod, e, secs = fut.result()
                    except Exception as exc:  # a worker that died (out of memory, a crash inside NVRTC)
                        mod, e, secs = None, f"worker failed: {type(exc).__name__}: {exc}", 0.0
                    r = results[(src, arch)] = JobResult(src, arch, module=mod, error=e, seconds=secs)
                    report(r)

    rows: list[dict[str, Any]] = []
    failures: list[dict[str, str]] = []
    manifest: list[dict[str, Any]] = []
    for src, arch in jobs:
        r = results[(src, arch)]
        if r.error:
            failures.append({"source": str(src), "arch": arch, "error": r.error})
            continue
        mod = r.module
        if args.out:
            bpath = cache.export_to_bundle(mod, load_source(src), args.out)
            manifest.append({"source": src.name, "arch": arch, "kind": mod.kind, "kernels": list(mod.kernels),
                             "entry": str(bpath.relative_to(Path(args.out))), "cache_key": mod.digest})
        for k in names[src]:
            res = mod.resources.get(k)
            row = {"kernel": k, "source": str(src), "arch": arch, "kind": mod.kind,
                   "status": "hit" if mod.hit else "compiled", "seconds": round(r.seconds, 4), "key": mod.digest}
            if res is not None:
                row.update(res.to_dict())
            elif mod.kind == "cubin":
                row.update(registers=None, spill_stores=None, spill_loads=None, shared_bytes=None,
                           stack_bytes=None, barriers=None)
            rows.append(row)
    rows.sort(key=lambda r: (r["kernel"], archs.index(r["arch"])))
    spilling = [r for r in rows if (r.get("spill_stores") or 0) + (r.get("spill_loads") or 0) > 0]

    if args.out and not failures:
        out = Path(args.out)
        cache.write_atomic(out / cache.BUNDLE_MANIFEST, json.dumps({
            "format": cache.FORMAT_VERSION, "nvrtc": ".".join(map(str, compiler.nvrtc_version())),
            "options": list(options), "defines": defines or {}, "created": time.time(), "entries": manifest,
        }, indent=2).encode())

    wall = time.perf_counter() - t_start
    n_hits = sum(1 for r in results.values() if r.module is not None and r.module.hit)
    if args.json:
        print(json.dumps({
            "nvrtc": ".".join(map(str, compiler.nvrtc_version())), "archs": archs, "cache_dir": str(root),
            "out": args.out, "options": list(options), "jobs": len(jobs), "hits": n_hits,
            "compiled": len(jobs) - n_hits - len(failures), "wall_seconds": round(wall, 4),
            "results": rows, "failures": failures,
        }, indent=2))
    else:
        print(_table(rows))
        print(f"{len(jobs)} compiles ({n_hits} cache hits, {len(jobs) - n_hits - len(failures)} compiled, "
              f"{len(failures)} failed) in {wall:.2f}s; cache {root}" + (f"; bundle {args.out}" if args.out else ""))
    for f in failures:
        print(f"\nFAILED {Path(f['source']).name} for {f['arch']}:\n{f['error']}", file=err)
    if spilling:
        print("\nspilling kernels: " + ", ".join(f"{r['kernel']}@{r['arch']}" for r in spilling), file=err)
    if failures or (args.fail_on_spill and spilling):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
