"""gpucheck steps 1 and 2: what the device is, and whether every kernel can launch on it.

Everything device-side goes through the driver seam (pykern.backends.driver.Driver), so the
tests run these steps against tests/fake_driver.py.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from ..backends.driver import arch_of

# --------------------------------------------------------------------------------------------- device


@dataclass
class DeviceInfo:
    gpu: bool
    reason: str = ""  # why there is no usable GPU
    name: str = ""
    driver_version: str = ""  # "12.4"
    cc: tuple[int, int] = (0, 0)
    arch: str = ""  # the device's sm_XX
    memory_bytes: int = 0
    attributes: dict[str, int] = field(default_factory=dict)
    nvrtc: str = ""  # "12.8", or why not
    nvrtc_archs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cc"] = list(self.cc)
        return d


def _version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def probe_device(driver_factory: Callable[[], Any], device: int = 0) -> tuple[DeviceInfo, Any]:
    """(what the device is, the driver with its primary context current); (DeviceInfo(gpu=False), None)
    with the reason when there is no driver or no device."""
    from ..bench import read_attributes
    from ..errors import PykernError

    info = DeviceInfo(gpu=False)
    try:
        from .. import compiler

        info.nvrtc = ".".join(map(str, compiler.nvrtc_version()))
        info.nvrtc_archs = list(compiler.supported_archs())
    except Exception as e:  # BackendUnavailable, or a broken NVRTC install
        info.nvrtc = f"unavailable ({e})"
    try:
        drv = driver_factory()
        drv.init()
        try:
            info.driver_version = _version(drv.driver_version())
        except Exception:  # an old driver seam without the query: not worth failing the run for
            pass
        n = drv.device_count()
        if n < 1:
            info.reason = "the CUDA driver reports no GPU"
            return info, None
        if device >= n:
            info.reason = f"device {device} requested, {n} present"
            return info, None
        info.cc = tuple(drv.compute_capability(device))  # type: ignore[assignment]
        info.arch = arch_of(info.cc)
        info.name = drv.device_name(device)
        info.memory_bytes = int(drv.total_memory(device))
        info.attributes = read_attributes(drv, device)
        drv.set_current(drv.primary_context(device))
    except PykernError as e:  # BackendUnavailable (no libcuda), DriverError
        info.reason = str(e)
        return info, None
    except Exception as e:  # a driver that loads but misbehaves is no GPU to check either
        info.reason = f"{type(e).__name__}: {e}"
        return info, None
    info.gpu = True
    return info, drv


def backend_status(driver_factory: Callable[[], Any] | None, device: int | None = None) -> list[dict[str, Any]]:
    """Usable or not (and why) for every backend; nvrtc is probed with `driver_factory` when given, and
    judged on `device` alone when given."""
    from .. import backends
    from ..backends.driver import CudaDriver
    from ..backends.nvrtc import NvrtcBackend

    rows = []
    for name in backends.NAMES:
        try:
            if name == "nvrtc" and (driver_factory is not None or device is not None):
                ok, why = NvrtcBackend(driver_factory=driver_factory or CudaDriver, device=device).available()
            else:
                be = backends.get_backend(name)
                ok, why = be.available()
                if ok and name == "numba" and getattr(be, "simulator", False):
                    why = "numba CUDA simulator (no GPU seen by numba)"
        except Exception as e:  # a backend module that fails to import is "unusable", with the reason
            ok, why = False, f"{type(e).__name__}: {e}"
        rows.append({"backend": name, "usable": bool(ok), "why": why})
    return rows


# --------------------------------------------------------------------------------------------- launches


@dataclass(frozen=True)
class LaunchShape:
    kernel: str
    threads: int
    dynamic_smem: int


class _Recorder:
    """A stand-in backend that records the geometry of each launch and runs nothing."""

    name = "host"

    def __init__(self) -> None:
        self.seen: dict[str, set[tuple[int, int]]] = {}

    def available(self) -> tuple[bool, str]:
        return True, ""

    def arch_features(self, device: int = 0) -> tuple[str, ...]:
        # as the host backend (PYKERN_HOST_ARCH), which the sm_90a difftest cases set around their run: their
        # launches (wgmma kernels: 384 threads, up to 225 KiB of shared memory: the d256 FP8 forward's and paged
        # prefill's) are recorded as well
        from ..backends.host import HostBackend

        return HostBackend.arch_features(self, device)  # type: ignore[arg-type]

    def launch(self, spec: Any, grid: Any, block: Any, args: Any, shared_mem: int, stream: Any, device: Any = None,
               pdl: bool = False, cluster: Any = None) -> None:  # device / pdl / cluster: as every backend takes them
        # (a PDL or cluster launch's per-block geometry is the same)
        self.seen.setdefault(spec.name, set()).add((block[0] * block[1] * block[2], int(shared_mem)))


@contextmanager
def _recording() -> Iterator[_Recorder]:
    from .. import backends

    rec = _Recorder()
    old = backends._instances.get("host")
    backends._instances["host"] = rec  # type: ignore[assignment]
    try:
        yield rec
    finally:
        if old is None:
            backends._instances.pop("host", None)
        else:
            backends._instances["host"] = old


def recorded_launches(cases: Sequence[Any] | None = None) -> tuple[dict[str, set[tuple[int, int]]], list[str]]:
    """kernel -> {(threads per block, dynamic shared bytes)} that the ops launch in the difftest cases.

    The cases run against a recording backend (no kernel executes), so this costs a second and
    shows exactly the block sizes and shared memory the ops choose, with the ops' own geometry code.
    Returns (launches, notes): a case whose op stops early (it read a garbage output) is noted.
    """
    from ..difftest import runner

    if cases is None:
        cases = runner.collect_cases(0)
    notes = []
    with _recording() as rec:
        for case in cases:
            try:
                case.run("host")
            except Exception as e:  # outputs are uninitialised here; what was launched before counts
                notes.append(f"{case.id}: stopped after {type(e).__name__}: {str(e)[:120]}")
    return rec.seen, notes


# --------------------------------------------------------------------------------------------- resources

def launch_bounds(source_path: str | Path) -> dict[str, int]:
    """kernel -> max threads per block from its `__launch_bounds__` (literal, macro or expression:
    the registry resolves them); kernels without one are absent."""
    from .. import registry

    return {s.name: s.max_threads for s in registry.parse_file(Path(source_path)) if s.max_threads is not None}


@dataclass
class KernelResources:
    kernel: str
    registers: int | None
    static_smem: int
    max_threads: int  # the kernel's own limit (launch bounds, or what the driver says)
    spill_bytes: int = 0
    origin: str = ""  # where the module came from: compiled / cache / bundle / driver


def kernel_resources(arch: str, jobs: int = 0) -> tuple[dict[str, KernelResources], list[str]]:
    """Per-kernel resources for `arch`: compile (in parallel, through pykern.precompile) unless a
    PYKERN_CUBIN_DIR bundle or the cache already has them. Returns (resources, errors)."""
    import contextlib
    import io
    import os

    from .. import cache, precompile, registry

    errors: list[str] = []
    if cache.bundle_dir() is None:
        buf_out, buf_err = io.StringIO(), io.StringIO()
        argv = ["--arch", arch, "--json", "--jobs", str(jobs or os.cpu_count() or 1)]
        with contextlib.redirect_stdout(buf_out), contextlib.redirect_stderr(buf_err):
            rc = precompile.main(argv)
        if rc != 0:
            errors.append(f"precompile --arch {arch} failed:\n{buf_err.getvalue()[-3000:]}")
    out: dict[str, KernelResources] = {}
    for src in registry.source_files():
        try:
            mod = cache.get_module(src, arch, compatible=True)
        except Exception as e:  # CompileError, CacheMiss with PYKERN_DISABLE_JIT=1, ...
            errors.append(f"{src.name} for {arch}: {type(e).__name__}: {e}")
            continue
        bounds = launch_bounds(src)
        for k in mod.kernels:
            res = mod.resources.get(k)
            out[k] = KernelResources(
                kernel=k,
                registers=None if res is None else res.registers,
                static_smem=0 if res is None else res.shared_bytes,
                max_threads=bounds.get(k, 1024),
                spill_bytes=0 if res is None else res.spill_bytes,
                origin=mod.origin,
            )
    return out, errors


def driver_resources(drv: Any, arch: str, resources: dict[str, KernelResources]) -> list[str]:
    """Replace compiler figures by what the driver says about the loaded cubin (registers, static
    shared memory, max threads per block: the last includes the register limit). Errors are returned."""
    from .. import cache, registry

    errors = []
    for src in registry.source_files():
        try:
            mod = cache.get_module(src, arch, compatible=True)
            module = drv.module_load_data(mod.image)
        except Exception as e:
            errors.append(f"loading {src.name} for {arch} on the device: {type(e).__name__}: {e}")
            continue
        for k in mod.kernels:
            try:
                func = drv.module_get_function(module, k)
                regs = drv.func_attribute(func, "NUM_REGS")
                smem = drv.func_attribute(func, "SHARED_SIZE_BYTES")
                mt = drv.func_attribute(func, "MAX_THREADS_PER_BLOCK")
            except Exception as e:
                errors.append(f"{k}: function attributes: {type(e).__name__}: {e}")
                continue
            r = resources.get(k)
            spill = r.spill_bytes if r else 0
            resources[k] = KernelResources(k, regs, smem, mt, spill, "driver")
    return errors


# --------------------------------------------------------------------------------------------- limits


def regs_per_block(registers: int, threads: int, warp: int = 32, unit: int = 256) -> int:
    """Registers a block holds: allocated per warp, in units of 256 (sm_50 .. sm_120)."""
    warps = -(-threads // warp)
    per_warp = -(-registers * warp // unit) * unit
    return warps * per_warp


def blocks_per_sm(attrs: Mapping[str, int], threads: int, registers: int | None, smem: int) -> int:
    """Theoretical resident blocks per SM (0: the block cannot run at all)."""
    warp = attrs.get("WARP_SIZE", 32)
    limits = [attrs.get("MAX_BLOCKS_PER_MULTIPROCESSOR", 32)]
    tpm = attrs.get("MAX_THREADS_PER_MULTIPROCESSOR")
    if tpm:
        limits.append(tpm // (-(-threads // warp) * warp))
    rpm = attrs.get("MAX_REGISTERS_PER_MULTIPROCESSOR")
    if rpm and registers:
        limits.append(rpm // regs_per_block(registers, threads, warp))
    spm = attrs.get("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR")
    reserved = attrs.get("RESERVED_SHARED_MEMORY_PER_BLOCK", 0)
    if spm and (smem + reserved):
        limits.append(spm // (smem + reserved))
    return max(0, min(limits))


def launch_problems(attrs: Mapping[str, int], res: KernelResources, threads: int, dyn_smem: int) -> list[str]:
    """Why one launch (threads per block, dynamic shared bytes) of a kernel cannot run on this device."""
    out = []
    dev_threads = attrs.get("MAX_THREADS_PER_BLOCK", 1024)
    if threads > dev_threads:
        out.append(f"{threads} threads per block > device limit {dev_threads}")
    if threads > res.max_threads:
        out.append(f"{threads} threads per block > the kernel's limit {res.max_threads} (launch bounds / registers)")
    if res.registers:
        need = regs_per_block(res.registers, threads, attrs.get("WARP_SIZE", 32))
        lims = [v for v in (attrs.get("MAX_REGISTERS_PER_BLOCK"), attrs.get("MAX_REGISTERS_PER_MULTIPROCESSOR")) if v]
        have = min(lims) if lims else 0
        if have and need > have:
            out.append(f"{res.registers} registers x {threads} threads = {need} registers per block "
                       f"(per-warp allocation) > device limit {have}")
    smem = res.static_smem + dyn_smem
    optin = attrs.get("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN") or attrs.get("MAX_SHARED_MEMORY_PER_BLOCK")
    if optin and smem > optin:
        out.append(f"{res.static_smem} static + {dyn_smem} dynamic = {smem} bytes of shared memory per block "
                   f"> device limit {optin}")
    return out


def check_limits(
    attrs: Mapping[str, int],
    resources: Mapping[str, KernelResources],
    launches: Mapping[str, set[tuple[int, int]]],
    kernels: Sequence[str],
) -> list[dict[str, Any]]:
    """One row per kernel: resources, the launches seen, the lowest occupancy and every problem."""
    rows = []
    for k in sorted(kernels):
        res = resources.get(k)
        seen = sorted(launches.get(k, ()))
        row: dict[str, Any] = {"kernel": k, "registers": None, "static_smem": None, "max_threads": None,
                               "spill_bytes": None, "origin": "", "launches": [list(s) for s in seen],
                               "min_blocks_per_sm": None, "problems": [], "status": "ok"}
        if res is None:
            row["status"] = "FAIL"
            row["problems"].append("no compiled module for this kernel")
            rows.append(row)
            continue
        row.update(registers=res.registers, static_smem=res.static_smem, max_threads=res.max_threads,
                   spill_bytes=res.spill_bytes, origin=res.origin)
        if not seen:
            # Never launched by a difftest case: at least its static shared memory must fit.
            seen_check = [(min(res.max_threads, attrs.get("MAX_THREADS_PER_BLOCK", 1024)), 0)]
            row["note"] = "no launch recorded; checked at its max block size with no dynamic shared memory"
        else:
            seen_check = seen
        occ = []
        for threads, dyn in seen_check:
            for p in launch_problems(attrs, res, threads, dyn):
                if p not in row["problems"]:
                    row["problems"].append(p)
            occ.append(blocks_per_sm(attrs, threads, res.registers, res.static_smem + dyn))
        row["min_blocks_per_sm"] = min(occ) if occ else None
        if row["problems"]:
            row["status"] = "FAIL"
        rows.append(row)
    return rows
