"""Build one kernels_cu/*.cu file into a shared library for the host backend, cached on disk.

The translation unit is: the emulation header, the `.cu` text (under `#line` so the
compiler's messages name the `.cu` file and line), then one generated launch stub per
kernel, typed from the registry's KernelSpec params. It is compiled together with the
fiber runtime into `<cache>/host/<stem>-<key>.so`, where the key hashes everything that
can change the binary.
"""
from __future__ import annotations

import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Sequence

from . import gpu_conv
from ..errors import BackendUnavailable, CacheMiss, CompileError
from ..registry import KernelSpec
from ..registry import _blank_comments as blank_comments

HERE = Path(__file__).resolve().parent
HEADER = HERE / "pk_cuda_host.h"
RUNTIME = HERE / "pk_host_runtime.cpp"
# The Hopper emulation: a header pk_cuda_host.h includes and a part of the runtime's translation unit.
SM90_FILES = (HERE / "pk_host_sm90.h", HERE / "pk_host_sm90.cpp")
_BUILD_TAG = b"pykern-host-build-4"

BASE_FLAGS = (
    "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-strict-aliasing",
    "-Wno-unknown-pragmas", "-Wno-unused-result", "-pthread",
    # A large local array must touch the guard page below a fiber stack first, not jump
    # over it into the next stack or the heap: probe every page of big frames.
    "-fstack-clash-protection",
)
OPT_FLAGS = ("-O2",)
# -O1 keeps AddressSanitizer reports readable; -g1 (line tables only) gives them .cu file:line. Full -g
# adds nothing a report shows and triples the build of a template-heavy kernel file (85 s -> 26 s for the
# fused tensor-core attention backward with gcc 12).
SANITIZE_FLAGS = (
    "-O1", "-g1", "-fno-omit-frame-pointer", "-fsanitize=address,undefined,float-cast-overflow",
    "-fno-sanitize-recover=undefined,float-cast-overflow",
)


@dataclass(frozen=True)
class Compiler:
    argv: tuple[str, ...]  # CXX may carry arguments, e.g. "ccache g++"
    version: str


@lru_cache(maxsize=None)
def _probe(cxx: str) -> Compiler | None:
    argv = tuple(shlex.split(cxx))
    if not argv or shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=30)
        machine = subprocess.run([*argv, "-dumpmachine"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    path = shutil.which(argv[0]) or argv[0]
    return Compiler(argv, f"{path}\n{out.stdout.strip()}\n{machine.stdout.strip()}")


def find_compiler() -> Compiler:
    """$CXX, else g++, else clang++; BackendUnavailable saying what to install when none works."""
    env = os.environ.get("CXX", "").strip()
    if env:
        c = _probe(env)
        if c is None:
            raise BackendUnavailable(f"host backend: CXX={env!r} is not a working C++ compiler")
        return c
    for name in ("g++", "clang++", "c++"):
        c = _probe(name)
        if c is not None:
            return c
    raise BackendUnavailable(
        "host backend: no C++ compiler found (looked for $CXX, g++, clang++, c++); "
        "install one (e.g. `apt-get install g++`) or set CXX"
    )


# ---- cache folder -------------------------------------------------------------------
_fallback_dir: Path | None = None


def cache_root() -> Path:
    """$PYKERN_CACHE_DIR, else $XDG_CACHE_HOME/pykern, else ~/.cache/pykern (shared with the cubin cache)."""
    from ..cache import cache_dir

    return cache_dir()


def host_cache_dir() -> Path:
    """`<cache root>/host`, or a per-process temp folder (one warning) when that is not writable."""
    global _fallback_dir
    from ..cache import HOST_SUBDIR

    d = cache_root() / HOST_SUBDIR
    try:
        d.mkdir(parents=True, exist_ok=True)
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(f"{d} is not writable")
        return d
    except OSError as e:
        if _fallback_dir is None:
            _fallback_dir = Path(tempfile.mkdtemp(prefix="pykern-host-"))
            warnings.warn(
                f"pykern: host build cache {d} is unusable ({e}); using {_fallback_dir} for this process",
                RuntimeWarning,
                stacklevel=3,
            )
        return _fallback_dir


# ---- source generation --------------------------------------------------------------
_EXTERN_SHARED = re.compile(
    r"\bextern\s+__shared__\s+((?:[^;\[\]{}()]|\([^()]*\))*?)\s*\b([A-Za-z_]\w*)\s*\[\s*\]\s*;"
)
_ALIGN = re.compile(r"__align__\s*\([^()]*\)")
_STATIC_SHARED = re.compile(
    r"(?<!extern)(?<!extern )(?:\bstatic\s+)?\b__shared__\s+((?:__align__\s*\(\s*\d+\s*\)\s*)?)"
    r"((?:[A-Za-z_][\w:]*(?:\s*<[^;{}<>]*>)?\s+)*?[A-Za-z_][\w:]*(?:\s*<[^;{}<>]*>)?)\s*"
    r"([A-Za-z_]\w*)\s*((?:\[[^\[\];]+\]\s*)*);"
)


def rewrite_source(text: str) -> str:
    """Turn each `extern __shared__ T name[];` into a pointer to the launch's dynamic buffer.

    The replacement keeps the line count, so `#line` still maps every line to the `.cu`.
    At function scope it is a local `T* const name`; at namespace scope (evaluated per use,
    not at load time) an object that converts to `T*`.
    """
    blanked = blank_comments(text)  # the registry's comment stripping: the same kernels, the same rules
    out, last = [], 0
    for m in _EXTERN_SHARED.finditer(blanked):
        typ = " ".join(_ALIGN.sub(" ", m.group(1)).split())
        name = m.group(2)
        depth = blanked.count("{", 0, m.start()) - blanked.count("}", 0, m.start())
        if depth > 0:
            repl = f"{typ}* const {name} = reinterpret_cast<{typ}*>(pk_dynamic_smem());"
        else:
            repl = f"static pk_dynamic_smem_ref<{typ}> {name};"
        repl += "\n" * text.count("\n", m.start(), m.end())
        out.append(text[last:m.start()])
        out.append(repl)
        last = m.end()
    out.append(text[last:])
    return _rewrite_static_shared("".join(out))


# `__shared__ T a[4], b[8];`: several declarators in one statement (split into one statement each).
_MULTI_SHARED = re.compile(
    r"((?:\bstatic\s+)?\b__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?"
    r"(?:[A-Za-z_][\w:]*(?:\s*<[^;{}<>]*>)?\s+)*?[A-Za-z_][\w:]*(?:\s*<[^;{}<>]*>)?)\s+"
    r"([A-Za-z_]\w*\s*(?:\[[^\[\];]+\]\s*)*(?:,\s*[A-Za-z_]\w*\s*(?:\[[^\[\];]+\]\s*)*)+);"
)
_DECLARATOR = re.compile(r"\s*([A-Za-z_]\w*\s*(?:\[[^\[\];]+\]\s*)*),?")


def _split_multi_shared(text: str) -> str:
    """`__shared__ float a[32], b[32];` -> `__shared__ float a[32]; __shared__ float b[32];`, line count kept."""
    blanked = blank_comments(text)
    out, last = [], 0
    for m in _MULTI_SHARED.finditer(blanked):
        head = " ".join(text[m.start(1):m.end(1)].split())
        decls = [" ".join(d.group(1).split()) for d in _DECLARATOR.finditer(text[m.start(2):m.end(2)])]
        out.append(text[last:m.start()])
        out.append(" ".join(f"{head} {d};" for d in decls) + "\n" * text.count("\n", m.start(), m.end()))
        last = m.end()
    out.append(text[last:])
    return "".join(out)


def _rewrite_static_shared(text: str) -> str:
    """Function-scope `__shared__ T name[dims];` -> a reference into the block's static arena.

    Each block (and each resident block of the interleaved schedule) gets its own copy,
    poisoned at the block's start, as on a GPU; a C++ `static` would be one zero-filled
    instance shared by every block and launch. Namespace-scope ones stay `static`. Several
    declarators in one statement (`__shared__ float a[32], b[32];`) are split first.
    """
    text = _split_multi_shared(text)
    blanked = blank_comments(text)
    out, last, n = [], 0, 0
    for m in _STATIC_SHARED.finditer(blanked):
        depth = blanked.count("{", 0, m.start()) - blanked.count("}", 0, m.start())
        if depth <= 0:
            continue
        align_m = re.search(r"\d+", m.group(1) or "")
        typ, name, dims = " ".join(m.group(2).split()), m.group(3), " ".join(m.group(4).split())
        t = f"pk_smem_t{n}_"
        align = f"(alignof({t}) > {align_m.group(0)} ? alignof({t}) : {align_m.group(0)})" if align_m else f"alignof({t})"
        repl = (
            f"typedef {typ} {t}{dims}; {t}& {name} = "
            f"*static_cast<{t}*>(pkrt_static_smem({n}, sizeof({t}), {align}));"
        )
        repl += "\n" * text.count("\n", m.start(), m.end())
        out.append(text[last:m.start()])
        out.append(repl)
        last = m.end()
        n += 1
    out.append(text[last:])
    result = "".join(out)
    # What is left at function scope would silently be one instance for every block.
    blanked = blank_comments(result)
    for m in re.finditer(r"\b__shared__\b", blanked):
        depth = blanked.count("{", 0, m.start()) - blanked.count("}", 0, m.start())
        if depth > 0:
            line = blanked.count("\n", 0, m.start()) + 1
            raise CompileError(
                f"host backend: cannot give the __shared__ declaration at source line {line} one copy per block: "
                "declare one variable per statement, as `__shared__ [__align__(N)] T name[dims];`"
            )
    return result


def _c_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def launch_stubs(specs: Sequence[KernelSpec]) -> str:
    """`pk_launch_<name>(cfg, args, err, errlen)` for each kernel: args[i] points to the i-th value."""
    parts = ['#line 1 "<pykern host launch stubs>"']
    for s in specs:
        call = ", ".join(f"*static_cast<{p.ctype}*>(a[{i}])" for i, p in enumerate(s.params))
        parts.append(
            f"static void pk_body_{s.name}(void* pv) {{ void** a = static_cast<void**>(pv); (void)a; {s.name}({call}); }}\n"
            f"PK_EXPORT int pk_launch_{s.name}(const pk_launch_cfg* cfg, void** args, char* err, size_t errlen) {{\n"
            f"    return pkrt_launch(cfg, {_c_string(s.name)}, &pk_body_{s.name}, args, err, errlen);\n}}"
        )
    return "\n".join(parts) + "\n"


# Inline PTX cannot run on the CPU: a kernel reaches PTX only through kernels_cu/pk_ptx.cuh.
_WRAPPER_DEF = re.compile(r"__device__\s+__forceinline__\s+[\w\s*&:<>,]*?\b(pk_\w+)\s*\(")


@lru_cache(maxsize=None)
def ptx_wrappers() -> tuple[str, ...]:
    """The wrappers kernels_cu/pk_ptx.cuh defines, in the header's order (read from the header, so the list
    follows it: mma.sync, ldmatrix, cp.async, FP8, Hopper...); its host-only and software helpers left out."""
    from ..registry import KERNELS_DIR

    text = blank_comments((KERNELS_DIR / "pk_ptx.cuh").read_text(encoding="utf-8"))
    names: list[str] = []
    for m in _WRAPPER_DEF.finditer(text):
        n = m.group(1)
        if n not in names and not n.startswith("pk_host_") and "_sw_" not in n:
            names.append(n)
    return tuple(names)
_RAW_ASM = re.compile(r"\b(?:asm|__asm__|__asm)\b")
# What a raw asm in an included header turns into: the compiler's error names this identifier.
_ASM_POISON = "PK_RAW_ASM_IS_NOT_SUPPORTED_BY_THE_HOST_BACKEND_USE_THE_WRAPPERS_IN_PK_PTX_CUH"


def check_no_raw_asm(path: Path, text: str) -> None:
    """CompileError naming the .cu line and pk_ptx.cuh's wrappers for a raw `asm` in a kernel source."""
    blanked = blank_comments(text)
    m = _RAW_ASM.search(blanked)
    if m is None:
        return
    line = blanked.count("\n", 0, m.start()) + 1
    wrappers = ", ".join(ptx_wrappers())
    raise CompileError(
        f"host backend: raw inline assembly ({m.group(0)}) at {path}:{line} cannot run on the CPU; "
        f'reach PTX through the wrappers in kernels_cu/pk_ptx.cuh (#include "pk_ptx.cuh"): {wrappers}, '
        "or add a wrapper there with a host emulation"
    )


def translation_unit(path: Path, text: str, specs: Sequence[KernelSpec]) -> str:
    check_no_raw_asm(path, text)
    try:
        body = rewrite_source(text)
    except CompileError as e:
        raise CompileError(f"{path}: {e.args[0]}") from None
    return (
        '#include "pk_cuda_host.h"\n'
        f"#define asm {_ASM_POISON}\n#define __asm__ {_ASM_POISON}\n#define __asm {_ASM_POISON}\n"
        f"#line 1 {_c_string(str(path))}\n"
        f"{body}\n"
        f"{launch_stubs(specs)}"
    )


# ---- build ----------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _cpu_has_fma() -> bool:
    """x86-64 needs -mfma for fused multiply-add instructions; only where the CPU has them."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True  # FMA is part of the base ISA (and the compiler's default)
    if machine not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return " fma " in f" {line.split(':', 1)[-1].strip()} "
    except OSError:
        pass
    return False


def fma_enabled() -> bool:
    """PYKERN_HOST_FMA (default 1): contract a*b+c into FMA as NVRTC does by default."""
    return os.environ.get("PYKERN_HOST_FMA", "1").strip() not in ("0", "off", "false", "no")


def fma_flags() -> tuple[str, ...]:
    # NVRTC contracts by default (--fmad=true): `a*b - c*d` becomes fma(a, b, -(c*d)).
    # -std=c++17 alone means -ffp-contract=off in GCC; ask for contraction explicitly.
    if not fma_enabled():
        return ("-ffp-contract=off",)
    if platform.machine().lower() in ("x86_64", "amd64"):
        return ("-ffp-contract=fast", "-mfma") if _cpu_has_fma() else ("-ffp-contract=off",)
    return ("-ffp-contract=fast",)


def racecheck_mode() -> str:
    """PYKERN_HOST_RACECHECK: '' (off), '1' (report races), 'stress' (yield at plain stores)."""
    v = os.environ.get("PYKERN_HOST_RACECHECK", "").strip().lower()
    if v in ("", "0", "off", "false", "no"):
        return ""
    return "stress" if v == "stress" else "1"


def checked_build() -> bool:
    """Racecheck and initcheck need every load and store of the kernel to call the runtime."""
    init = os.environ.get("PYKERN_HOST_INITCHECK", "").strip() not in ("", "0")
    return bool(racecheck_mode()) or init


# The checked build: GCC/Clang's ThreadSanitizer instrumentation (a call before every load
# and store, with its size) compiled in, but pykern's own runtime (pk_host_runtime.cpp)
# supplies the __tsan_* functions: shadow state per shared and argument word, not libtsan.
# -fno-tree-sra keeps a float4/uint4 copy one 16-byte access (so its alignment is checked)
# instead of four scalar ones.
CHECKED_FLAGS = ("-O1", "-g1", "-fno-tree-sra", "-fsanitize=thread", "-DPK_RACECHECK=1")


OPT_LEVELS = ("0", "1", "2", "3")


def opt_level() -> str | None:
    """PYKERN_HOST_OPT: the optimization level (0-3) of every host build, replacing its own (-O2 for the plain
    build, -O1 for the checked and sanitizer builds); None when unset.

    The results do not depend on it (IEEE arithmetic at every level, no -ffast-math), with one exception the
    compiler makes: GCC contracts multiply-adds into FMA only from -O2 (its contraction pass needs
    -fexpensive-optimizations), so a plain build below -O2 gets -fexpensive-optimizations added at -O1 and is
    refused at -O0 while FMA contraction is on (PYKERN_HOST_FMA=1). The test suite's FMA-off mode builds at
    -O1: the same results as -O2 with contraction off, in 20-50% less compile time."""
    v = os.environ.get("PYKERN_HOST_OPT", "").strip()
    if not v:
        return None
    if v not in OPT_LEVELS:
        from ..errors import ArgumentError

        raise ArgumentError(f"PYKERN_HOST_OPT: expected one of {', '.join(OPT_LEVELS)} (the -O level), got {v!r}")
    return v


def _with_opt(opts: tuple[str, ...], fma: tuple[str, ...], plain: bool) -> tuple[str, ...]:
    """opts (with their -O level replaced by PYKERN_HOST_OPT's, if set) + fma."""
    level = opt_level()
    if level is None:
        return opts + fma
    out = tuple(f"-O{level}" if re.fullmatch(r"-O\w?", o) else o for o in opts) + fma
    if plain and "-ffp-contract=fast" in fma and level in ("0", "1"):
        if level == "0":
            from ..errors import ArgumentError

            raise ArgumentError("PYKERN_HOST_OPT: expected 1, 2 or 3 while FMA contraction is on (PYKERN_HOST_FMA=1: "
                                "no multiply-add is contracted at -O0), got '0'")
        out += ("-fexpensive-optimizations",)  # GCC's FMA contraction pass runs under it (on from -O2)
    return out


def flags(sanitize: bool) -> tuple[str, ...]:
    extra: tuple[str, ...] = ()
    # PYKERN_HOST_FIBER=ucontext selects the portable (slower: a syscall per switch) fibers.
    if os.environ.get("PYKERN_HOST_FIBER", "").strip() == "ucontext":
        extra = ("-DPK_FIBER_UCONTEXT=1",)
    if checked_build() and not sanitize:
        return _with_opt(BASE_FLAGS + CHECKED_FLAGS, fma_flags(), False) + extra
    return _with_opt(BASE_FLAGS + (SANITIZE_FLAGS if sanitize else OPT_FLAGS), fma_flags(), not sanitize) + extra


_FIRST_ERROR = re.compile(r"^(.+?):(\d+):(?:\d+:)?\s*(?:fatal )?error:\s*(.*)$", re.M)


def _publish(cmd: list[str], target: Path, what: str, cc: Compiler, opts: Sequence[str], rename: dict[str, str]) -> None:
    """Run a compile writing to a temp file beside `target`, then rename it into place atomically."""
    fd, tmp_out = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([*cmd, "-o", tmp_out], capture_output=True, text=True)
        if proc.returncode != 0:
            log = proc.stderr + proc.stdout
            for old, new in rename.items():
                log = log.replace(old, new)
            m = _FIRST_ERROR.search(log)
            where = f" at {m.group(1)}:{m.group(2)}: {m.group(3)}" if m else ""
            raise CompileError(f"host C++ compiler ({cc.argv[0]}) failed on {what}{where}", log=log, options=tuple(opts))
        os.replace(tmp_out, target)
    finally:
        if os.path.exists(tmp_out):
            os.unlink(tmp_out)


def _key(*parts: bytes) -> str:
    h = hashlib.sha256(_BUILD_TAG)
    for part in parts:
        h.update(len(part).to_bytes(8, "little") + part)
    return h.hexdigest()[:24]


def _gpu_rewrite(path: Path, tu: str, tu_path: Path, incs: list[str], roots: Sequence[Path], cc: Compiler,
                 opts: Sequence[str]) -> tuple[str, list[str]]:
    """The TU and include flags after gpu_conv's rewrite; unchanged when it cannot be done (one warning).

    Every kernel header the TU includes (rewritten or not, so that no header comes from two
    places) is copied under an overlay folder per include root, searched just before that root;
    `#line 1` keeps their messages on the original files.
    """
    marker = f"#line 1 {_c_string(str(path))}\n"
    body_start = len(tu[: tu.index(marker) + len(marker)].encode())
    args = [*incs, *(o for o in opts if o.startswith("-D"))]
    res = gpu_conv.rewrite(tu_path, tu, body_start, roots, args, cc.argv, str(path))
    if res is None or res.edits == 0:
        return tu, incs
    resolved = [r.resolve() for r in roots]
    overlays = [tu_path.parent / f"pk_overlay{i}" for i in range(len(roots))]
    for hdr, text in res.headers.items():
        for r, ov in zip(resolved, overlays):
            if hdr.is_relative_to(r):
                dst = ov / hdr.relative_to(r)
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_text(f"#line 1 {_c_string(str(hdr))}\n{text}", encoding="utf-8", errors="surrogateescape")
    tu_path.write_text(res.tu, encoding="utf-8")
    root_flags = {f"-I{r}": f"-I{ov}" for r, ov in zip(roots, overlays)}
    out: list[str] = []
    for flag in incs:
        if flag in root_flags:
            out.append(root_flags[flag])
        out.append(flag)
    return res.tu, out


def runtime_object(cc: Compiler, opts: Sequence[str]) -> Path:
    """The fiber runtime compiled once per compiler and flag set (shared by every .cu's library)."""
    copts = [o for o in opts if o not in ("-shared", "-fsanitize=thread")]
    key = _key(HEADER.read_bytes(), RUNTIME.read_bytes(), *(f.read_bytes() for f in SM90_FILES), cc.version.encode(),
               "\0".join(copts).encode())
    target = host_cache_dir() / f"pk_host_runtime-{key}.o"
    if not target.exists():
        with _build_lock(target) as done:
            if not done:
                _publish([*cc.argv, *copts, f"-I{HERE}", "-c", str(RUNTIME)], target, str(RUNTIME), cc, copts, {})
    return target


@contextmanager
def _build_lock(target: Path) -> Iterator[bool]:
    """Hold the build of `target` to one process (and thread) at a time; yields whether `target` exists now.

    Without it, two processes that miss the same library (two pytest-xdist workers, two precompile jobs) would
    both run the compiler, one of them wasting a core for 5-50 s. The lock (an exclusive `flock` on
    `.<name>.lock` beside the target, one open file per caller, so threads of one process exclude each other
    too) lets the first build it; the others wait, then find the published file and reuse it. The holder removes
    the lock file before releasing it, so none stay behind: every caller re-checks the target once it holds a
    lock, so one that opened a fresh lock file meanwhile still finds the published target (after a failed
    build it tries the build itself). Without `fcntl` (not POSIX) every caller builds; publishing is atomic
    either way."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - the host backend runs on POSIX systems
        yield target.exists()
        return
    from ..cache import _lock_wait

    lock_path = target.with_name(f".{target.name}.lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        # As for the NVRTC cache: wait up to PYKERN_LOCK_TIMEOUT seconds (default 300) for a holder that may
        # hang, then build without the lock (publishing stays atomic). A holder that dies releases it at once.
        deadline = time.monotonic() + _lock_wait()
        locked = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        try:
            yield target.exists()
        finally:
            if locked:
                try:
                    lock_path.unlink()
                except OSError:  # a caller before this one removed it already
                    pass
    finally:
        os.close(fd)  # releases the lock


@dataclass(frozen=True)
class _Plan:
    cc: Compiler
    tu: str
    opts: tuple[str, ...]
    incs: list[str]
    rewrite: bool
    target: Path


def _plan(path: Path, text: str, digest: str, include_dirs: Sequence[Path], specs: Sequence[KernelSpec],
          sanitize: bool) -> _Plan:
    cc = find_compiler()
    tu = translation_unit(path, text, specs)
    opts = flags(sanitize)
    incs = [f"-I{HERE}", f"-I{path.parent}", *(f"-I{d}" for d in include_dirs)]
    # The key must not depend on where the checkout lives (each CI checkout would add a set of
    # libraries nothing removes): the TU is hashed with the source's folder written out, and the include
    # folders are not hashed, since `digest` covers every included header by name and bytes. A library
    # built in another checkout is reused as is; only its #line paths (in sanitizer reports) name it.
    # The GPU conversion/shift rewrite is a function of the TU, the headers (digest) and the
    # rewriter's own code and libclang version (its tag): keyed without parsing on a cache hit.
    rewrite = gpu_conv.enabled() and not sanitize  # the sanitizer build reports them as C++ UB instead
    key = _key(
        tu.replace(_c_string(str(path)), _c_string(path.name)).encode(), digest.encode(), HEADER.read_bytes(),
        RUNTIME.read_bytes(), *(f.read_bytes() for f in SM90_FILES), cc.version.encode(), "\0".join(opts).encode(),
        gpu_conv.tag() if rewrite else b"gpu-conv-off",
    )
    tag = "-asan" if sanitize else ("-checked" if "-fsanitize=thread" in opts else "")
    return _Plan(cc, tu, opts, incs, rewrite, host_cache_dir() / f"{path.stem}{tag}-{key}.so")


def library_path(path: Path, text: str, digest: str, include_dirs: Sequence[Path], specs: Sequence[KernelSpec],
                 sanitize: bool = False) -> Path:
    """Where `build` keeps (or will keep) this source's library: it exists exactly when the build is cached."""
    return _plan(path, text, digest, include_dirs, specs, sanitize).target


def build(
    path: Path,
    text: str,
    digest: str,
    include_dirs: Sequence[Path],
    specs: Sequence[KernelSpec],
    sanitize: bool = False,
    announce: bool = True,
) -> Path:
    """The cached library for one source (built now on a miss); safe under concurrent processes.

    A build on a miss takes seconds per source: with `announce` and stderr a terminal, one line says
    so while it runs (cleared when done); `python -m pykern.precompile --host` builds them ahead of time.
    """
    plan = _plan(path, text, digest, include_dirs, specs, sanitize)
    if plan.target.exists():
        return plan.target
    from ..cache import jit_disabled

    if jit_disabled():
        raise CacheMiss(f"host backend: no cached build of {path} ({plan.target.name}) and PYKERN_DISABLE_JIT=1")
    with _build_lock(plan.target) as done:
        if done:  # another process (or thread) built it while this one waited for the lock
            return plan.target
        gpu_conv.flush_warnings(False)
        ok = False
        try:
            with _first_use_notice(path, announce):
                rt = runtime_object(plan.cc, plan.opts)
                _build_tu(path, plan.tu, plan.incs, plan.opts, plan.cc, rt, plan.target, plan.rewrite, include_dirs)
            ok = True
        finally:
            gpu_conv.flush_warnings(ok)
    return plan.target


# ---- first-use notice -------------------------------------------------------------------
_notice_lock = threading.Lock()
_notice_open: list[object] = []  # the token of the build whose line is on screen, if any


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


def _say(text: str) -> None:
    with _notice_lock:
        sys.stderr.write(text)
        sys.stderr.flush()


@contextmanager
def _first_use_notice(path: Path, enabled: bool) -> Iterator[None]:
    """A first build can take up to a minute, so it is never silent. On a terminal: "pykern: compiling X for
    the host backend ..." while the build runs, then the line is cleared (or ends in "failed"; the exception
    says why). On a pipe or file, where a line cannot be cleared: that line as it starts and one more when it
    is done, so a log shows where the time went. A cache hit says nothing."""
    if not enabled:
        yield
        return
    msg = (f"pykern: compiling {path.name} for the host backend (first use of this source; "
           "`python -m pykern.precompile --host` builds every source ahead of time)...")
    if not _stderr_is_tty():
        t0, ok = time.perf_counter(), False
        _say(msg + "\n")
        try:
            yield
            ok = True
        finally:
            _say(f"pykern: {path.name} for the host backend: {'built' if ok else 'failed'} in "
                 f"{time.perf_counter() - t0:.1f}s\n")
        return
    token = object()
    with _notice_lock:
        if _notice_open:  # another thread's build line is open: keep it, start ours below it
            sys.stderr.write("\n")
        sys.stderr.write(msg)
        sys.stderr.flush()
        _notice_open[:] = [token]
    ok = False
    try:
        yield
        ok = True
    finally:
        with _notice_lock:
            if _notice_open and _notice_open[0] is token:
                sys.stderr.write("\r\033[K" if ok else " failed\n")
                _notice_open.clear()
            elif not ok:
                sys.stderr.write(f"pykern: compiling {path.name} for the host backend failed\n")
            sys.stderr.flush()


def _build_tu(path: Path, tu: str, incs: list[str], opts: Sequence[str], cc: Compiler, rt: Path, target: Path,
              rewrite: bool, include_dirs: Sequence[Path]) -> None:
    with tempfile.TemporaryDirectory(prefix="pykern-host-build-") as tmp:
        tu_path = Path(tmp) / f"{path.stem}.host.cpp"
        tu_path.write_text(tu, encoding="utf-8")
        if rewrite:
            tu, incs = _gpu_rewrite(path, tu, tu_path, incs, [path.parent, *include_dirs], cc, opts)
        if "-fsanitize=thread" in opts:
            # Instrument the kernels only; link without libtsan (the runtime has the hooks).
            obj = Path(tmp) / f"{path.stem}.host.o"
            cflags = [o for o in opts if o != "-shared"]
            _publish([*cc.argv, *cflags, *incs, "-c", str(tu_path)], obj, str(path), cc, opts,
                     {str(tu_path): "<pykern host stub>"})
            lflags = [o for o in opts if o != "-fsanitize=thread"]
            _publish([*cc.argv, *lflags, str(obj), str(rt)], target, str(path), cc, opts, {})
        else:
            cmd = [*cc.argv, *opts, *incs, str(tu_path), str(rt)]
            _publish(cmd, target, str(path), cc, opts, {str(tu_path): "<pykern host stub>"})
