"""GPU timing with CUDA events and the device's peak figures, for `pykern.gpucheck` and tools/bench_*.py.

Timing goes through the driver seam (`pykern.backends.driver.Driver`: event_create / event_record /
event_elapsed_ms), so it is tested against the fake driver here and needs no torch on the GPU.

Peaks are computed from the device's own attributes:

* memory bandwidth (bytes/s) = MEMORY_CLOCK_RATE (kHz) * 1e3 * GLOBAL_MEMORY_BUS_WIDTH (bits) * 2 / 8
  (double data rate: two transfers per clock; 8 bits per byte). H100 SXM reports 2 619 000 kHz and
  5120 bits: 2.619e9 * 5120 * 2 / 8 = 3.352e12 B/s, the 3.35 TB/s of the datasheet.
* compute (FLOP/s) = MULTIPROCESSOR_COUNT * FLOP per SM per clock (`FLOPS_PER_SM_CLOCK`, by compute
  capability) * clock. The clock is CLOCK_RATE (the maximum boost clock), except for parts in
  `KNOWN_PARTS` whose datasheet quotes tensor-core peaks at a lower clock (H100 SXM: 1830 MHz, giving
  132 * 4096 * 1.83e9 = 989.4 TFLOP/s dense bf16, while fp32 uses 1980 MHz: 66.9 TFLOP/s).

`import pykern.bench` imports neither torch nor cuda.bindings.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

from ..errors import ArgumentError

# Compute capability -> (dense bf16 tensor-core FLOP per SM per clock with fp32 accumulation,
# fp32 FMA FLOP per SM per clock). None: no bf16 tensor cores (Turing has fp16 only).
# Sources: NVIDIA architecture whitepapers (A100: 312 TF at 108 SMs x 1410 MHz -> 2048;
# H100: 989.4 TF at 132 SMs x 1830 MHz -> 4096; Ada/GA10x workstation parts 1024, GeForce
# parts run fp32-accumulate at half that rate; B200 ~2.25 PF dense at 148 SMs -> 8192).
FLOPS_PER_SM_CLOCK: dict[tuple[int, int], tuple[int | None, int]] = {
    (7, 5): (None, 128),
    (8, 0): (2048, 128),
    (8, 6): (1024, 256),
    (8, 7): (1024, 256),
    (8, 9): (1024, 256),
    (9, 0): (4096, 256),
    (10, 0): (8192, 256),
    (10, 3): (8192, 256),
    (12, 0): (1024, 256),
}

# (compute capability, SM count) -> (part, tensor-core clock in MHz the datasheet peak uses).
KNOWN_PARTS: dict[tuple[int, int, int], tuple[str, int]] = {
    (8, 0, 108): ("A100", 1410),
    (9, 0, 132): ("H100 SXM / H200", 1830),
    (9, 0, 114): ("H100 PCIe", 1620),
}


def peak_bandwidth(memory_clock_khz: int, bus_width_bits: int) -> float:
    """Peak DRAM bandwidth in bytes/s: clock (kHz) * 1e3 * bus width (bits) * 2 (DDR) / 8."""
    if memory_clock_khz <= 0 or bus_width_bits <= 0:
        raise ArgumentError(
            f"memory_clock_khz, bus_width_bits: expected positive values, got {memory_clock_khz}, {bus_width_bits}"
        )
    return memory_clock_khz * 1e3 * bus_width_bits * 2 / 8


@dataclass(frozen=True)
class DevicePeaks:
    """What 100 % means for this device; None where the table has no entry for its compute capability."""

    bandwidth: float | None  # bytes/s
    bf16_tensor: float | None  # FLOP/s, dense
    fp32: float | None  # FLOP/s, FMA = 2 FLOP
    part: str = ""
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def device_peaks(attrs: Mapping[str, int]) -> DevicePeaks:
    """Peaks from device attributes (short names, see pykern.backends.driver.DEVICE_ATTRIBUTES)."""
    bw = None
    if attrs.get("MEMORY_CLOCK_RATE", 0) > 0 and attrs.get("GLOBAL_MEMORY_BUS_WIDTH", 0) > 0:
        bw = peak_bandwidth(attrs["MEMORY_CLOCK_RATE"], attrs["GLOBAL_MEMORY_BUS_WIDTH"])
    cc = (int(attrs.get("COMPUTE_CAPABILITY_MAJOR", 0)), int(attrs.get("COMPUTE_CAPABILITY_MINOR", 0)))
    sms, clock_khz = int(attrs.get("MULTIPROCESSOR_COUNT", 0)), int(attrs.get("CLOCK_RATE", 0))
    rates = FLOPS_PER_SM_CLOCK.get(cc)
    if rates is None or sms <= 0 or clock_khz <= 0:
        why = f"no FLOP table entry for compute capability {cc[0]}.{cc[1]}" if rates is None else "no SM count/clock"
        return DevicePeaks(bw, None, None, note=why)
    part, tensor_mhz = KNOWN_PARTS.get((*cc, sms), ("", 0))
    tensor_hz = tensor_mhz * 1e6 if tensor_mhz else clock_khz * 1e3
    bf16 = rates[0] * sms * tensor_hz if rates[0] else None
    fp32 = rates[1] * sms * clock_khz * 1e3
    note = (f"tensor peak at the datasheet clock {tensor_mhz} MHz" if tensor_mhz
            else f"peaks at the maximum clock {clock_khz // 1000} MHz (upper bound)")
    return DevicePeaks(bw, bf16, fp32, part, note)


def read_attributes(driver: Any, device: int = 0) -> dict[str, int]:
    """Every attribute in DEVICE_ATTRIBUTES the driver answers (an attribute it refuses is left out)."""
    from ..backends.driver import DEVICE_ATTRIBUTES

    out: dict[str, int] = {}
    for name in DEVICE_ATTRIBUTES:
        try:
            out[name] = int(driver.device_attribute(device, name))
        except Exception:  # an older driver without the attribute: the report says "-" for it
            continue
    return out


# ------------------------------------------------------------------------------------------------ timing
@dataclass
class Timing:
    """Per-call GPU times in milliseconds (one CUDA-event pair around each call)."""

    samples_ms: list[float] = field(default_factory=list)
    warmup: int = 0

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)

    @property
    def seconds(self) -> float:
        """The median, in seconds (what rates are computed from)."""
        return self.median_ms / 1e3

    def to_dict(self) -> dict[str, Any]:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "max_ms": self.max_ms,
                "repeats": len(self.samples_ms), "warmup": self.warmup}


# GPU cycles of the sleep enqueued ahead of each timed call (about 1 ms at 1.98 GHz): long enough that the GPU is
# still busy when the host has enqueued the start event, the call and the end event.
SLEEP_CYCLES = 2_000_000


class EventTimer:
    """Times a callable on the GPU: `warmup` untimed calls, then `repeats` calls each between two
    recorded events on `stream`; the median of the per-call times is the figure (robust to the
    odd preempted or clock-ramping call). Events are created once and reused.

    `busy`, when given, enqueues GPU work on `stream` (a sleep: `gpu_sleep()`) ahead of every start event. The
    GPU then is still running it while the host enqueues the start event, the call and the end event, so the
    events time the GPU work of the call alone. Without it, a call whose host side (Python, argument packing,
    launch) takes longer than the GPU needs to reach the start event has that host time inside its interval,
    which penalises Python-launched kernels against a framework's eager ops."""

    def __init__(self, driver: Any, stream: int = 0, busy: Callable[[], Any] | None = None) -> None:
        self.driver = driver
        self.stream = int(stream)
        self.busy = busy

    def time(self, fn: Callable[[], Any], warmup: int = 3, repeats: int = 20,
             before: Callable[[], Any] | None = None) -> Timing:
        """`before` (e.g. an L2 flush), then the timer's `busy` sleep, run on the stream ahead of every timed call,
        outside its event pair."""
        if repeats < 1:
            raise ArgumentError(f"repeats: expected >= 1, got {repeats}")
        if warmup < 0:
            raise ArgumentError(f"warmup: expected >= 0, got {warmup}")
        drv = self.driver
        for _ in range(warmup):
            fn()
        events = [(drv.event_create(), drv.event_create()) for _ in range(repeats)]
        try:
            for start, end in events:
                if before is not None:
                    before()
                if self.busy is not None:
                    self.busy()
                drv.event_record(start, self.stream)
                fn()
                drv.event_record(end, self.stream)
            drv.event_synchronize(events[-1][1])
            samples = [drv.event_elapsed_ms(s, e) for s, e in events]
        finally:
            for s, e in events:
                for ev in (s, e):
                    try:
                        drv.event_destroy(ev)
                    except Exception:  # a failed destroy must not hide the timing error
                        pass
        return Timing(samples, warmup)


def open_device(device: int = 0, driver_factory: Callable[[], Any] | None = None) -> Any:
    """A driver with the device's primary context current (the one torch, CuPy, numba and the nvrtc
    backend share), for timing. Raises BackendUnavailable without a GPU."""
    from ..backends.driver import CudaDriver
    from ..errors import BackendUnavailable

    drv = (driver_factory or CudaDriver)()
    drv.init()
    if drv.device_count() <= device:
        raise BackendUnavailable(f"no CUDA device {device}")
    drv.set_current(drv.primary_context(device))
    return drv


def gpu_sleep(cycles: int = SLEEP_CYCLES) -> Callable[[], Any] | None:
    """The `busy` call of EventTimer: torch.cuda._sleep(cycles) on torch's current stream, or None when torch
    with CUDA is not there (the timer then runs without it)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        sleep = torch.cuda._sleep
    except Exception:  # no torch, or a build without the private sleep: time without it
        return None
    return lambda: sleep(int(cycles))


def time_gpu(fn: Callable[[], Any], warmup: int = 3, repeats: int = 20, stream: int = 0,
             driver: Any = None) -> Timing:
    """One-call form of EventTimer for scripts (tools/bench_*.py --time), with the GPU kept busy while each
    call is enqueued when torch is there (the events are on `stream`: pass torch's current one)."""
    return EventTimer(driver if driver is not None else open_device(), stream, busy=gpu_sleep()).time(
        fn, warmup, repeats)


def gpu_peaks(driver: Any, device: int = 0) -> DevicePeaks:
    """The peaks of `device`, read through `driver` (for scripts: `gpu_peaks(open_device())`)."""
    attrs = read_attributes(driver, device)
    if "COMPUTE_CAPABILITY_MAJOR" not in attrs:
        cc = driver.compute_capability(device)
        attrs.update(COMPUTE_CAPABILITY_MAJOR=cc[0], COMPUTE_CAPABILITY_MINOR=cc[1])
    return device_peaks(attrs)


def pct_text(value: float, peak: float | None) -> str:
    """"42.1 % of peak" or "" when the peak is unknown (a table line's last column)."""
    p = percent(value, peak)
    return "" if p is None else f"{p:5.1f} % of peak"


def rate(amount: float, seconds: float) -> float:
    """amount per second (bytes -> B/s, FLOP -> FLOP/s); 0 for a zero time."""
    return amount / seconds if seconds > 0 else 0.0


def percent(value: float, peak: float | None) -> float | None:
    return None if not peak else 100.0 * value / peak


def attention_flops(batch: int, heads: int, n_q: int, n_k: int, head_dim: int, causal: bool,
                    head_dim_v: int | None = None) -> float:
    """Forward attention FLOP: 2 matmuls (QK^T, PV) of 2*n_q*n_k*d each; causal (n_q == n_k) halves it."""
    dv = head_dim if head_dim_v is None else head_dim_v
    flops = 2.0 * batch * heads * n_q * n_k * (head_dim + dv)
    return flops / 2 if causal else flops


__all__ = ["DevicePeaks", "EventTimer", "FLOPS_PER_SM_CLOCK", "KNOWN_PARTS", "SLEEP_CYCLES", "Timing",
           "attention_flops", "gpu_sleep", "device_peaks", "gpu_peaks", "open_device", "peak_bandwidth", "pct_text", "percent", "rate",
           "read_attributes", "time_gpu"]
