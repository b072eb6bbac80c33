"""Carry the peer libraries (FA4's Hopper path, QuACK, FlashInfer, Liger) to a GPU machine that has no network.

The GPU machine has torch, Triton, cuDNN (through SDPA) and nvcc, but none of FA4 (`flash-attn-4`, CuTe DSL),
QuACK (`quack-kernels`, CuTe DSL), FlashInfer (`flashinfer-python`, JIT-built with nvcc) or Liger
(`liger-kernel`, Triton). Each call to that machine carries at most 64 MiB with the working tree, and the CuTe
DSL's CUDA 13 libraries alone are a 92 MB wheel, so the peers travel in two parts on one warm machine:

  part 1: the CuTe DSL's MLIR extension for CUDA 13 (193 MB unpacked, the bulk of the 92 MB
          `nvidia-cutlass-dsl-libs-cu13` wheel), tarred with zstd -19 --long=27;
  part 2: everything else: the rest of that wheel, the small wheels, and FlashInfer stripped to what the JIT
          modules we time need
          (batch decode, batch prefill FA2 / FA3, MLA, sampling, page, cascade): its Python files, and of its
          sources and vendored headers (csrc, include, CUTLASS, CCCL, spdlog) only the include closure of
          those modules' sources.

On this machine (needs the network to the package index):

    python tools/peers.py fetch          # pinned wheels into .peers/wheels (target: CPython 3.12, x86-64)
    python tools/peers.py pack           # .carry/peers1 and .carry/peers2, each checked against the limit

On the GPU machine, one call each, the second right after the first (the machine stays warm 30 s; ignored
folders stay between calls while it is warm):

    python3 tools/peers.py install --part 1      # carry [".carry/peers1"]: unpacks into .peers/site
    python3 tools/peers.py install --part 2 && PYTHONPATH=$PWD/.peers/site python3 tools/measure_gpu.py ...
                                                 # carry [".carry/peers2"]

`python3 tools/peers.py check` there imports each peer and prints its version. FlashInfer builds its JIT modules
with that machine's nvcc on first use (minutes a module): `python3 tools/peers.py build --groups decode,sampling`
builds the ones a run needs first, so that no measurement stage spends its limit compiling.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".peers" / "wheels"
LOCAL = ROOT / ".peers" / "local"      # wheels for this machine's interpreter (only to compute FlashInfer's closure)
SITE = ROOT / ".peers" / "site"
CARRY = ROOT / ".carry"
LIMIT = 64 * 2**20                      # what one call carries, working tree included

# Pinned: what the measured reports name. The GPU image already holds torch, einops, requests, click, tabulate,
# ninja, nvidia-ml-py, cuda-bindings, jinja2, packaging and tqdm.
PINS = [
    "flash-attn-4==4.0.0b36",
    "quack-kernels==0.6.5",
    "nvidia-cutlass-dsl==4.8.1",
    "nvidia-cutlass-dsl-libs-base==4.8.1",
    "nvidia-cutlass-dsl-libs-cu13==4.8.1",
    "apache-tvm-ffi==0.1.15.post2",
    "torch-c-dlpack-ext==0.1.5",
    "flashinfer-python==0.7.2.post1",
    "liger-kernel==0.8.5",        # Triton kernels: the image has Triton but not Liger
]
# FlashInfer's import needs these on this machine too (the GPU image has requests and its dependencies)
LOCAL_PINS = ["apache-tvm-ffi==0.1.15.post2", "torch-c-dlpack-ext==0.1.5", "requests==2.34.2", "urllib3==2.8.0",
              "certifi==2026.10.19.post1", "idna", "click", "tabulate", "nvidia-ml-py", "einops"]
BIG = "nvidia_cutlass_dsl_libs_cu13"
FLASHINFER = "flashinfer_python"
PLATFORMS = ["manylinux_2_" + n + "_x86_64" for n in ("17", "24", "27", "28", "31", "34", "35")] + [
    "manylinux2014_x86_64", "manylinux1_x86_64"]


def log(msg: str) -> None:
    print(msg, flush=True)


def fetch(args: argparse.Namespace) -> None:
    WHEELS.mkdir(parents=True, exist_ok=True)
    LOCAL.mkdir(parents=True, exist_ok=True)
    tags = [a for p in PLATFORMS for a in ("--platform", p)]
    for pin in PINS:
        log(f"fetch {pin}")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *tags, "-d", str(WHEELS), pin],
                       check=True)
    for pin in LOCAL_PINS:
        log(f"fetch {pin} (this interpreter)")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "-d", str(LOCAL), pin], check=True)


def _wheel(prefix: str, where: Path = WHEELS) -> Path:
    found = sorted(where.glob(prefix + "-*.whl"))
    if not found:
        raise SystemExit(f"peers: no {prefix} wheel in {where}: run `python tools/peers.py fetch` first")
    return found[-1]


_INCLUDE = re.compile(rb'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def include_closure(sources: list[Path], include_dirs: list[Path]) -> set[Path]:
    """Every file reachable from `sources` through textual #include lines resolved against the source's own
    folder, then `include_dirs`. Textual: includes under any #if count too, so the closure is a superset of
    what a compile opens (system headers the dirs do not hold are skipped)."""
    seen: set[Path] = set()
    todo = [s.resolve() for s in sources]
    while todo:
        f = todo.pop()
        if f in seen or not f.is_file():
            continue
        seen.add(f)
        for name in _INCLUDE.findall(f.read_bytes()):
            rel = name.decode(errors="replace")
            for d in (f.parent, *include_dirs):
                cand = (d / rel).resolve()
                if cand.is_file():
                    todo.append(cand)
                    break
    return seen


def _flashinfer_specs(pkg_root: Path, workspace: Path) -> list[Path]:
    """Generate the JIT modules' sources (no compile) in `workspace`; return every source path and every file
    the generators read (the csrc templates they copy or render)."""
    code = r"""
import sys, warnings, torch
opened = set()
sys.addaudithook(lambda ev, a: opened.add(str(a[0])) if ev == "open" and isinstance(a[0], str) else None)
warnings.filterwarnings("ignore")
from flashinfer.jit.attention import modules as m
from flashinfer.jit import sampling, page, cascade
bf, f16, i32 = torch.bfloat16, torch.float16, torch.int32
specs = []
for dt in (bf, f16):
    for d in (64, 128, 256):
        specs.append(m.gen_batch_decode_module(dt, dt, dt, i32, d, d, 0, False, False))
        for backend in ("fa2", "fa3"):
            specs.append(m.gen_batch_prefill_module(backend, dt, dt, dt, i32, d, d, 0, False, False, False))
    specs.append(m.gen_batch_decode_module(dt, torch.float8_e4m3fn, dt, i32, 128, 128, 0, False, False))
    for backend in ("fa2", "fa3"):
        specs.append(m.gen_batch_mla_module(backend, dt, dt, dt, i32, 512, 64, False))
specs += [sampling.gen_sampling_module(), page.gen_page_module(), cascade.gen_cascade_module()]
for s in specs:
    for p in s.sources:
        print(p)
for p in sorted(opened):   # the csrc templates the generators copied or rendered
    print(p)
"""
    env = dict(os.environ, FLASHINFER_CUDA_ARCH_LIST="9.0a", FLASHINFER_WORKSPACE_BASE=str(workspace),
               PYTHONPATH=os.pathsep.join([str(pkg_root), str(workspace / "deps")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"peers: generating FlashInfer's JIT sources failed:\n{out.stderr[-3000:]}")
    return [Path(line) for line in out.stdout.split("\n") if line.strip()]


def strip_flashinfer(wheel: Path, tar_path: Path) -> tuple[int, int]:
    """Write FlashInfer's Python files and the include closure of the timed modules' sources to `tar_path`
    (zstd). Returns (files kept, files in the wheel)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_p = Path(tmp)
        pkg = tmp_p / "pkg"
        with zipfile.ZipFile(wheel) as z:
            z.extractall(pkg)
            n_all = len(z.namelist())
        deps = tmp_p / "ws" / "deps"
        deps.mkdir(parents=True)
        for w in LOCAL.glob("*.whl"):
            with zipfile.ZipFile(w) as z:
                z.extractall(deps)
        sources = _flashinfer_specs(pkg, tmp_p / "ws")
        data = pkg / "flashinfer" / "data"
        inc = [data / "csrc", data / "include", data / "cutlass" / "include", data / "cutlass" / "tools" / "util" /
               "include", data / "spdlog" / "include", data / "cccl" / "cub", data / "cccl" / "libcudacxx" /
               "include", data / "cccl" / "thrust", deps / "tvm_ffi" / "include"]
        # the generated sources are copied or rendered from csrc templates on the GPU machine too: the templates
        # (read by the generators) are in `sources`, and csrc's top-level headers are kept whole
        keep = include_closure(sources, inc)
        keep |= {p for p in data.glob("csrc/*") if p.is_file() and p.suffix in (".h", ".cuh", ".inc", ".jinja")}
        keep = {p for p in keep if pkg.resolve() in p.parents}
        files = [p for p in pkg.rglob("*") if p.is_file() and (data not in p.parents or p.resolve() in keep)]
        tar_path.parent.mkdir(parents=True, exist_ok=True)
        plain = tar_path.with_suffix("")
        with tarfile.open(plain, "w") as t:
            for p in sorted(files):
                t.add(p, arcname=str(p.relative_to(pkg)))
        _zstd(plain, tar_path)
        return len(files), n_all


def _zstd(plain: Path, out: Path) -> None:
    subprocess.run(["zstd", "-q", "-f", "-19", "--long=27", "-T0", str(plain), "-o", str(out)], check=True)
    plain.unlink()


def _tree_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())


def pack(args: argparse.Namespace) -> None:
    p1, p2 = CARRY / "peers1", CARRY / "peers2"
    for p in (p1, p2):
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True)
    # part 1 is the CuTe DSL's MLIR extension alone (the largest file); the rest of its wheel rides in part 2
    big = _wheel(BIG)
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(big) as z:
        z.extractall(tmp + "/x")
        names = [n for n in z.namelist() if not n.endswith("/") and "/stubs/aarch64" not in n]  # x86-64 only
        alone = [n for n in names if "/_cutlass_ir." in n]
        for part, members, tar_name in ((p1, alone, "cutlass_dsl_ir_cu13.tar"),
                                        (p2, [n for n in names if n not in alone], "cutlass_dsl_libs_cu13.tar")):
            plain = Path(tmp) / tar_name
            with tarfile.open(plain, "w") as t:
                for name in members:
                    t.add(f"{tmp}/x/{name}", arcname=name)
            _zstd(plain, part / (tar_name + ".zst"))
    kept, total = strip_flashinfer(_wheel(FLASHINFER), p2 / "flashinfer.tar.zst")
    log(f"flashinfer: kept {kept} of {total} files")
    for pin in PINS:
        name = pin.split("==")[0].replace("-", "_")
        if name in (BIG, FLASHINFER):
            continue
        shutil.copy2(_wheel(name), p2)
    tree = _tree_bytes()
    ok = True
    for p in (p1, p2):
        size = sum(f.stat().st_size for f in p.iterdir())
        fits = size + tree <= LIMIT
        ok &= fits
        log(f"{p.relative_to(ROOT)}: {size / 2**20:.1f} MiB + working tree {tree / 2**20:.1f} MiB "
            f"{'<=' if fits else '>'} {LIMIT / 2**20:.0f} MiB")
    if not ok:
        raise SystemExit("peers: a part is over the carry limit")


def install(args: argparse.Namespace) -> None:
    part = CARRY / f"peers{args.part}"
    if not part.is_dir():
        raise SystemExit(f"peers: {part} is missing: name it in the call's carry")
    SITE.mkdir(parents=True, exist_ok=True)
    for tz in sorted(part.glob("*.tar.zst")):
        log(f"unpack {tz.name}")
        z = subprocess.Popen(["zstd", "-d", "-q", "--long=27", "-c", str(tz)], stdout=subprocess.PIPE)
        with tarfile.open(fileobj=z.stdout, mode="r|") as t:
            t.extractall(SITE)
        if z.wait() != 0:
            raise SystemExit(f"peers: zstd failed on {tz}")
    wheels = sorted(str(w) for w in part.glob("*.whl"))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels], check=True)
    log(f"installed part {args.part} into {SITE}")


# FlashInfer's JIT modules that tools/measure_gpu.py uses, by group (bf16; head_dim 128 unless said)
BUILD_GROUPS = ("decode", "decode_tc", "prefill", "sampling", "mla")


def build(args: argparse.Namespace) -> None:
    """On the GPU machine: build FlashInfer's JIT modules ahead of the timed runs (nvcc, all cores), so that no
    measurement stage spends its time limit compiling. Groups: decode (FA2 decode, bf16 and e4m3 KV), decode_tc
    (the prefill module FlashInfer's tensor-core decode uses), prefill (FA3 prefill, d64 / d128 / d256),
    sampling, mla (FA3 MLA, 512 + 64)."""
    code = r"""
import sys, time, torch
from flashinfer.jit.attention import modules as m
from flashinfer.jit import sampling
bf, i32 = torch.bfloat16, torch.int32
specs = []
for g in sys.argv[1].split(","):
    if g == "decode":
        specs += [m.gen_batch_decode_module(bf, kv, bf, i32, 128, 128, 0, False, False)
                  for kv in (bf, torch.float8_e4m3fn)]
    elif g == "decode_tc":
        specs.append(m.gen_batch_prefill_module("fa2", bf, bf, bf, i32, 128, 128, 0, False, False, False))
    elif g == "prefill":
        specs += [m.gen_batch_prefill_module("fa3", bf, bf, bf, i32, d, d, 0, False, False, False) for d in (64, 128, 256)]
    elif g == "sampling":
        specs.append(sampling.gen_sampling_module())
    elif g == "mla":
        specs.append(m.gen_batch_mla_module("fa3", bf, bf, bf, i32, 512, 64, False))
for i, s in enumerate(specs):
    t = time.time()
    s.build_and_load()
    print(f"built {i + 1}/{len(specs)} {s.name} in {time.time() - t:.0f} s", flush=True)
"""
    bad = [g for g in args.groups.split(",") if g not in BUILD_GROUPS]
    if bad:
        raise SystemExit(f"peers: --groups: expected names from {', '.join(BUILD_GROUPS)}, got {', '.join(bad)}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]),
               FLASHINFER_CUDA_ARCH_LIST=os.environ.get("FLASHINFER_CUDA_ARCH_LIST", "9.0a"),
               MAX_JOBS=os.environ.get("MAX_JOBS", str(os.cpu_count() or 1)))
    raise SystemExit(subprocess.run([sys.executable, "-c", code, args.groups], env=env).returncode)


def check(args: argparse.Namespace) -> None:
    code = ("import importlib\n"
            "for m in ('cutlass', 'flash_attn.cute', 'quack', 'flashinfer', 'liger_kernel'):\n"
            "    try:\n"
            "        mod = importlib.import_module(m)\n"
            "        print(m, getattr(mod, '__version__', '?'))\n"
            "    except Exception as e:\n"
            "        print(m, 'FAILED', type(e).__name__, str(e)[:200])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code], env=env, check=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/peers.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch", help="download the pinned wheels into .peers/wheels (network)")
    sub.add_parser("pack", help="write .carry/peers1 and .carry/peers2 and check each against the carry limit")
    p = sub.add_parser("install", help="on the GPU machine: unpack one carried part into .peers/site")
    p.add_argument("--part", type=int, choices=(1, 2), required=True)
    sub.add_parser("check", help="import each peer from .peers/site and print its version")
    p = sub.add_parser("build", help="on the GPU machine: build FlashInfer's JIT modules before the timed runs")
    p.add_argument("--groups", default=",".join(BUILD_GROUPS),
                   help=f"comma-separated, from {', '.join(BUILD_GROUPS)} (default: all; minutes each)")
    args = ap.parse_args(argv)
    {"fetch": fetch, "pack": pack, "install": install, "check": check, "build": build}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
