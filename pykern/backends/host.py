"""The host backend: the kernels_cu/*.cu text compiled with the system C++ compiler and run on the CPU.

Each `.cu` file becomes one shared library (see `pykern.host.build`) holding every kernel
of the file plus the fiber runtime; a launch runs the grid's blocks one after another,
each block's threads as fibers, in the order `PYKERN_HOST_SCHEDULE` names. Every array argument
runs in a guarded copy (`_Staging`): an out-of-bounds access faults before it touches other memory
and is a KernelExecutionError naming the argument and the byte offset.

`PYKERN_HOST_SANITIZE=1` builds with AddressSanitizer + UBSan and copies every array into
an exactly-sized heap buffer for the launch, so an out-of-bounds access is reported. The
ASan runtime must be loaded first: use `run_sanitized` (a subprocess with LD_PRELOAD).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from ..errors import ArgumentError, ArgumentTypeError, BackendUnavailable, KernelExecutionError
from ..registry import KernelSpec, parse_file

SCHEDULES = {"forward": 0, "reverse": 1, "random": 2}
INTERLEAVE_BLOCKS = 4  # blocks resident at once under `interleave`
# A GPU grants each thread up to 512 KiB of local memory; fiber stacks are that large
# (reserved, not committed: only touched pages cost memory).
_STACK_BYTES = 512 << 10
_SANITIZE_STACK_BYTES = 2 << 20  # ASan frames are several times larger
_WATCHDOG_S = 60.0


class LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem", ctypes.c_ulonglong),
        ("schedule", ctypes.c_int),
        ("interleave", ctypes.c_int),
        ("seed", ctypes.c_ulonglong),
        ("stack_bytes", ctypes.c_ulonglong),
        ("watchdog_ms", ctypes.c_ulonglong),
        ("flags", ctypes.c_ulonglong),
        ("smem_limit", ctypes.c_ulonglong),
        ("cluster", ctypes.c_uint * 3),
    ]


# Shared memory one block may use (static + dynamic, opt-in maximum) per arch, in KiB.
SMEM_LIMIT_KB = {
    "sm_75": 64, "sm_80": 163, "sm_86": 99, "sm_87": 163, "sm_88": 99, "sm_89": 99, "sm_90": 227,
    "sm_100": 227, "sm_103": 227, "sm_107": 227, "sm_110": 227, "sm_120": 99, "sm_121": 99,
    "sm_90a": 227, "sm_100a": 227,  # arch-specific targets: PYKERN_HOST_ARCH=sm_90a selects the Hopper kernels
}


def host_arch() -> str:
    """$PYKERN_HOST_ARCH ('' when unset: the host runs every kernel, arch-specific ones included)."""
    arch = os.environ.get("PYKERN_HOST_ARCH", "").strip()
    if arch and arch not in SMEM_LIMIT_KB:
        raise ArgumentError(f"PYKERN_HOST_ARCH: expected one of {', '.join(SMEM_LIMIT_KB)}, got {arch!r}")
    return arch


def smem_limit() -> int:
    """Bytes of shared memory a block may use: $PYKERN_HOST_ARCH's limit, else the largest (227 KiB)."""
    arch = os.environ.get("PYKERN_HOST_ARCH", "").strip()
    if not arch:
        return 227 << 10
    if arch not in SMEM_LIMIT_KB:
        raise ArgumentError(f"PYKERN_HOST_ARCH: expected one of {', '.join(SMEM_LIMIT_KB)}, got {arch!r}")
    return SMEM_LIMIT_KB[arch] << 10


def parse_schedule_full(value: str | None) -> tuple[int, int, int]:
    """PYKERN_HOST_SCHEDULE -> (order, seed, resident blocks); ArgumentError naming the variable.

    `forward` / `reverse`: blocks and threads in index order / both reversed; `random:SEED`:
    both shuffled (seeded); `interleave` / `interleave:SEED`: several blocks resident at once,
    their fibers interleaved (forward order / both shuffled), atomics and fences yield.
    """
    text = (value or "forward").strip()
    name, _, seed = text.partition(":")
    if name in ("forward", "reverse") and not seed:
        return SCHEDULES[name], 0, 1
    if name == "interleave" and not seed:
        return SCHEDULES["forward"], 0, INTERLEAVE_BLOCKS
    if name in ("random", "interleave"):
        try:
            n = int(seed, 0)
            if n < 0 or n >= 1 << 64:
                raise ValueError
            return SCHEDULES["random"], n, (INTERLEAVE_BLOCKS if name == "interleave" else 1)
        except ValueError:
            pass
    raise ArgumentError(
        "PYKERN_HOST_SCHEDULE: expected 'forward', 'reverse', 'random:SEED', 'interleave' or 'interleave:SEED' "
        f"(SEED an integer >= 0), got {text!r}"
    )


def parse_schedule(value: str | None) -> tuple[int, int]:
    """`forward` | `reverse` | `random:SEED` | `interleave[:SEED]` -> (order, seed)."""
    mode, seed, _ = parse_schedule_full(value)
    return mode, seed


def watchdog_ms() -> int:
    """$PYKERN_HOST_WATCHDOG_S (seconds, default 60; 0 turns the watchdog off) in ms."""
    text = os.environ.get("PYKERN_HOST_WATCHDOG_S", "").strip()
    if not text:
        return int(_WATCHDOG_S * 1000)
    try:
        v = float(text)
        if not (v >= 0 and v < 1e7):
            raise ValueError
    except ValueError:
        raise ArgumentError(f"PYKERN_HOST_WATCHDOG_S: expected seconds >= 0 (0: off), got {text!r}") from None
    return int(v * 1000)


def stack_bytes(sanitize: bool) -> int:
    """Per-thread fiber stack: $PYKERN_HOST_STACK_KB KiB, else 512 KiB (2 MiB under the sanitizer)."""
    text = os.environ.get("PYKERN_HOST_STACK_KB", "").strip()
    if not text:
        return _SANITIZE_STACK_BYTES if sanitize else _STACK_BYTES
    try:
        kb = int(text)
    except ValueError:
        kb = 0
    if not 16 <= kb <= 1 << 20:
        raise ArgumentError(f"PYKERN_HOST_STACK_KB: expected an integer from 16 to {1 << 20}, got {text!r}")
    return kb << 10


def sanitize_enabled() -> bool:
    return os.environ.get("PYKERN_HOST_SANITIZE", "").strip() not in ("", "0")


def _asan_loaded() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "__asan_init")
    except OSError:
        return False


def _stamps(files: Sequence[Path]) -> tuple[tuple[int, int], ...]:
    out = []
    for f in files:
        try:
            st = os.stat(f)
        except OSError:
            return ()
        out.append((st.st_mtime_ns, st.st_size))
    return tuple(out)


class _Library:
    """One loaded .so: the launch entry point of each kernel of its source file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.dll = ctypes.CDLL(str(path))
        self._fns: dict[str, Any] = {}
        self.alloc = self.dll.pkrt_alloc
        self.alloc.restype, self.alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        self.free = self.dll.pkrt_free
        self.free.restype, self.free.argtypes = None, [ctypes.c_void_p]
        self.race_buffers = self.dll.pkrt_race_buffers
        self.race_buffers.restype = None
        self.guard_args = self.dll.pkrt_guard_args
        self.guard_args.restype = None
        self.guard_reserve = self.dll.pkrt_guard_reserve
        self.guard_reserve.restype, self.guard_reserve.argtypes = ctypes.c_ulonglong, [ctypes.c_ulonglong]
        self.guard_resize = self.dll.pkrt_guard_resize
        self.guard_resize.restype = ctypes.c_int
        self.guard_resize.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_ulonglong]
        self.guard_release = self.dll.pkrt_guard_release
        self.guard_release.restype, self.guard_release.argtypes = None, [ctypes.c_ulonglong, ctypes.c_ulonglong]
        self.release_stacks = getattr(self.dll, "pkrt_release_stacks", None)
        if self.release_stacks is not None:
            self.release_stacks.restype, self.release_stacks.argtypes = None, []
        self._bank_stats = self.dll.pkrt_bank_stats
        self._bank_stats.restype = None
        self._bank_stats.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_char_p), ctypes.c_int]
        self._v4_stats = self.dll.pkrt_v4_bank_stats
        self._v4_stats.restype = None
        self._v4_stats.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_char_p), ctypes.c_int]
        self.v4_enable = self.dll.pkrt_v4_bank_enable
        self.v4_enable.restype, self.v4_enable.argtypes = None, [ctypes.c_int]
        if _V4_BANK_MODEL[0]:
            self.v4_enable(1)

    def bank_stats(self, reset: bool, v4: bool = False) -> dict[str, Any]:
        """The runtime's ldmatrix bank model totals (pk_host_runtime.cpp, bank_count_ldsm), or with v4 its 16-byte
        access model's (v4_record)."""
        out = (ctypes.c_ulonglong * 4)()
        where = ctypes.c_char_p()
        (self._v4_stats if v4 else self._bank_stats)(out, ctypes.byref(where), int(reset))
        file = where.value.decode(errors="replace") if where.value else None
        return {"phases": int(out[0]), "wavefronts": int(out[1]), "worst": int(out[2]),
                "worst_at": f"{file}:{int(out[3])}" if file else None}

    def fn(self, name: str) -> Any:
        f = self._fns.get(name)
        if f is None:
            f = getattr(self.dll, f"pk_launch_{name}")
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
            self._fns[name] = f
        return f


class HostBackend:
    name = "host"

    def __init__(self) -> None:
        self._libs: dict[tuple[str, str, tuple[bool, ...]], _Library] = {}
        # Per launch only stat() the source and its headers; re-hash when one changed.
        self._fast: dict[tuple[Path, tuple[bool, ...]], tuple[tuple[Path, ...], tuple[tuple[int, int], ...], _Library]] = {}

    def available(self) -> tuple[bool, str]:
        from ..host.build import find_compiler

        try:
            find_compiler()
        except BackendUnavailable as e:
            return False, str(e)
        return True, ""

    def arch_features(self, device: int = 0) -> tuple[str, ...]:
        """("sm_90a",) when PYKERN_HOST_ARCH=sm_90a (likewise sm_100a): the ops then choose the arch-specific
        kernels, which the host runs through its emulation of wgmma/TMA/mbarrier; () otherwise."""
        arch = host_arch()
        return (arch,) if arch.endswith("a") else ()

    # ---- building ----------------------------------------------------------------
    def library(self, source: Path, sanitize: bool | None = None) -> _Library:
        """The loaded library for one `.cu` file (compiled on a cache miss)."""
        from .. import sources
        from ..host import build

        from ..host import gpu_conv
        from ..host.build import checked_build, fma_enabled, opt_level

        sanitize = sanitize_enabled() if sanitize is None else sanitize
        # what changes the binary
        flavor = (sanitize, fma_enabled(), checked_build() and not sanitize, gpu_conv.enabled(), opt_level())
        fast = self._fast.get((source, flavor))
        if fast is not None and _stamps(fast[0]) == fast[1]:
            return fast[2]
        src = sources.load(source)
        key = (str(src.path), src.digest(), flavor)
        lib = self._libs.get(key)
        if lib is None:
            if sanitize and not _asan_loaded():
                raise BackendUnavailable(
                    "host backend: PYKERN_HOST_SANITIZE=1 needs the AddressSanitizer runtime loaded first; "
                    "run through pykern.backends.host.run_sanitized(...) or set LD_PRELOAD to "
                    f"{sanitizer_preload() or 'libasan.so'}"
                )
            specs = parse_file(src.path)
            path = build.build(
                src.path, src.text, src.digest(), sources.include_dirs(src.path.parent), specs, sanitize
            )
            lib = _Library(path)
            self._libs[key] = lib
        files = (src.path, *src.headers)
        self._fast[(source, flavor)] = (files, _stamps(files), lib)
        return lib

    def prebuild(
        self, files: Sequence[Path] | None = None, sanitize: bool | None = None, jobs: int | None = None
    ) -> list[Path]:
        """Build (or find cached) the library of each `.cu` file, `jobs` compilers at a time.

        Default: every source the registry knows. Compile errors propagate (the first one).
        """
        from concurrent.futures import ThreadPoolExecutor

        from ..registry import source_files

        todo = list(source_files() if files is None else files)
        workers = max(1, min(len(todo), jobs or os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            return [lib.path for lib in pool.map(lambda f: self.library(Path(f), sanitize), todo)]

    # ---- launching ---------------------------------------------------------------
    def launch(
        self,
        spec: KernelSpec,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[Any],
        shared_mem: int,
        stream: Any = None,
        device: int | None = None,  # the CPU is the one device here
        pdl: bool = False,  # launches run whole, one after another: the kernel's wait has nothing to wait for
        cluster: tuple[int, int, int] | None = None,  # a cluster's CTAs run resident together (pk_host_sm90.cpp)
    ) -> None:
        import numpy as np

        sanitize = sanitize_enabled()
        mode, seed, resident = parse_schedule_full(os.environ.get("PYKERN_HOST_SCHEDULE"))
        limit = smem_limit()
        if shared_mem > limit:
            raise ArgumentError(
                f"shared_mem: {spec.name} asks for {shared_mem} bytes of dynamic shared memory, more than the "
                f"{limit} bytes a block may use (PYKERN_HOST_ARCH={os.environ.get('PYKERN_HOST_ARCH', '')!r})"
            )
        arch = host_arch()
        if spec.archs and arch and arch not in spec.archs:
            raise ArgumentError(
                f"{spec.name}: built only for {', '.join(spec.archs)} ({spec.source.name}'s `// pykern: arch` line); "
                f"PYKERN_HOST_ARCH={arch!r} is not one of them"
            )
        import numpy as np

        lib = self.library(spec.source, sanitize)
        fn = lib.fn(spec.name)

        n = len(spec.params)
        ptrs = (ctypes.c_void_p * max(n, 1))()
        argv = (ctypes.c_void_p * max(n, 1))()
        copies: list[tuple[int, Any, int, bool, int]] = []  # (buffer, array, nbytes, write back, address)
        before: dict[int, Any] = {}  # buffer -> its bytes at the copy (sanitize: changed bytes are written back)
        pointers: list[tuple[int, Any, Any]] = []  # (index, param, array) of every pointer argument
        for i, (p, a) in enumerate(zip(spec.params, args)):
            if p.is_pointer:
                if not isinstance(a, np.ndarray):
                    raise ArgumentTypeError(
                        f"{spec.name}: argument {i} ({p.ctype} {p.name}): the host backend takes NumPy arrays, "
                        f"got {type(a).__name__}"
                    )
                if not a.flags.c_contiguous:
                    raise ArgumentError(
                        f"{spec.name}: argument {i} ({p.ctype} {p.name}): expected a C-contiguous array, "
                        f"got strides {a.strides}"
                    )
                pointers.append((i, p, a))
        # The sanitizer build checks every access itself (ASan's own SIGSEGV handler is in charge there):
        # exactly-sized heap copies below, no guard windows.
        staging = None if sanitize else _Staging(lib, pointers)
        _enter_module(lib)
        try:
            staged = staging.stage() if staging is not None else {}
            for i, (p, a) in enumerate(zip(spec.params, args)):
                if p.is_pointer:
                    addr = a.ctypes.data
                    if staging is not None:
                        addr = staged[i]
                    else:
                        # An exactly-sized heap copy puts ASan's redzone right after the last element.
                        # The same array passed twice (in-place ops) shares one copy.
                        same = next((k for k, c in enumerate(copies) if c[4] == addr and c[2] == a.nbytes), None)
                        if same is None:
                            buf = lib.alloc(a.nbytes)
                            ctypes.memmove(buf, addr, a.nbytes)
                            copies.append((buf, a, a.nbytes, not p.is_const, addr))
                            if not p.is_const:
                                before[buf] = np.frombuffer(ctypes.string_at(addr, a.nbytes), np.uint8)
                        else:
                            buf = copies[same][0]
                            if not p.is_const:
                                copies[same] = copies[same][:3] + (True, addr)
                                before.setdefault(buf, np.frombuffer(ctypes.string_at(addr, a.nbytes), np.uint8))
                        addr = buf
                    ptrs[i] = addr
                    argv[i] = ctypes.addressof(ptrs) + i * ctypes.sizeof(ctypes.c_void_p)
                else:
                    argv[i] = ctypes.addressof(a)
            cfg = LaunchConfig(
                (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem, mode, resident, seed,
                stack_bytes(sanitize), watchdog_ms(), 0, limit, (ctypes.c_uint * 3)(*(cluster or (1, 1, 1))),
            )
            check_flags = _check_flags() if not sanitize else 0
            cfg.flags = check_flags
            if check_flags:
                # Racecheck/initcheck shadow every word of every array argument.
                bufs = [(ptrs[i], a.nbytes, f"argument {i} ({p.ctype} {p.name})".encode())
                        for i, (p, a) in enumerate(zip(spec.params, args)) if p.is_pointer]
                k = len(bufs)
                names = (ctypes.c_char_p * max(k, 1))(*[b[2] for b in bufs])
                lib.race_buffers(k, (ctypes.c_ulonglong * max(k, 1))(*[b[0] for b in bufs]),
                                 (ctypes.c_ulonglong * max(k, 1))(*[b[1] for b in bufs]), names)
            if staging is not None:
                staging.register()
            err = ctypes.create_string_buffer(4096)
            rc = fn(ctypes.byref(cfg), argv, err, len(err))
            if rc != 0:
                raise KernelExecutionError(_resolve_pcs(err.value.decode("utf-8", "replace"), lib.path))
            if staging is not None:
                staging.check_and_copy_back(spec.name)
            for buf, a, nbytes, write_back, _ in copies:
                if write_back and nbytes:
                    # Only the bytes the kernel changed: two outputs may view overlapping memory (the K and V
                    # views of one combined KV cache); a whole copy-back of one would undo the other's writes.
                    new = np.frombuffer(ctypes.string_at(buf, nbytes), np.uint8)
                    changed = new != before[buf]
                    a.reshape(-1).view(np.uint8)[changed] = new[changed]
        finally:
            _leave_module(lib)
            if staging is not None:
                staging.release()
            for buf, *_ in copies:
                lib.free(buf)


def _check_flags() -> int:
    """Runtime checks of the checked build: 1 racecheck, 2 stress (yield at stores), 4 initcheck."""
    from ..host.build import racecheck_mode

    mode = racecheck_mode()
    f = 1 if mode == "1" else 2 if mode == "stress" else 0
    if os.environ.get("PYKERN_HOST_INITCHECK", "").strip() not in ("", "0"):
        f |= 4
    return f


def _resolve_pcs(msg: str, lib: Path) -> str:
    """Racecheck names code by offsets in the library (@@pc:HEX@@): turn them into .cu file:line.

    A fault names its instruction as @@at:HEX@@: " at FILE:LINE", or nothing where the library has no
    line tables (the default build).
    """
    import re

    offs = re.findall(r"@@(?:pc|at):([0-9a-f]+)@@", msg)
    if not offs:
        return msg
    where: dict[str, str] = {}
    try:
        out = subprocess.run(["addr2line", "-e", str(lib), *[f"0x{o}" for o in offs]], capture_output=True,
                             text=True, timeout=30).stdout.split("\n")
        for o, line in zip(offs, out):
            line = line.strip()
            if line and not line.startswith("??") and not line.endswith(":?"):
                where[o] = line
    except (OSError, subprocess.SubprocessError):
        pass
    msg = re.sub(r"@@at:([0-9a-f]+)@@", lambda m: f" at {where[m.group(1)]}" if m.group(1) in where else "", msg)
    return re.sub(r"@@pc:([0-9a-f]+)@@", lambda m: where.get(m.group(1), f"library offset 0x{m.group(1)}"), msg)


# ---- fiber stacks: one module's at a time ----------------------------------------------------
# Every module carries its own runtime and keeps its fiber stacks between launches (two mappings a stack: a
# CTA of 384 threads holds 768). A process running hundreds of modules (the test suite) would pass the kernel's
# vm.max_map_count (65530) and every later mmap / mprotect would fail with ENOMEM. When a launch enters another
# module, the one it leaves gives its stacks back, unless a launch of it is still running in another thread.
_modules_lock = threading.Lock()
_running: dict[int, int] = {}
_last_module: list[Any] = [None]


def _enter_module(lib: Any) -> None:
    with _modules_lock:
        prev = _last_module[0]
        release = getattr(prev, "release_stacks", None)
        if prev is not None and prev is not lib and not _running.get(id(prev)) and release is not None:
            release()
        _last_module[0] = lib
        _running[id(lib)] = _running.get(id(lib), 0) + 1


def _leave_module(lib: Any) -> None:
    with _modules_lock:
        _running[id(lib)] -= 1


# ---- guarded staging of array arguments (every build but the sanitizer's) ----------------------
# Each array argument runs in a copy of its own whose last byte sits flush against the upper half of
# a 2 * _GUARD_HALF window of PROT_NONE address space; the pages before the copy's first page are
# PROT_NONE too. An access past the end, at any distance up to the window's edge, faults before it
# touches anything, as does one before the start by more than the slack bytes of the copy's first
# page; the runtime's fault handler names the argument, read or write and the byte offset, and the
# process lives on. Those slack bytes (fewer than a page before the start, fewer than _ALIGN after
# the end) hold a NaN pattern (a read there shows as NaN, not as the neighbour's data) and are
# checked after the launch (a write there is an error naming the byte range). The checked build
# (PYKERN_HOST_RACECHECK / INITCHECK) sees every access and reports those too, with the line.
# Arguments whose memory overlaps (views of one buffer: the K and V views of a combined KV cache)
# share one copy of their union, so the aliasing the kernel sees is the caller's.
# Windows are reused across launches (a process-wide pool, with their read-write pages while the
# pool holds at most _POOL_RW_BYTES of them): a launch then costs one mprotect per argument at most,
# plus the copies in and out and a comparison of the writable ones (docs/host_backend.md has figures).
_GUARD_HALF = 1 << 40  # 1 TiB each side: 64-bit index arithmetic gone wrong lands in the window too
_GUARD_HALF_MIN = 1 << 20  # where address space is short (RLIMIT_AS), smaller windows, down to 1 MiB
_ALIGN = 16  # the copy keeps the caller's address modulo 16: float4/uint4 accesses stay aligned as given
_POOL_MAX = 8  # windows kept between launches (2 TiB of address space each, no memory)
_POOL_RW_BYTES = 64 << 20  # read-write pages the kept windows may hold
_PAGE = mmap.PAGESIZE
_RZ_PATTERN = bytes([0xFF, 0xFF, 0xBF, 0xFF])  # a NaN as float (little-endian, at 4-byte aligned addresses)
_PATTERN = _RZ_PATTERN * ((_PAGE + 2 * _ALIGN) // 4 + 1)


class _Window:
    __slots__ = ("lo", "size", "boundary", "rw")

    def __init__(self, lo: int, half: int) -> None:
        self.lo, self.size, self.boundary, self.rw = lo, 2 * half, lo + half, 0


_pool: list[_Window] = []
_pool_lock = threading.Lock()


def _take_window(lib: _Library, rw: int) -> _Window:
    """A window whose read-write pages are exactly the `rw` bytes below its boundary."""
    with _pool_lock:
        # The kept window with the closest read-write size (fewest pages to map or drop) among those whose
        # lower half holds the copy with at least _GUARD_HALF_MIN to spare.
        fits = [x for x in _pool if x.size // 2 >= rw + _GUARD_HALF_MIN]
        w = min(fits, key=lambda x: abs(x.rw - rw), default=None)
        if w is not None:
            _pool.remove(w)
    if w is None:
        half = _GUARD_HALF
        while half >= rw + _GUARD_HALF_MIN:
            lo = lib.guard_reserve(half)
            if lo:
                w = _Window(lo, half)
                break
            half //= 4
        else:
            raise KernelExecutionError(
                f"host backend: cannot reserve {2 * (rw + _GUARD_HALF_MIN)} bytes of address space for a guarded "
                "argument copy (mmap failed: an address-space limit such as `ulimit -v`?)"
            )
    if w.rw != rw:
        e = lib.guard_resize(w.boundary, w.rw, rw)
        if e:
            lib.guard_release(w.lo, w.size)
            raise KernelExecutionError(f"host backend: cannot map {rw} bytes for a guarded argument copy: "
                                       f"{os.strerror(e)}")
        w.rw = rw
    return w


def _give_back_window(lib: _Library, w: _Window) -> None:
    with _pool_lock:
        if len(_pool) < _POOL_MAX:
            if w.rw and sum(x.rw for x in _pool) + w.rw > _POOL_RW_BYTES:
                if lib.guard_resize(w.boundary, w.rw, 0) == 0:
                    w.rw = 0
                else:
                    lib.guard_release(w.lo, w.size)
                    return
            _pool.append(w)
            return
    lib.guard_release(w.lo, w.size)


class _Group:
    """One staged copy: an argument, or the union of arguments whose memory overlaps."""

    __slots__ = ("members", "lo", "hi", "window", "start", "writable", "before")

    def __init__(self, member: tuple[int, Any, Any]) -> None:
        a = member[2]
        self.members = [member]
        self.lo, self.hi = a.ctypes.data, a.ctypes.data + a.nbytes
        self.window: _Window | None = None
        self.start = 0  # the copy's first byte
        self.writable = not member[1].is_const
        self.before: Any = None


def _label(i: int, p: Any, a: Any) -> str:
    return f"argument {i} ({p.ctype} {p.name}, {a.nbytes} bytes)"


_COPY_BACK_BLOCK = 1 << 16  # bytes a block of the copy-back's comparison: bounds its mask's size


class _Staging:
    """Every array argument of one launch in its guarded copy (see above)."""

    def __init__(self, lib: _Library, pointers: list[tuple[int, Any, Any]]) -> None:
        self.lib = lib
        self.groups: list[_Group] = []
        # Overlapping ranges join one group (sorted sweep); empty arrays stay alone (nothing to alias).
        for m in sorted(pointers, key=lambda m: (m[2].ctypes.data, -m[2].nbytes)):
            a = m[2]
            g = self.groups[-1] if self.groups else None
            if g is not None and a.nbytes and g.hi > g.lo and a.ctypes.data < g.hi:
                g.members.append(m)
                g.hi = max(g.hi, a.ctypes.data + a.nbytes)
                g.writable = g.writable or not m[1].is_const
            else:
                self.groups.append(_Group(m))

    def stage(self) -> dict[int, int]:
        """Map and fill each group's copy; argument index -> the address the kernel gets."""
        import numpy as np

        out: dict[int, int] = {}
        for g in self.groups:
            size = g.hi - g.lo
            tail = (-g.hi) % _ALIGN  # keeps the copy's address modulo _ALIGN equal to the caller's
            rw = -(-(size + tail) // _PAGE) * _PAGE
            g.window = _take_window(self.lib, rw)
            b = g.window.boundary
            g.start = b - tail - size
            first = b - rw
            head = g.start - first
            if head:
                ctypes.memmove(first, _PATTERN, head)  # `first` is page-aligned: pattern phase 0
            if tail:
                ctypes.memmove(b - tail, _PATTERN[(b - tail) % 4:], tail)
            if size:
                ctypes.memmove(g.start, g.lo, size)
                if g.writable:
                    g.before = np.frombuffer(ctypes.string_at(g.lo, size), np.uint8)
            for i, _p, a in g.members:
                out[i] = g.start + (a.ctypes.data - g.lo)
        return out

    def register(self) -> None:
        """Tell the runtime where each argument's copy and window are (its fault handler's map)."""
        rows = [(g, i, p, a) for g in self.groups for i, p, a in g.members]
        k = len(rows)
        win = (ctypes.c_ulonglong * max(2 * k, 1))()
        data = (ctypes.c_ulonglong * max(2 * k, 1))()
        labels = [_label(i, p, a).encode() for _g, i, p, a in rows]
        for j, (g, _i, _p, a) in enumerate(rows):
            win[2 * j], win[2 * j + 1] = g.window.lo, g.window.lo + g.window.size
            data[2 * j], data[2 * j + 1] = g.start + (a.ctypes.data - g.lo), a.nbytes
        self.lib.guard_args(k, win, data, (ctypes.c_char_p * max(k, 1))(*labels))

    def check_and_copy_back(self, kernel: str) -> None:
        """Slack bytes written -> KernelExecutionError; else each writable copy's changed bytes go back."""
        import numpy as np

        for g in self.groups:
            b = g.window.boundary
            first = b - g.window.rw
            head, tail = g.start - first, b - (g.start + g.hi - g.lo)
            for lo, n, side in ((first, head, "before"), (b - tail, tail, "past")):
                if n and ctypes.string_at(lo, n) != _PATTERN[lo % 4 : lo % 4 + n]:
                    got = np.frombuffer(ctypes.string_at(lo, n), np.uint8)
                    want = np.frombuffer(_PATTERN[lo % 4 : lo % 4 + n], np.uint8)
                    bad = np.flatnonzero(got != want)
                    # Named after the argument that starts first / ends last in the copy.
                    i, p, a = (min if side == "before" else max)(
                        g.members, key=lambda m: m[2].ctypes.data + (m[2].nbytes if side == "past" else 0))
                    s0 = g.start + (a.ctypes.data - g.lo)
                    f, l = lo + int(bad[0]) - s0, lo + int(bad[-1]) + 1 - s0
                    raise KernelExecutionError(
                        f"kernel {kernel}: out-of-bounds write {side} {_label(i, p, a)}: bytes [{f}, {l}) relative "
                        "to its start were written (the slack bytes next to its guarded copy, checked after the "
                        "launch; on a GPU: other data corrupted or a fault; PYKERN_HOST_RACECHECK=1 names the "
                        "thread and line)"
                    )
        for g in self.groups:
            size = g.hi - g.lo
            if not (g.writable and size):
                continue
            # Only the bytes the kernel changed: memory a tensor map's TMA store wrote directly (it holds the
            # caller's address) keeps those writes. Block by block, so the comparison's temporaries stay
            # _COPY_BACK_BLOCK bytes whatever the argument's size (the ops' own memory bounds are tested).
            for off in range(0, size, _COPY_BACK_BLOCK):
                n = min(_COPY_BACK_BLOCK, size - off)
                new = np.frombuffer((ctypes.c_uint8 * n).from_address(g.start + off), np.uint8)
                changed = new != g.before[off:off + n]
                count = int(np.count_nonzero(changed))
                if count == n:
                    ctypes.memmove(g.lo + off, g.start + off, n)
                elif count:  # a masked copy: no temporaries (a boolean-index assignment gathers, ~2x slower)
                    np.copyto(np.frombuffer((ctypes.c_uint8 * n).from_address(g.lo + off), np.uint8), new,
                              where=changed)

    def release(self) -> None:
        for g in self.groups:
            if g.window is not None:
                _give_back_window(self.lib, g.window)
                g.window = None


def ldmatrix_bank_stats(reset: bool = True) -> dict[str, dict[str, Any]]:
    """The host backend's bank model of `ldmatrix`, per `.cu` source whose library is loaded: {stem: {"phases",
    "wavefronts", "worst", "worst_at"}} since the last reset (reset=True starts a new count).

    Each 8x8 matrix of an ldmatrix .x4 is one shared-memory phase (8 rows of 16 bytes); it takes as many
    wavefronts as the most distinct 4-byte words one of the 32 banks must deliver (a word read by several lanes
    is one broadcast): `wavefronts == phases` means every ldmatrix ran without a bank conflict, and `worst`
    (1..8) is the most wavefronts of one phase, at `worst_at` (file:line of the ldmatrix). cp.async copies and
    plain shared loads / stores are not counted."""
    from . import get_backend

    be = get_backend("host")
    res: dict[str, dict[str, Any]] = {}
    for (path, _digest, _flavor), lib in getattr(be, "_libs", {}).items():
        stats = lib.bank_stats(reset)
        prev = res.get(Path(path).stem)
        if prev is None or stats["phases"]:
            res[Path(path).stem] = stats
    return res


_V4_BANK_MODEL = [False]  # whether the libraries loaded from now on start with the 16-byte bank model on


def shared_v4_bank_model(on: bool) -> None:
    """Turn the host backend's bank model of 16-byte shared-memory accesses on or off, in every library loaded
    and every one loaded later (off by default: it keeps a record of every such access while on)."""
    from . import get_backend

    _V4_BANK_MODEL[0] = bool(on)
    for lib in getattr(get_backend("host"), "_libs", {}).values():
        lib.v4_enable(int(bool(on)))


def shared_v4_bank_stats(reset: bool = True) -> dict[str, dict[str, Any]]:
    """The host backend's bank model of 16-byte shared-memory accesses (cp.async of 16 bytes, at their shared
    destination, and `pk_ld_shared_v4` reads, i.e. ld.shared.v4 / LDS.128), per `.cu` source whose library is
    loaded, while `shared_v4_bank_model(True)`: {stem: {"phases", "wavefronts", "worst", "worst_at"}} since the last
    reset, as ldmatrix_bank_stats'.

    A warp's 16-byte access is served a quarter-warp at a time: lanes 8q .. 8q + 7 are one phase (128 bytes), which
    takes as many wavefronts as the most distinct 4-byte words one of the 32 banks must deliver. `wavefronts ==
    phases` means every such access ran conflict-free; `worst` (1..8) is the most wavefronts of one phase, at
    `worst_at` (file:line of the kernel's call). Lanes are matched by their k-th access at one source line (these
    accesses are no meeting point on the host), which is the warp's instruction in convergent code."""
    from . import get_backend

    be = get_backend("host")
    res: dict[str, dict[str, Any]] = {}
    for (path, _digest, _flavor), lib in getattr(be, "_libs", {}).items():
        stats = lib.bank_stats(reset, v4=True)
        prev = res.get(Path(path).stem)
        if prev is None or stats["phases"]:
            res[Path(path).stem] = stats
    return res


def create() -> HostBackend:
    return HostBackend()


# ---- sanitizer runs ------------------------------------------------------------------
@lru_cache(maxsize=None)
def _preload_for(argv: tuple[str, ...]) -> str | None:
    try:
        out = subprocess.run([*argv, "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    path = out.stdout.strip()
    return path if path and os.path.isabs(path) and os.path.exists(path) else None


def sanitizer_preload() -> str | None:
    """Path of the compiler's libasan.so (what LD_PRELOAD needs), or None if there is none."""
    from ..host.build import find_compiler

    try:
        cc = find_compiler()
    except BackendUnavailable:
        return None
    return _preload_for(cc.argv)


def sanitized_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child process that runs host launches under ASan + UBSan."""
    env = dict(os.environ if base is None else base)
    lib = sanitizer_preload()
    if lib is None:
        raise BackendUnavailable("host backend: the C++ compiler has no libasan.so; cannot run the sanitizer build")
    env["LD_PRELOAD"] = (lib + " " + env.get("LD_PRELOAD", "")).strip()
    env["PYKERN_HOST_SANITIZE"] = "1"
    # Python itself leaks by design; halt on the first real error so it cannot be missed.
    env.setdefault("ASAN_OPTIONS", "detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86")
    env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1:exitcode=87")
    return env


def run_sanitized(
    argv: Sequence[str] | None = None,
    *,
    code: str | None = None,
    pytest_args: Sequence[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run Python in a subprocess with the ASan runtime preloaded and PYKERN_HOST_SANITIZE=1.

    Give exactly one of: `code` (a snippet for `python -c`), `pytest_args` (run
    `python -m pytest ARGS`), or `argv` (arguments after `python`). Returns the completed
    process (output captured as text); an ASan report exits 86, a UBSan one 87.
    """
    given = [x is not None for x in (argv, code, pytest_args)]
    if sum(given) != 1:
        raise ArgumentError(
            f"run_sanitized: expected exactly one of argv, code, pytest_args, got {sum(given)}"
        )
    if code is not None:
        args = ["-c", code]
    elif pytest_args is not None:
        args = ["-m", "pytest", *pytest_args]
    else:
        args = list(argv or ())
    return subprocess.run(
        [sys.executable, *args], env=sanitized_env(env), capture_output=True, text=True, timeout=timeout, cwd=cwd
    )
