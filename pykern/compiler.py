"""NVRTC: a kernels_cu source to a cubin (sm_XX, sm_XXa, sm_XXf) or PTX (compute_XX), with ptxas resource usage.

After every compile the PTX `.entry` parameter lists are checked against the KernelSpecs parsed from
the same source, so a signature the registry misreads can never reach a launch.
"""
from __future__ import annotations

import os
import re
import threading
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, Union

from .ctypes_ import size_align
from .errors import ArgumentError, BackendUnavailable, CompileError, LayoutMismatch
from .sources import Source, include_dirs
from .sources import load as load_source

# Options every compile gets unless the caller passes its own spelling of the same flag.
# -default-device: unannotated functions are __device__. NVRTC 13.0 (what torch's CUDA 13.0 wheels bring) takes
# a generic lambda (`[&](auto w) {...}`) inside a kernel for a host function and refuses it ("host functions are
# not allowed in JIT mode"); NVRTC 13.5 accepts it either way. Every function in kernels_cu/ is device code.
DEFAULT_OPTIONS: tuple[str, ...] = ("-std=c++17", "-default-device")

_ARCH = re.compile(r"^(sm|compute)_(\d{2,3})([af]?)$")

SourceLike = Union[Source, str, "os.PathLike[str]"]


@dataclass(frozen=True)
class Resources:
    """ptxas's per-kernel report (-Xptxas -v). Sizes in bytes."""

    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    stack_bytes: int
    barriers: int
    const_bytes: int = 0

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Resources:
        return cls(**{k: int(d[k]) for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class CompiledModule:
    arch: str
    kind: str  # "cubin" | "ptx"
    image: bytes  # cubin bytes, or the PTX text (utf-8) for compute_XX
    ptx: str
    log: str
    # Empty for compute_XX: no ptxas ran, so register/spill counts are unknown until the driver JITs it.
    resources: dict[str, Resources] = field(default_factory=dict)
    options: tuple[str, ...] = ()  # every option passed to NVRTC, include paths included
    kernels: tuple[str, ...] = ()  # the checked extern "C" entries


# --------------------------------------------------------------------------- NVRTC access


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except Exception as e:  # ImportError, or the wheel's loader failing to find libnvrtc
        raise BackendUnavailable(
            f"NVRTC is not available ({type(e).__name__}: {e}); install cuda-bindings and nvidia-cuda-nvrtc"
        ) from e
    return nvrtc


def _check(result: Any, what: str) -> Any:
    """Unwrap a cuda.bindings return tuple (err, *values), raising on a non-success code."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise BackendUnavailable(f"NVRTC {what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest)


@lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the loaded NVRTC library."""
    try:
        major, minor = _check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    except BackendUnavailable:
        raise
    except Exception as e:  # the library itself failed to load at first call
        raise BackendUnavailable(f"NVRTC is not available ({type(e).__name__}: {e})") from e
    return int(major), int(minor)


@lru_cache(maxsize=None)
def _supported_numbers() -> tuple[int, ...]:
    return tuple(int(a) for a in _check(_nvrtc().nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


def supported_archs() -> tuple[str, ...]:
    """Every real arch this NVRTC can emit a cubin for, as "sm_XX" strings, oldest first."""
    return tuple(f"sm_{n}" for n in _supported_numbers())


def parse_arch(arch: str | int) -> tuple[str, int, str]:
    """("sm"|"compute", number, suffix "a"/"f"/"") of an arch spelling; 90 and "90" mean sm_90."""
    s = str(arch).strip().lower()
    if s.isdigit():
        s = f"sm_{s}"
    m = _ARCH.match(s)
    if not m:
        raise ArgumentError(
            f"arch: expected sm_XX, sm_XXa, sm_XXf, compute_XX or 'all', got {arch!r}"
        )
    return m.group(1), int(m.group(2)), m.group(3)


def normalize_arch(arch: str | int, *, check_supported: bool = True) -> str:
    """Canonical spelling ("sm_90a"); with check_supported, also that this NVRTC can target it."""
    kind, num, suffix = parse_arch(arch)
    name = f"{kind}_{num}{suffix}"
    if check_supported and num not in _supported_numbers():
        raise ArgumentError(
            f"arch: NVRTC {'.'.join(map(str, nvrtc_version()))} cannot target {name}; "
            f"expected one of {', '.join(supported_archs())}"
        )
    return name


def expand_archs(archs: Iterable[str | int]) -> list[str]:
    """Normalized, de-duplicated archs in the given order; "all" is every sm_XX this NVRTC supports plus
    compute_XX of the newest (PTX, which the driver JIT-compiles on later GPUs)."""
    out: list[str] = []
    for a in archs:
        for part in str(a).split(","):
            part = part.strip()
            if not part:
                continue
            if part.lower() == "all":
                # Every cubin, plus PTX of the newest arch: it serves GPUs newer than this NVRTC knows.
                names = (*supported_archs(), f"compute_{max(_supported_numbers())}")
            else:
                names = (normalize_arch(part),)
            out.extend(n for n in names if n not in out)
    return out


# --------------------------------------------------------------------------- options


def _define_options(defines: Mapping[str, Any] | None) -> list[str]:
    out = []
    for name, value in sorted((defines or {}).items()):
        if not re.fullmatch(r"[A-Za-z_]\w*", str(name)):
            raise ArgumentError(f"defines: expected C identifiers as names, got {name!r}")
        out.append(f"-D{name}" if value is None else f"-D{name}={value}")
    return out


def portable_options(arch: str, options: Sequence[str] = (), defines: Mapping[str, Any] | None = None) -> list[str]:
    """The options that decide the output, without machine-specific include paths: what a cache key hashes."""
    if isinstance(options, (str, bytes)):
        raise ArgumentError(f"options: expected a sequence of option strings, got the string {options!r}")
    opts = [str(o) for o in options]
    if any(o.startswith(("--gpu-architecture", "-arch")) for o in opts):
        raise ArgumentError(f"options: pass the arch as the arch argument, not in options {opts!r}")
    if any(o.startswith(("--include-path", "-I")) for o in opts):
        # The key hashes header bytes, not folders; an extra folder would make the key lie.
        raise ArgumentError(f"options: include paths are derived from the source's folder, got {opts!r}")
    # "-std=c++20" or "--std=c++20" from the caller replaces the default "-std=c++17".
    flag = lambda o: o.lstrip("-").split("=")[0]  # noqa: E731
    defaults = [d for d in DEFAULT_OPTIONS if flag(d) not in {flag(o) for o in opts}]
    return [f"--gpu-architecture={arch}", *defaults, *_define_options(defines), *opts]


THREADS_ENV = "PYKERN_COMPILE_THREADS"
# The default's ceiling: each ptxas thread holds a kernel's working set of its own (attention_bwd_sm90.cu for
# sm_90a: 565 MB peak with 1 thread, 1,106 MB with 2), so all the cores of a large host could take tens of GB
# for one compile. PYKERN_COMPILE_THREADS may go above it.
DEFAULT_MAX_THREADS = 8


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one, e.g. under taskset or a
    container's cpuset), else every CPU of the machine."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS / Windows have no affinity call
        return max(1, os.cpu_count() or 1)


def compile_threads(share: int = 1) -> int:
    """Threads one compile's ptxas may use: $PYKERN_COMPILE_THREADS when set (1: no split), else the
    available CPUs divided among `share` compiles running at once (at least 1, at most DEFAULT_MAX_THREADS).

    Raises ArgumentError naming the variable and the value for anything but an integer from 1 to 4096."""
    text = os.environ.get(THREADS_ENV, "").strip()
    if text:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if not 1 <= n <= 4096:
            raise ArgumentError(
                f"{THREADS_ENV}: expected an integer from 1 (no split) to 4096 threads per compile, got {text!r}"
            )
        return n
    return max(1, min(DEFAULT_MAX_THREADS, available_cpus() // max(1, share)))


def _split_options(arch: str, portable: Sequence[str], threads: int) -> list[str]:
    """ptxas's --split-compile: ptxas translates the module's functions on up to `threads` threads.

    Only ptxas's split: its cubins have the same SASS and the same -v report as a one-thread compile (only
    the option line ptxas records in the cubin's .note.nv.tkinfo differs, and the sections after it move),
    so it is left out of the cache key. NVRTC's own -split-compile (the NVVM optimizer's) is not used: it
    partitions the module, which changes the PTX (shared variables no longer demoted into their kernel) and
    the SASS: grouped_gemm_sm90's fp32-output kernels spill (0 -> up to 10852 bytes), rms_norm_backward_
    cluster_bf16 takes 101 registers instead of 100 (NVRTC 13.5, sm_90a)."""
    if threads <= 1 or not arch.startswith("sm_"):  # compute_XX runs no ptxas
        return []
    if any("split-compile" in o for o in portable):  # the caller asked for a split of its own: theirs alone
        return []
    return ["-Xptxas", f"--split-compile={threads}"]


def _full_options(source: Source, arch: str, portable: list[str]) -> list[str]:
    """portable plus what depends on this machine only: include paths, ptxas's report, its thread count."""
    incs = [f"--include-path={d}" for d in include_dirs(source.path.parent)]
    # -v asks ptxas for the per-kernel report; there is no ptxas for compute_XX.
    verbose = ["-Xptxas", "-v"] if arch.startswith("sm_") else []
    return [*portable, *incs, *verbose, *_split_options(arch, portable, compile_threads())]


# --------------------------------------------------------------------------- ptxas report

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+) bytes smem")
_CMEM = re.compile(r"(\d+) bytes cmem\[0\]")


def parse_resources(log: str) -> dict[str, Resources]:
    """Per-entry resources from a `-Xptxas -v` log."""
    out: dict[str, Resources] = {}
    current: str | None = None
    props_for: str | None = None
    vals: dict[str, int] = {}

    def flush() -> None:
        if current is not None and "registers" in vals:
            out[current] = Resources(
                registers=vals["registers"],
                spill_stores=vals.get("spill_stores", 0),
                spill_loads=vals.get("spill_loads", 0),
                shared_bytes=vals.get("shared_bytes", 0),
                stack_bytes=vals.get("stack_bytes", 0),
                barriers=vals.get("barriers", 0),
                const_bytes=vals.get("const_bytes", 0),
            )

    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            flush()
            current, props_for, vals = m.group(1), None, {}
            continue
        if current is None:
            continue
        m = _PROPS.search(line)
        if m:
            props_for = m.group(1)
            continue
        m = _FRAME.search(line)
        if m and props_for in (None, current):
            vals["stack_bytes"], vals["spill_stores"], vals["spill_loads"] = map(int, m.groups())
            continue
        m = _USED.search(line)
        if m:
            vals["registers"] = int(m.group(1))
            for key, rx in (("barriers", _BARRIERS), ("shared_bytes", _SMEM), ("const_bytes", _CMEM)):
                mm = rx.search(line)
                if mm:
                    vals[key] = int(mm.group(1))
    flush()
    return out


# --------------------------------------------------------------------------- PTX .entry check

_PTX_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(([^)]*)\)", re.S)
_PTX_TYPE = re.compile(r"^\.[a-z](\d+)$")


@dataclass(frozen=True)
class PtxParam:
    name: str
    type: str  # ".u64", ".f32", ".b8", ...
    size: int
    align: int


def _ptx_param(decl: str) -> PtxParam | None:
    # ".param [.align N] .TYPE [.ptr .space [.align M]] NAME[[COUNT]]": an .align after .ptr is the
    # pointee's alignment, not the parameter's, so only the one before the type counts.
    toks = decl.split()
    if not toks or toks[0] != ".param":
        return None
    align = None
    i = 1
    if i + 1 < len(toks) and toks[i] == ".align":
        align, i = int(toks[i + 1]), i + 2
    m = _PTX_TYPE.match(toks[i]) if i < len(toks) else None
    if m is None:
        return None
    name = re.match(r"([\w$]+)(?:\[(\d+)\])?$", toks[-1])
    if name is None:
        return None
    elem = max(1, int(m.group(1)) // 8)
    count = int(name.group(2) or 1)
    return PtxParam(name.group(1), toks[i], elem * count, align or elem)


def ptx_entries(ptx: str) -> dict[str, tuple[PtxParam, ...]]:
    """The parameter list of every `.entry` in a PTX text."""
    out: dict[str, tuple[PtxParam, ...]] = {}
    for m in _PTX_ENTRY.finditer(ptx):
        params = []
        for decl in filter(None, (d.strip() for d in m.group(2).split(","))):
            p = _ptx_param(decl)
            if p is None:
                raise LayoutMismatch(f"kernel {m.group(1)!r}: cannot read PTX parameter {decl!r}")
            params.append(p)
        out[m.group(1)] = tuple(params)
    return out


_PTX_MAXNTID = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\([^)]*\)([^{;]*)\{")


def ptx_max_threads(ptx: str) -> dict[str, int | None]:
    """Threads per block each `.entry` is limited to by `.maxntid` (what `__launch_bounds__` becomes),
    None for an entry without one."""
    out: dict[str, int | None] = {}
    for m in _PTX_MAXNTID.finditer(ptx):
        d = re.search(r"\.maxntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", m.group(2))
        out[m.group(1)] = None if d is None else int(d.group(1)) * int(d.group(2) or 1) * int(d.group(3) or 1)
    return out


def check_layout(ptx: str, specs: Sequence[Any]) -> None:
    """Raise LayoutMismatch unless every spec's parameters match its PTX .entry in count, size and alignment,
    and the thread limit the registry read from `__launch_bounds__` is the one the compiler applied."""
    entries = ptx_entries(ptx)
    bounds = ptx_max_threads(ptx)
    problems = []
    for spec in specs:
        where = f"{Path(spec.source).name}:{spec.line}"
        got = entries.get(spec.name)
        if got is None:
            problems.append(f"kernel {spec.name!r} ({where}): no .entry in the PTX (inside #if, or not extern \"C\"?)")
            continue
        limit = getattr(spec, "max_threads", None)
        # A registry value of None for a bounded kernel is allowed only where the registry already
        # warned that it could not read it (sources outside kernels_cu/, not strict).
        if bounds.get(spec.name) != limit and (limit is not None or _strict_source(spec.source)):
            problems.append(
                f"kernel {spec.name!r} ({where}): the registry read __launch_bounds__ as {limit} threads, "
                f"the compiler applied {bounds.get(spec.name)} (.maxntid); launches would be checked against "
                f"the wrong limit"
            )
        if len(got) != len(spec.params):
            problems.append(
                f"kernel {spec.name!r} ({where}): expected {len(spec.params)} parameters from the source, "
                f"PTX has {len(got)}"
            )
            continue
        for i, (p, q) in enumerate(zip(spec.params, got)):
            size, align = size_align(p.ctype)
            if (size, align) != (q.size, q.align):
                problems.append(
                    f"kernel {spec.name!r} ({where}) parameter {i} {p.name!r}: expected {p.ctype} "
                    f"(size {size}, align {align}), PTX has {q.type} (size {q.size}, align {q.align})"
                )
    if problems:
        raise LayoutMismatch("\n".join(problems))


def _strict_source(path: Any) -> bool:
    from .registry import _is_strict

    return _is_strict(Path(path))


# --------------------------------------------------------------------------- compile

_LOG_POS = re.compile(r"^(.*?)\((\d+)\): (error|catastrophic error|warning)[^:]*: (.*)$", re.M)
# NVRTC keeps global state per program only, but serializing compiles within one process keeps
# its memory use bounded; precompile gets parallelism from processes instead.
_lock = threading.Lock()


def _first_error(log: str) -> str:
    for m in _LOG_POS.finditer(log):
        if "error" in m.group(3):
            return f"{m.group(1)}:{m.group(2)}: {m.group(3)}: {m.group(4).strip()}"
    lines = [ln for ln in log.splitlines() if ln.strip()]
    return lines[0] if lines else "(empty log)"


def _buffer(nvrtc: Any, prog: Any, size_fn: str, get_fn: str) -> bytes:
    """One NVRTC output (log, PTX, cubin) copied out through a fresh writable buffer.

    Never `b" " * n`: NVRTC writes into the buffer it is given, and for n <= 1 CPython hands back
    its shared one-byte `b" "` (or the empty bytes) object, so an empty log (size 1, the NUL) would
    turn every `b" "` of the process into `b"\\x00"`.
    """
    n = int(_check(getattr(nvrtc, size_fn)(prog), size_fn))
    if n <= 0:
        return b""
    buf = bytearray(n)
    _check(getattr(nvrtc, get_fn)(prog, buf), get_fn)
    return bytes(buf)


def _log_text(nvrtc: Any, prog: Any) -> str:
    log = _buffer(nvrtc, prog, "nvrtcGetProgramLogSize", "nvrtcGetProgramLog")
    return log.rstrip(b"\0").decode("utf-8", "replace")


def compile(  # noqa: A001 - the name is the contract
    source: SourceLike,
    arch: str | int,
    options: Sequence[str] = (),
    defines: Mapping[str, Any] | None = None,
) -> CompiledModule:
    """Compile one source for one arch; raise CompileError (with log and options) or LayoutMismatch."""
    from .registry import parse_file

    src = source if isinstance(source, Source) else load_source(source)
    arch = normalize_arch(arch)
    full = _full_options(src, arch, portable_options(arch, options, defines))
    nvrtc = _nvrtc()
    with _lock:
        prog = _check(nvrtc.nvrtcCreateProgram(src.data, str(src.path).encode(), 0, [], []), "nvrtcCreateProgram")
        try:
            encoded = [o.encode() for o in full]
            (res,) = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
            log = _log_text(nvrtc, prog)
            if int(res) != 0:
                raise CompileError(
                    f"NVRTC could not compile {src.path.name} for {arch} ({res.name if hasattr(res, 'name') else res}): "
                    f"{_first_error(log)}",
                    log,
                    tuple(full),
                )
            ptx_bytes = _buffer(nvrtc, prog, "nvrtcGetPTXSize", "nvrtcGetPTX")
            cubin = _buffer(nvrtc, prog, "nvrtcGetCUBINSize", "nvrtcGetCUBIN") if arch.startswith("sm_") else b""
        finally:
            nvrtc.nvrtcDestroyProgram(prog)
    ptx = ptx_bytes.rstrip(b"\0").decode("utf-8")
    specs = parse_file(src.path)
    try:
        check_layout(ptx, specs)
    except LayoutMismatch as e:
        raise LayoutMismatch(f"{src.path.name} for {arch}: {e}") from None
    if arch.startswith("sm_"):
        kind, image = "cubin", cubin
        resources = parse_resources(log)
    else:
        kind, image, resources = "ptx", ptx.encode("utf-8"), {}
    return CompiledModule(
        arch=arch,
        kind=kind,
        image=image,
        ptx=ptx,
        log=log,
        resources=resources,
        options=tuple(full),
        kernels=tuple(s.name for s in specs),
    )
