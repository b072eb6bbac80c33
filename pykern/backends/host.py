"""The host backend: the kernels_cu/*.cu text compiled with the system C++ compiler and run on the CPU.

Each `.cu` file becomes one shared library (see `pykern.host.build`) holding every kernel
of the file plus the fiber runtime; a launch runs the grid's blocks one after another,
each block's threads as fibers, in the order `PYKERN_HOST_SCHEDULE` names.

`PYKERN_HOST_SANITIZE=1` builds with AddressSanitizer + UBSan and copies every array into
an exactly-sized heap buffer for the launch, so an out-of-bounds access is reported. The
ASan runtime must be loaded first: use `run_sanitized` (a subprocess with LD_PRELOAD).
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
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
        from ..host.build import checked_build, fma_enabled

        sanitize = sanitize_enabled() if sanitize is None else sanitize
        # what changes the binary
        flavor = (sanitize, fma_enabled(), checked_build() and not sanitize, gpu_conv.enabled())
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
        zones = _RedZones([(a.ctypes.data, a.nbytes) for p, a in zip(spec.params, args) if p.is_pointer
                           and isinstance(a, np.ndarray)])
        if not sanitize:
            # Writable arrays first: a const parameter given the same array must see the copy.
            for i, (p, a) in enumerate(zip(spec.params, args)):
                if p.is_pointer and not p.is_const and isinstance(a, np.ndarray) and a.flags.c_contiguous:
                    zones.guard(i, p, a, a.ctypes.data)
        try:
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
                    addr = a.ctypes.data
                    if not sanitize:
                        addr = zones.by_addr.get((addr, a.nbytes), addr)
                    elif sanitize:
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
                stack_bytes(sanitize), watchdog_ms(), 0, limit,
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
            err = ctypes.create_string_buffer(4096)
            rc = fn(ctypes.byref(cfg), argv, err, len(err))
            if rc != 0:
                raise KernelExecutionError(_resolve_pcs(err.value.decode("utf-8", "replace"), lib.path))
            zones.check_and_copy_back(spec.name)
            for buf, a, nbytes, write_back, _ in copies:
                if write_back and nbytes:
                    # Only the bytes the kernel changed: two outputs may view overlapping memory (the K and V
                    # views of one combined KV cache); a whole copy-back of one would undo the other's writes.
                    new = np.frombuffer(ctypes.string_at(buf, nbytes), np.uint8)
                    changed = new != before[buf]
                    a.reshape(-1).view(np.uint8)[changed] = new[changed]
        finally:
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
    """Racecheck names code by offsets in the library (@@pc:HEX@@): turn them into .cu file:line."""
    import re

    offs = re.findall(r"@@pc:([0-9a-f]+)@@", msg)
    if not offs:
        return msg
    where: dict[str, str] = {}
    try:
        out = subprocess.run(["addr2line", "-e", str(lib), *[f"0x{o}" for o in offs]], capture_output=True,
                             text=True, timeout=30).stdout.split("\n")
        for o, line in zip(offs, out):
            where[o] = line.strip() if line.strip() and not line.startswith("??") else f"library offset 0x{o}"
    except (OSError, subprocess.SubprocessError):
        pass
    return re.sub(r"@@pc:([0-9a-f]+)@@", lambda m: where.get(m.group(1), f"library offset 0x{m.group(1)}"), msg)


_RZ = 256  # red zone bytes each side; GPU allocations are 256-byte aligned too
_RZ_PATTERN = bytes([0xFF, 0xFF, 0xBF, 0xFF])  # a NaN as float: an out-of-bounds read shows too


class _RedZones:
    """Writable array arguments run in a copy with red zones on both sides, checked after the launch.

    An out-of-bounds write then is a KernelExecutionError naming the kernel, the argument and
    the byte offsets, on every launch (the sanitizer build also names the thread and line).
    Arguments whose memory overlaps another argument's (views of one buffer) run in place:
    copying them would break the aliasing the kernel may rely on.
    """

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        self.ranges = ranges
        self.zones: list[tuple[int, Any, Any, Any]] = []  # (arg index, param, user array, padded copy)
        self.by_addr: dict[tuple[int, int], int] = {}

    def guard(self, i: int, p: Any, a: Any, addr: int) -> int:
        import numpy as np

        key = (addr, a.nbytes)
        if key in self.by_addr:  # the same array passed twice (in-place ops): one copy
            return self.by_addr[key]
        lo, hi = addr, addr + a.nbytes
        if any(r != key and r[0] < hi and lo < r[0] + r[1] for r in self.ranges):
            return addr
        n = a.nbytes
        buf = np.empty(n + 2 * _RZ + 256, np.uint8)
        off = (-buf.ctypes.data) % 256 + _RZ
        pat = np.frombuffer(_RZ_PATTERN * (_RZ // 4), np.uint8)
        buf[off - _RZ : off] = pat
        buf[off + n : off + n + _RZ] = pat
        if n:
            buf[off : off + n] = a.reshape(-1).view(np.uint8)
        self.zones.append((i, p, a, buf[off - _RZ : off + n + _RZ]))
        new = buf.ctypes.data + off
        self.by_addr[key] = new
        return new

    def check_and_copy_back(self, kernel: str) -> None:
        import numpy as np

        pat = np.frombuffer(_RZ_PATTERN * (_RZ // 4), np.uint8)
        for i, p, a, z in self.zones:
            n = a.nbytes
            for side, zone, base in (("past", z[_RZ + n :], n), ("before", z[:_RZ], -_RZ)):
                bad = np.flatnonzero(zone != pat)
                if bad.size:
                    first, last = int(bad[0]) + base, int(bad[-1]) + base + 1
                    raise KernelExecutionError(
                        f"kernel {kernel}: out-of-bounds write {side} argument {i} ({p.ctype} {p.name}, {n} bytes): "
                        f"bytes [{first}, {last}) relative to its start were written (a GPU may corrupt other "
                        "data or fault; PYKERN_HOST_SANITIZE=1 names the thread and line)"
                    )
            if n:
                a.reshape(-1).view(np.uint8)[:] = z[_RZ : _RZ + n]


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
