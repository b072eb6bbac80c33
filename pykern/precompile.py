"""`python -m pykern.precompile`: compile every kernel source for every requested arch, in parallel, into the cache.

With --host it also (or only) builds every source for the host backend (the system C++ compiler), so
the first launch on the CPU does not stop to compile.

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
import signal
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


def builds_for(source: Path, arch: str) -> bool:
    """Whether `source` is compiled for `arch`: a source with `// pykern: arch sm_90a` only for the targets it
    names (never sm_80, sm_90, PTX...); every other source for every arch asked, `a` targets included."""
    from .registry import source_archs

    archs = source_archs(Path(source).read_text(encoding="utf-8", errors="replace"), str(source))
    return arch in archs if archs else True


def _opts_in(source: Path) -> bool:
    """Whether `source` has a `// pykern: arch` line (its kernels exist only for the targets it names)."""
    from .registry import source_archs

    return bool(source_archs(Path(source).read_text(encoding="utf-8", errors="replace"), str(source)))


def _skipped(selected: Sequence[tuple[Path, Any]], archs: Sequence[str],
             all_only: Sequence[str]) -> list[tuple[Path, str, str]]:
    """(source, arch, why) for each selected source not compiled for an arch that was asked."""
    from .registry import source_archs

    out = []
    for src, _ in selected:
        named = source_archs(Path(src).read_text(encoding="utf-8", errors="replace"), str(src))
        for arch in archs:
            if named and arch not in named:
                out.append((src, arch, f"its kernels exist only for {', '.join(sorted(named))} "
                                       "(a `// pykern: arch` line in the source)"))
            elif not named and arch in all_only:
                out.append((src, arch, "a portable source: its sm_XX cubins serve that GPU (an `a` target is built "
                                       "only for the sources that name it)"))
    return out


def _skipped_lines(skipped: Sequence[tuple[Path, str, str]]) -> list[str]:
    """The summary's "skipped" lines: one per reason and arch, naming the sources."""
    groups: dict[tuple[str, str], list[str]] = {}
    for src, arch, why in skipped:
        groups.setdefault((arch, why), []).append(Path(src).name)
    return [f"skipped for {arch}: {', '.join(names)}: {why}" for (arch, why), names in groups.items()]


def _asks_all(arch_args: Sequence[str]) -> bool:
    return any(p.strip().lower() == "all" for a in arch_args for p in str(a).split(","))


def _arch_specific_targets(selected: Sequence[tuple[Path, Any]], archs: Sequence[str]) -> list[str]:
    """The `a` targets the selected sources opt in to that this NVRTC can build and `archs` lacks, sorted."""
    from . import compiler
    from .registry import source_archs

    out: set[str] = set()
    for src, _ in selected:
        for a in source_archs(Path(src).read_text(encoding="utf-8", errors="replace"), str(src)):
            try:
                name = compiler.normalize_arch(a)
            except PykernError:  # a target this NVRTC does not know (e.g. a newer sm_XXXa)
                continue
            if name not in archs:
                out.add(name)
    return sorted(out, key=lambda n: compiler.parse_arch(n)[1])


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


class _Interrupted(BaseException):
    """SIGINT/SIGTERM reached the CLI: unwind to main, stop the workers, exit 128 + signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise _Interrupted(signum)


def _worker(tasks: Any, results: Any, threads: int) -> None:
    """A compile worker: takes (index, job args) until None; reports ("start", i, pid) then ("done", i, result).
    Its compiles use `threads` ptxas threads (PYKERN_COMPILE_THREADS in its own environment): the workers
    share the CPUs instead of each taking all of them.

    SIGINT is ignored here: a terminal's Ctrl-C reaches the whole process group, and the parent decides
    (it terminates the workers and cleans up after them). SIGTERM keeps its default: die at once, even
    inside NVRTC.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from .compiler import THREADS_ENV

    os.environ[THREADS_ENV] = str(threads)
    while True:
        item = tasks.get()
        if item is None:
            return
        i, job = item
        results.put(("start", i, os.getpid()))
        results.put(("done", i, _compile_job(*job)))


class _Workers:
    """N spawned worker processes over a task queue: unlike a ProcessPoolExecutor, which waits for every
    queued job on exit, these can be stopped mid-compile (terminate) and cleaned up after by pid."""

    def __init__(self, n: int, threads: int = 1) -> None:
        import multiprocessing

        # spawn: a forked child would inherit whatever NVRTC/driver state the parent has loaded.
        ctx = multiprocessing.get_context("spawn")
        self.tasks = ctx.Queue()
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(self.tasks, self.results, threads), daemon=True)
                      for _ in range(n)]
        for p in self.procs:
            p.start()

    def run(self, jobs: list[tuple[Any, ...]], on_start: Any = None) -> Any:
        """Yield (index, (module, error, seconds)) as compiles finish; a worker that dies fails its job.
        `on_start(index)` is called when a worker takes a job (the progress line "start ...")."""
        import queue

        for i, job in enumerate(jobs):
            self.tasks.put((i, job))
        for _ in self.procs:
            self.tasks.put(None)
        pending = set(range(len(jobs)))
        running: dict[int, int] = {}  # pid -> job index
        while pending:
            try:
                kind, i, value = self.results.get(timeout=0.2)
            except queue.Empty:
                for p in self.procs:
                    if p.exitcode not in (None, 0) and p.pid in running:
                        j = running.pop(p.pid)
                        pending.discard(j)
                        yield j, (None, f"worker failed: process {p.pid} exited with {p.exitcode} "
                                        "(out of memory, or a crash inside NVRTC)", 0.0)
                if not any(p.is_alive() for p in self.procs) and self.results.empty():
                    for j in sorted(pending):  # every worker is gone: nobody will take these
                        yield j, (None, "worker failed: no worker process left", 0.0)
                    return
                continue
            if kind == "start":
                running[value] = i
                if on_start is not None:
                    on_start(i)
                continue
            for pid, j in list(running.items()):
                if j == i:
                    del running[pid]
            pending.discard(i)
            yield i, value

    def close(self, root: Path) -> None:
        """Stop every worker (at once if still busy) and remove what a killed one left half-written."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 3.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for q in (self.tasks, self.results):
            q.cancel_join_thread()  # never block exit on a feeder thread whose reader is gone
            q.close()
        from . import cache

        cache.remove_leftovers(root, [p.pid for p in self.procs if p.pid is not None])


def _default_jobs() -> int:
    from .compiler import available_cpus

    return available_cpus()


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
            "or compiled, time) ends the run. Exits 1 with the compiler log if any compile fails, or if "
            "compiled modules could not be saved (cache folder or --out unwritable); 2 for bad usage; "
            "130/143 on SIGINT/SIGTERM, which stop queued and running compiles and leave no temp files "
            "or half bundle. Processes sharing a cache compile each key once (a lock file per key). "
            "A second run with the same arguments is all cache hits. --host builds every source for the "
            "host backend (CPU execution with the system C++ compiler) into the same cache folder instead of, "
            "or as well as, the NVRTC compiles; at least one of --arch and --host is needed."
        ),
    )
    ap.add_argument("--host", action="store_true",
                    help="build each source's host-backend library (g++/clang++ or $CXX, the flags the host "
                         "backend uses now, e.g. PYKERN_HOST_SANITIZE) into <cache>/host, --jobs at a time; "
                         "a progress bar on a terminal, one line per source otherwise")
    ap.add_argument("--arch", action="append", metavar="ARCH",
                    help="target: sm_XX / sm_XXa / sm_XXf (cubin), compute_XX (PTX, no resource report; "
                         "the driver JIT-compiles it for that GPU and every later one), or 'all' (every sm_XX "
                         "this NVRTC supports, PTX of the newest, and the `a` targets such as sm_90a that "
                         "sources name in a `// pykern: arch` line, for those sources only). Repeat or "
                         "comma-separate. An H100 is "
                         "sm_90; add sm_90a for the Hopper kernels (sources with a `// pykern: arch sm_90a` line, built only "
                         "for the `a` targets they name). sm_100a is accepted.")
    ap.add_argument("--kernels", metavar="GLOB", action="append",
                    help="only sources defining a kernel whose name matches GLOB (fnmatch, repeatable); "
                         "the table lists only matching kernels (--host: only those sources are built)")
    ap.add_argument("--jobs", "-j", type=int, default=_default_jobs(), metavar="N",
                    help="worker processes for the NVRTC compiles, and C++ compilers at a time for --host "
                         "(default: the CPUs this process may use, %(default)s here); 1 compiles in this "
                         "process, where a signal waits for the compile in progress. Each of the W compiles "
                         "running at once gives ptxas CPUs / W threads (at least 1, at most 8; PYKERN_COMPILE_THREADS "
                         "sets the count per compile instead)")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--cache-dir", metavar="DIR",
                       help="cache folder to fill (default: PYKERN_CACHE_DIR, else $XDG_CACHE_HOME/pykern, "
                            "else ~/.cache/pykern)")
    where.add_argument("--out", metavar="DIR",
                       help="also write a self-contained bundle folder to use as PYKERN_CUBIN_DIR "
                            "(compiles still go through the default cache; NVRTC modules only, not --host)")
    ap.add_argument("--option", action="append", default=[], metavar="OPT",
                    help="extra NVRTC option, part of the cache key; write it as --option=-lineinfo. "
                         "The library looks up modules with the options its backend uses (none by default), "
                         "so only precompile with options the backend will ask for.")
    ap.add_argument("--define", action="append", default=[], metavar="NAME[=VALUE]",
                    help="preprocessor define, part of the cache key")
    ap.add_argument("--fail-on-spill", action="store_true", help="exit 1 if any kernel spills registers")
    ap.add_argument("--json", action="store_true", help="print the results as JSON on stdout (no table)")
    return ap


def _no_sources(kernels: list[str] | None, err: Any) -> int:
    """The usage error of a run with no kernel source to build (none matches --kernels, or none at all)."""
    print(f"precompile: no kernel sources{' match ' + repr(kernels) if kernels else ' found'}", file=err)
    return 2


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
        # A source's kernels share one compile: its time is shown on the group's first row only.
        t = f"{r['seconds']:.2f}s" if r.get("file_row", True) else ""
        body.append([r["kernel"], r["arch"], *res, r["status"], t])
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = [_fmt_row(head, widths), _fmt_row(["-" * w for w in widths], widths)]
    lines += [_fmt_row(b, widths) for b in body]
    lines.append("(time: the source's compile or cache lookup, shown on its first kernel row; its kernels share it)")
    if any(r["kind"] == "ptx" for r in rows):
        lines.append("(compute_XX rows are PTX: registers and spills are decided by the driver's JIT, not known here)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI. SIGINT/SIGTERM stop queued and running compiles and exit 130/143 with one line."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    # Installed even where SIGINT was inherited as ignored (a background job of a script): a CI
    # runner's signal must stop the run, not let it finish and exit 0.
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _main(argv)
    except _Interrupted as sig:
        print(f"precompile: interrupted by {sig.name}; nothing half-written was left", file=sys.stderr, flush=True)
        return 128 + sig.signum
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _main(argv: Sequence[str] | None = None) -> int:
    from . import cache, compiler
    from .sources import load as load_source

    args = _build_parser().parse_args(argv)
    err = sys.stderr
    t_start = time.perf_counter()
    if not args.arch:
        if not args.host:
            print("precompile: expected --arch ARCH (NVRTC) and/or --host (the host backend's C++ build)", file=err)
            return 2
        if args.out or args.option or args.define:
            print("precompile: --out, --option and --define apply to the NVRTC compiles: add --arch", file=err)
            return 2
        return _host_main(args, t_start)
    if args.host:  # both: the host builds first (their progress), then the NVRTC run and its table
        rc = _host_main(args, t_start)
        if rc != 0:
            return rc
    try:
        archs = compiler.expand_archs(args.arch)
        if not archs:
            raise ArgumentError(f"--arch: expected at least one arch, got {args.arch!r}")
        if args.jobs < 1:
            raise ArgumentError(f"--jobs: expected >= 1, got {args.jobs}")
        compiler.compile_threads()  # a bad PYKERN_COMPILE_THREADS is a usage error, found before any compile
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
        return _no_sources(args.kernels, err)
    # 'all' also takes the `a` targets the selected sources name (sm_90a, ...), for those sources only
    # (builds_for): every other source keeps its portable sm_XX cubins instead of a second, GPU-exact copy.
    all_only = _arch_specific_targets(selected, archs) if _asks_all(args.arch) else []
    archs += all_only
    root = Path(args.cache_dir).expanduser() if args.cache_dir else cache.cache_dir()
    jobs = [(src, arch) for src, _ in selected for arch in archs
            if builds_for(src, arch) and (arch not in all_only or _opts_in(src))]
    if not jobs:
        print(f"precompile: no selected source is built for {', '.join(archs)} (a source with a "
              "`// pykern: arch sm_XXa` line is built only for the targets it names)", file=err)
        return 2
    skipped = _skipped(selected, archs, all_only)
    names = dict(selected)
    results: dict[tuple[Path, str], JobResult] = {}
    done = started = 0
    w = max(24, *(len(src.name) for src, _ in jobs))  # the name column, so that long names keep it aligned

    def announce(src: Path, arch: str) -> None:
        # A compile of one source can take a minute: say what runs as it starts, not only when it ends.
        nonlocal started
        started += 1
        print(f"start  {arch:<10} {src.name:<{w}} compiling ({started} of {len(misses)} to compile)", file=err,
              flush=True)

    def report(r: JobResult) -> None:
        nonlocal done
        done += 1
        status = "FAILED" if r.error else ("hit" if r.module.hit else "compiled")
        print(f"[{done}/{len(jobs)}] {r.arch:<10} {r.source.name:<{w}} {status} ({r.seconds:.2f}s)", file=err,
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
        problem = cache.unwritable_reason(root)
        if problem:  # a CI step must not pass with nothing saved: say so before compiling anything
            print(f"precompile: cannot save to the cache folder {root} ({problem}); {len(misses)} compiles "
                  "would be lost. Set PYKERN_CACHE_DIR or --cache-dir to a writable folder", file=err)
            return 1
        n_workers = min(args.jobs, len(misses))
        # The CPUs are shared out among the compiles that run at once, not handed to each in full: W
        # workers with all-CPU ptxas splits would oversubscribe the machine W times.
        threads = compiler.compile_threads(share=n_workers)
        try:
            if n_workers == 1:
                # In this process (no start-up cost; what --jobs 1 is for). A signal lands between two
                # compiles: the one in progress finishes first (NVRTC holds the GIL), the rest are dropped.
                for src, arch in misses:
                    announce(src, arch)
                    mod, e, secs = _compile_job(str(src), arch, options, defines, str(root))
                    r = results[(src, arch)] = JobResult(src, arch, module=mod, error=e, seconds=secs)
                    report(r)
            else:
                pool = _Workers(n_workers, threads)
                try:
                    todo = [(str(src), arch, options, defines, str(root)) for src, arch in misses]
                    for i, (mod, e, secs) in pool.run(todo, on_start=lambda i: announce(*misses[i])):
                        src, arch = misses[i]
                        r = results[(src, arch)] = JobResult(src, arch, module=mod, error=e, seconds=secs)
                        report(r)
                finally:
                    pool.close(root)
        except _Interrupted as sig:
            queued = len(misses) - len([k for k in misses if k in results])
            print(f"precompile: interrupted by {sig.name}; cancelled {queued} unfinished compiles, "
                  "removed their temporary files (the cache keeps the finished ones)", file=err, flush=True)
            return 128 + sig.signum

    rows: list[dict[str, Any]] = []
    failures: list[dict[str, str]] = []
    manifest: list[dict[str, Any]] = []
    written: list[Path] = []  # bundle entries new in this run: removed again if the run cannot finish
    unsaved: list[str] = []
    try:
        for src, arch in jobs:
            r = results[(src, arch)]
            if r.error:
                failures.append({"source": str(src), "arch": arch, "error": r.error})
                continue
            mod = r.module
            if not mod.hit and mod.path is None:
                unsaved.append(f"{src.name} for {arch}")
            if args.out:
                bpath = cache.entry_path(Path(args.out), cache.key_for(load_source(src), arch, options, defines,
                                                                       bundle=True))
                if not bpath.exists():  # listed before writing: a signal may land right after the rename
                    written.append(bpath)
                bpath = cache.export_to_bundle(mod, load_source(src), args.out)
                manifest.append({"source": src.name, "arch": arch, "kind": mod.kind, "kernels": list(mod.kernels),
                                 "entry": str(bpath.relative_to(Path(args.out))), "cache_key": mod.digest})
            first = True  # the compile time belongs to the source: shown on its first kernel row only
            for k in names[src]:
                res = mod.resources.get(k)
                row = {"kernel": k, "source": str(src), "arch": arch, "kind": mod.kind,
                       "status": "hit" if mod.hit else "compiled", "seconds": round(r.seconds, 4),
                       "key": mod.digest, "file_row": first}
                first = False
                if res is not None:
                    row.update(res.to_dict())
                elif mod.kind == "cubin":
                    row.update(registers=None, spill_stores=None, spill_loads=None, shared_bytes=None,
                               stack_bytes=None, barriers=None)
                rows.append(row)
        if args.out and not failures and not unsaved:
            out = Path(args.out)
            cache.write_atomic(out / cache.BUNDLE_MANIFEST, json.dumps({
                "format": cache.FORMAT_VERSION, "nvrtc": ".".join(map(str, compiler.nvrtc_version())),
                "options": list(options), "defines": defines or {}, "created": time.time(), "entries": manifest,
            }, indent=2).encode())
    except (_Interrupted, OSError) as e:
        for p in written:  # no half bundle: what this run added goes again
            try:
                p.unlink()
            except OSError:
                pass
        if isinstance(e, _Interrupted):
            raise
        print(f"precompile: cannot write the bundle folder {args.out} ({type(e).__name__}: {e}); "
              "the entries of this run were removed from it", file=err)
        return 1
    # One group per source and arch (its kernels share one compile), kernels in file order.
    order = {src: i for i, (src, _) in enumerate(selected)}
    rows.sort(key=lambda r: (order[Path(r["source"])], archs.index(r["arch"])))
    spilling = [r for r in rows if (r.get("spill_stores") or 0) + (r.get("spill_loads") or 0) > 0]

    wall = time.perf_counter() - t_start
    n_hits = sum(1 for r in results.values() if r.module is not None and r.module.hit)
    if args.json:
        print(json.dumps({
            "nvrtc": ".".join(map(str, compiler.nvrtc_version())), "archs": archs, "cache_dir": str(root),
            # "jobs" is the old name of "modules" (one module per source and arch), kept for scripts.
            "out": args.out, "options": list(options), "modules": len(jobs), "jobs": len(jobs),
            "kernel_rows": len(rows), "hits": n_hits,
            "compiled": len(jobs) - n_hits - len(failures), "wall_seconds": round(wall, 4),
            "results": rows, "failures": failures,
            "skipped": [{"source": str(src), "arch": arch, "reason": why} for src, arch, why in skipped],
        }, indent=2))
    else:
        print(_table(rows))
        print(f"{len(jobs)} modules ({len(selected)} sources x {len(archs)} archs): {n_hits} cache hits, "
              f"{len(jobs) - n_hits - len(failures)} compiled, {len(failures)} failed; {len(rows)} kernel rows; "
              f"{wall:.2f}s; cache {root}" + (f"; bundle {args.out}" if args.out else ""))
        for line in _skipped_lines(skipped):
            print(line)
    for f in failures:
        print(f"\nFAILED {Path(f['source']).name} for {f['arch']}:\n{f['error']}", file=err)
    if spilling:
        print("\nspilling kernels: " + ", ".join(f"{r['kernel']}@{r['arch']}" for r in spilling), file=err)
    if unsaved:
        why = cache.unwritable_reason(root) or "see the warning above"
        print(f"\nprecompile: {len(unsaved)} compiled modules could not be saved to the cache folder {root} "
              f"({why}): {', '.join(unsaved)}", file=err)
        if args.out:
            print(f"precompile: no manifest was written to {args.out}", file=err)
    if failures or unsaved or (args.fail_on_spill and spilling):
        return 1
    return 0


# --------------------------------------------------------------------------- --host


class _Progress:
    """Progress of N items on stderr: a redrawn bar on a terminal, else one line per finished item."""

    def __init__(self, total: int, what: str, stream: Any = None) -> None:
        import threading

        self.total, self.what, self.done = total, what, 0
        self.stream = sys.stderr if stream is None else stream
        try:
            self.tty = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            self.tty = False
        self.running: dict[str, float] = {}
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True) if self.tty else None
        if self._ticker is not None:
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):  # the elapsed time moves while a long compile runs
            with self._lock:
                self._draw()

    def _draw(self) -> None:
        width = 24
        fill = width * self.done // max(1, self.total)
        names = ", ".join(sorted(self.running))
        line = (f"\r\033[K{self.what} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.t0:.0f}s" + (f"  building {names}" if names else ""))
        self.stream.write(line)
        self.stream.flush()

    def start(self, name: str) -> None:
        with self._lock:
            self.running[name] = time.perf_counter()
            if self.tty:
                self._draw()

    def finish(self, name: str, status: str, seconds: float) -> None:
        with self._lock:
            self.running.pop(name, None)
            self.done += 1
            if self.tty:
                if status == "FAILED":  # keep failures on screen above the bar
                    self.stream.write(f"\r\033[K{self.what}: {name} FAILED ({seconds:.2f}s)\n")
                self._draw()
            else:
                self.stream.write(f"[{self.done}/{self.total}] {self.what:<10} {name:<24} {status} ({seconds:.2f}s)\n")
                self.stream.flush()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(1.0)
        if self.tty:
            with self._lock:
                self.stream.write("\r\033[K")
                self.stream.flush()


def _host_job(src: Path) -> tuple[str, Path | None, str, float]:
    """Build (or find) one source's host library: (status "hit" | "built" | "FAILED", path, error, seconds)."""
    from . import sources
    from .host import build
    from .registry import parse_file

    t0 = time.perf_counter()
    try:
        s = sources.load(src)
        args = (s.path, s.text, s.digest(), sources.include_dirs(s.path.parent), parse_file(s.path))
        sanitize = os.environ.get("PYKERN_HOST_SANITIZE", "").strip() not in ("", "0")
        lib = build.library_path(*args, sanitize=sanitize)
        if lib.exists():
            return "hit", lib, "", time.perf_counter() - t0
        path = build.build(*args, sanitize=sanitize, announce=False)
        return "built", path, "", time.perf_counter() - t0
    except (PykernError, OSError) as e:
        log = getattr(e, "log", "") or ""
        return "FAILED", None, f"{type(e).__name__}: {e}" + (f"\n{log}" if log else ""), time.perf_counter() - t0


def _host_main(args: argparse.Namespace, t_start: float) -> int:
    """--host: every selected source's host-backend library, --jobs compilers at a time, with progress."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from . import cache
    from .host.build import find_compiler

    err = sys.stderr
    if args.jobs < 1:
        print(f"precompile: --jobs: expected >= 1, got {args.jobs}", file=err)
        return 2
    try:
        selected = _select(args.kernels)
    except PykernError as e:
        print(f"precompile: {e}", file=err)
        return 2
    if not selected:
        return _no_sources(args.kernels, err)
    old_dir = os.environ.get("PYKERN_CACHE_DIR")
    if args.cache_dir:  # the host build finds its folder through the environment, as the library does
        os.environ["PYKERN_CACHE_DIR"] = str(Path(args.cache_dir).expanduser())
    try:
        root = cache.cache_dir()
        problem = cache.unwritable_reason(root)
        if problem:
            print(f"precompile: cannot save to the cache folder {root} ({problem}); set PYKERN_CACHE_DIR or "
                  "--cache-dir to a writable folder", file=err)
            return 1
        try:
            cc = find_compiler()
        except PykernError as e:
            print(f"precompile: --host: {e}", file=err)
            return 1
        srcs = [src for src, _ in selected]
        progress = _Progress(len(srcs), "host", err)
        results: dict[Path, tuple[str, Path | None, str, float]] = {}
        pool = ThreadPoolExecutor(max(1, min(args.jobs, len(srcs))))

        def job(src: Path) -> tuple[str, Path | None, str, float]:
            progress.start(src.name)  # when a compiler is free for it, not when queued
            return _host_job(src)

        try:
            futs = {pool.submit(job, src): src for src in srcs}
            for fut in as_completed(futs):
                src = futs[fut]
                results[src] = fut.result()
                progress.finish(src.name, results[src][0], results[src][3])
        except _Interrupted:
            pool.shutdown(wait=False, cancel_futures=True)
            progress.close()
            print("precompile: interrupted; builds already running finish and are kept (each is published "
                  "whole or not at all), queued ones were cancelled", file=err, flush=True)
            raise
        finally:
            pool.shutdown(wait=True)
        progress.close()
    finally:
        if args.cache_dir:
            if old_dir is None:
                os.environ.pop("PYKERN_CACHE_DIR", None)
            else:
                os.environ["PYKERN_CACHE_DIR"] = old_dir
    failed = [(src, r) for src, r in results.items() if r[0] == "FAILED"]
    n_hits = sum(r[0] == "hit" for r in results.values())
    wall = time.perf_counter() - t_start
    rows = [{"source": str(src), "status": results[src][0], "seconds": round(results[src][3], 4),
             "library": None if results[src][1] is None else str(results[src][1])} for src in srcs]
    compiler_name = cc.version.splitlines()[1] if len(cc.version.splitlines()) > 1 else cc.argv[0]
    if args.json and not args.arch:
        print(json.dumps({"host": {"compiler": compiler_name, "cache_dir": str(root / cache.HOST_SUBDIR),
                                   "sources": len(srcs), "hits": n_hits, "built": len(srcs) - n_hits - len(failed),
                                   "failed": len(failed), "wall_seconds": round(wall, 4), "results": rows}},
                         indent=2))
    elif not args.json:
        width = max(len(src.name) for src in srcs)
        for r in rows:
            print(f"{Path(r['source']).name:<{width}}  host  {r['status']:<6}  {r['seconds']:7.2f}s")
        print(f"{len(srcs)} host builds ({compiler_name}): {n_hits} cache hits, {len(srcs) - n_hits - len(failed)} "
              f"built, {len(failed)} failed; {wall:.2f}s; cache {root / cache.HOST_SUBDIR}")
    for src, r in failed:
        print(f"\nFAILED {src.name} for the host backend:\n{r[2]}", file=err)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
