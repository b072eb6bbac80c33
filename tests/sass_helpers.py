"""The SASS tests' shared steps: tools/sass_report.py (and the other tools/ scripts) loaded once, a source compiled (NVRTC) and disassembled
(cuobjdump), a kernel's opcodes. Where this machine has no cuobjdump or no NVRTC the calling test is skipped with
the reason, not failed: the SASS checks need the CUDA toolkit's tools, the rest of the suite does not."""
from __future__ import annotations

import importlib.util
import re
import sys
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, TypeVar

import pytest

ROOT = Path(__file__).resolve().parent.parent
R = TypeVar("R")

# One instruction of a cuobjdump listing: its address comment, an optional predicate, the opcode with modifiers.
_OPCODE = re.compile(r"/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")


@lru_cache(maxsize=None)
def tool(name: str) -> Any:
    """tools/<name>.py as a module, loaded once (tools/ holds scripts, not a package on sys.path); registered in
    sys.modules as pk_tool_<name>, where dataclasses look their module up."""
    spec = importlib.util.spec_from_file_location(f"pk_tool_{name}", ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def report() -> Any:
    """tools/sass_report.py as a module."""
    return tool("sass_report")


def checked_report() -> Any:
    """report(), the calling test skipped where cuobjdump is missing."""
    sr = report()
    try:
        sr.find_cuobjdump()
    except sr.CuobjdumpUnavailable as e:
        pytest.skip(f"no cuobjdump: {e}")
    return sr


def guard(fn: Callable[[], R]) -> R:
    """fn() (a compile and disassembly through sass_report), skipped without cuobjdump or NVRTC."""
    checked_report()
    try:
        return fn()
    except Exception as e:  # no NVRTC in this environment
        if type(e).__name__ in ("CompileError", "NvrtcUnavailable") and "nvrtc" in str(e).lower():
            pytest.skip(f"NVRTC unavailable: {e}")
        raise


def nvrtc_module(src: Path | str, arch: str) -> Any:
    """src compiled by NVRTC for arch through the run's cache folder (tests/conftest.py): a CachedModule (image,
    resources, log; a compute_XX image is the PTX text).

    Not compiler.compile: a direct compile stores nothing, so each test that called it compiled a second time
    a (source, arch) that test_compiler's real-kernel compiles (and the other SASS tests) also build: up to
    190 CPU-seconds each (attention_fwd_sm90.cu for sm_90a; attention_bwd_sm90.cu 100, moe.cu for sm_80 34).
    The cache key hashes the source, its headers, the options and the NVRTC version, and an entry is only
    stored after compile() checked the layout, so a hit proves what a fresh compile would.
    No bundle (PYKERN_CUBIN_DIR): what is checked is what this NVRTC builds."""
    from pykern import cache

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cache.get_module(src, arch, use_bundle=False, jit=True)


def compile_sass(src: Path, arch: str) -> tuple[Any, str]:
    """src compiled by NVRTC for arch (nvrtc_module: through the run's cache) and disassembled: (module, SASS)."""
    from pykern.errors import CompileError

    sr = report()
    try:
        tool = sr.find_cuobjdump()
        mod = nvrtc_module(src, arch)
    except CompileError:  # the source does not compile: a failure, never a skip
        raise
    except Exception as e:  # no NVRTC / cuobjdump here
        pytest.skip(f"NVRTC or cuobjdump unavailable: {e}")
    return mod, sr.disassemble(mod.image, tool)


def source_sass(name: str, arch: str) -> str:
    """The SASS text of kernels_cu/<name>'s cached module for arch (pykern.cache, as a launch would build it)."""
    from pykern import cache
    from pykern.registry import source_files

    src = next(s for s in source_files() if s.name == name)
    return guard(lambda: report().disassemble(cache.get_module(src, arch).image))


def spills(mix: dict) -> list[tuple]:
    """(kernel, arch, spill stores, spill loads) of each instruction_mix row (with_resources) that spills or
    touches local memory (LDL / STL): an empty list when none does."""
    return [(k, a, v["spill_stores"], v["spill_loads"]) for k, per in mix.items() for a, v in per.items()
            if v.get("spill_stores") or v.get("spill_loads") or v["LDL"] or v["STL"]]


def assert_cp_async_16(source: str, arch: str) -> None:
    """kernels_cu/<source>'s SASS for arch copies global to shared memory with 16-byte cp.async (LDGSTS.128, the
    L1-bypassing form) and commits (LDGDEPBAR) and waits (DEPBAR) on the groups."""
    text = source_sass(source, arch)
    assert "LDGSTS.E.BYPASS.128" in text and "LDGDEPBAR" in text and "DEPBAR.LE SB0" in text


def kernel_ops(text: str, kernel: str) -> list[str]:
    """The opcodes (with modifiers) of one kernel's function in a SASS listing, in order."""
    body = text.split(f"Function : {kernel}\n", 1)[1].split("Function :", 1)[0]
    return _OPCODE.findall(body)


# libdevice's tanhf (the accurate one, no fast math) picks between a polynomial and 1 - 2 / (e^2x + 1) by
# comparing |x| with 0.6 (FSETP ... |Rn|, 0.60000002384185791016); tanh.approx lowers to MUFU.TANH.
_TANHF = re.compile(r"MUFU\.TANH|FSETP\.\S+\s.*\|R\d+\|(?:\.reuse)?, 0\.600000023841857")


def tanhf_lines(text: str, kernel: str) -> list[str]:
    """The instructions of one kernel's function in a SASS listing that show a tanhf (either lowering)."""
    body = text.split(f"Function : {kernel}\n", 1)[1].split("Function :", 1)[0]
    return [line.strip() for line in body.splitlines() if _TANHF.search(line)]
