"""Content-addressed disk cache of compiled kernels, the read-only bundle folder, and `python -m pykern.cache`.

Lookup order in `get_module`: the bundle (`PYKERN_CUBIN_DIR`), the cache folder (`PYKERN_CACHE_DIR`, else
`$XDG_CACHE_HOME/pykern`, else `~/.cache/pykern`), this process's in-memory store (used only when the
folder is not writable), then NVRTC — unless `PYKERN_DISABLE_JIT=1`, where a miss raises `CacheMiss`.
With `compatible=True` (what the nvrtc backend asks for) a plain `sm_XY` that misses everywhere is looked
up again as each older minor of the same major, newest first, before compiling (see `compatible_archs`).

One file per entry at `<root>/<key[:2]>/<key>.pkc`. An entry is a fixed header (magic, format version,
payload length, SHA-256 of the payload) and a payload (u32 length + JSON metadata, then the image).
Writers publish with a unique temp file in the same folder, fsync and one `os.replace`, so readers see
either no entry or a whole one, and racing writers of one key (identical bytes) need no lock.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import secrets
import struct
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from .errors import ArgumentError, BackendUnavailable, CacheMiss, KernelNotFound, PykernError
from .log import configure as _log_configure
from .sources import Source
from .sources import load as load_source

FORMAT_VERSION = 1
MAGIC = b"PYKERNC\0"
_HEADER = struct.Struct("<8sIQ32s")  # magic, format version, payload length, sha256(payload)
_META_LEN = struct.Struct("<I")
SUFFIX = ".pkc"
BUNDLE_MANIFEST = "manifest.json"
# NVRTC version slot of a bundle key: a bundle must load where no NVRTC is installed at all.
_BUNDLE_NVRTC = "bundle"

log = logging.getLogger("pykern")
_log_configure()


class CacheWarning(UserWarning):
    """The cache folder cannot be written; compiled kernels live in memory for this process only."""


@dataclass(frozen=True)
class CachedModule:
    arch: str
    kind: str  # "cubin" | "ptx"
    image: bytes
    resources: dict[str, Any]  # kernel name -> compiler.Resources (empty for PTX)
    hit: bool  # True unless this call ran NVRTC
    digest: str  # the cache key (SHA-256 hex)
    origin: str  # "bundle" | "cache" | "memory" | "compiled"; "bundle:sm_80" etc. for a compatible older minor
    kernels: tuple[str, ...] = ()
    options: tuple[str, ...] = ()  # the portable options (what the key hashed)
    nvrtc: str = ""
    log: str = ""
    path: Path | None = None  # the entry file, when there is one
    seconds: float = 0.0  # compile time (0 for a hit)
    meta: dict[str, Any] = field(default_factory=dict, repr=False)


# --------------------------------------------------------------------------- locations and env


def cache_dir() -> Path:
    env = os.environ.get("PYKERN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "pykern"


def bundle_dir() -> Path | None:
    env = os.environ.get("PYKERN_CUBIN_DIR")
    return Path(env).expanduser() if env else None


def jit_disabled() -> bool:
    return os.environ.get("PYKERN_DISABLE_JIT", "").strip().lower() not in ("", "0", "false", "no", "off")


def entry_path(root: Path, key: str) -> Path:
    return Path(root) / key[:2] / f"{key}{SUFFIX}"


# --------------------------------------------------------------------------- keys


def make_key(source: Source, portable_options: Sequence[str], nvrtc: str) -> str:
    """SHA-256 over format version, NVRTC version, options (arch and defines among them) and source+header bytes.

    Header *bytes* are hashed, never their absolute paths, so the same tree in another folder shares keys.
    """
    return _key(source.digest(), portable_options, nvrtc)


def _key(source_digest: str, portable_options: Sequence[str], nvrtc: str) -> str:
    doc = {
        "format": FORMAT_VERSION,
        "nvrtc": nvrtc,
        "options": list(portable_options),
        "source": source_digest,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _nvrtc_str() -> str:
    from .compiler import nvrtc_version

    return ".".join(map(str, nvrtc_version()))


def key_for(
    source_path: str | os.PathLike[str] | Source,
    arch: str | int,
    options: Sequence[str] = (),
    defines: Mapping[str, Any] | None = None,
    *,
    bundle: bool = False,
) -> str:
    """The cache key (or, with bundle=True, the NVRTC-independent bundle key) of one compile."""
    from .compiler import normalize_arch, portable_options

    src = source_path if isinstance(source_path, Source) else load_source(source_path)
    arch = normalize_arch(arch, check_supported=False)
    return make_key(src, portable_options(arch, options, defines), _BUNDLE_NVRTC if bundle else _nvrtc_str())


# --------------------------------------------------------------------------- entry encoding


def encode_entry(meta: Mapping[str, Any], image: bytes) -> bytes:
    m = json.dumps(meta, sort_keys=True).encode()
    payload = _META_LEN.pack(len(m)) + m + image
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest()) + payload


class CorruptEntry(PykernError):
    """A cache entry failed verification (internal: it is logged and rebuilt, never raised to users)."""


def decode_entry(data: bytes, key: str | None = None) -> tuple[dict[str, Any], bytes]:
    """(metadata, image) of a verified entry; CorruptEntry says what is wrong otherwise."""
    if len(data) < _HEADER.size:
        raise CorruptEntry(f"truncated: {len(data)} bytes, header needs {_HEADER.size}")
    magic, version, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptEntry(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptEntry(f"format version {version}, expected {FORMAT_VERSION}")
    payload = data[_HEADER.size:]
    if len(payload) != length:
        raise CorruptEntry(f"payload is {len(payload)} bytes, header says {length}")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptEntry("payload digest mismatch")
    (mlen,) = _META_LEN.unpack_from(payload)
    try:
        meta = json.loads(payload[_META_LEN.size:_META_LEN.size + mlen])
    except ValueError as e:
        raise CorruptEntry(f"bad metadata: {e}") from None
    if key is not None and meta.get("key") != key:
        # A verified file under the wrong name would otherwise load the wrong kernel.
        raise CorruptEntry(f"entry holds key {meta.get('key')!r}, expected {key!r}")
    return meta, payload[_META_LEN.size + mlen:]


def _to_module(meta: dict[str, Any], image: bytes, *, hit: bool, origin: str, path: Path | None,
               seconds: float = 0.0) -> CachedModule:
    from .compiler import Resources

    return CachedModule(
        arch=meta["arch"],
        kind=meta["kind"],
        image=image,
        resources={k: Resources.from_dict(v) for k, v in meta.get("resources", {}).items()},
        hit=hit,
        digest=meta["key"],
        origin=origin,
        kernels=tuple(meta.get("kernels", ())),
        options=tuple(meta.get("options", ())),
        nvrtc=meta.get("nvrtc", ""),
        log=meta.get("log", ""),
        path=path,
        seconds=seconds,
        meta=meta,
    )


# --------------------------------------------------------------------------- read / write

_logged_corrupt: set[str] = set()
_warned_unwritable = False
_memory: dict[str, tuple[dict[str, Any], bytes]] = {}


def _read(path: Path, key: str) -> tuple[dict[str, Any], bytes] | None:
    """A verified entry, or None when absent or corrupt (corruption is logged once per file)."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # absent, or the cache folder is not a folder at all
        return None
    except OSError as e:  # permissions, I/O error: not corruption, and not worth a rebuild message
        if str(path) not in _logged_corrupt:
            _logged_corrupt.add(str(path))
            log.warning("pykern cache: cannot read entry %s (%s: %s); compiling instead", path,
                        type(e).__name__, e.strerror or e)
        return None
    try:
        return decode_entry(data, key)
    except CorruptEntry as e:
        _log_corrupt(path, str(e))
        return None


def _log_corrupt(path: Path, why: str) -> None:
    if str(path) not in _logged_corrupt:
        _logged_corrupt.add(str(path))
        log.warning("pykern cache: entry %s is corrupt (%s); recompiling and replacing it", path, why)


def write_atomic(path: Path, data: bytes) -> None:
    """Publish data at path with one os.replace of a fsynced temp file from the same folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    try:  # make the rename itself durable; not every file system allows fsync on a folder
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _store(root: Path, key: str, meta: dict[str, Any], image: bytes) -> Path | None:
    global _warned_unwritable
    path = entry_path(root, key)
    try:
        write_atomic(path, encode_entry(meta, image))
        return path
    except OSError as e:
        _memory[key] = (meta, image)
        if not _warned_unwritable:
            _warned_unwritable = True
            warnings.warn(
                f"pykern: cache folder {root} is not writable ({type(e).__name__}: {e}); "
                "compiled kernels are kept in memory for this process only (set PYKERN_CACHE_DIR)",
                CacheWarning,
                stacklevel=3,
            )
        return None


def unwritable_reason(root: str | os.PathLike[str]) -> str:
    """Why entries cannot be saved under `root` ("" when they can): created if missing, then probed."""
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        with open(probe, "xb"):
            pass
        probe.unlink()
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return ""


# --------------------------------------------------------------------------- one compile per key across processes

LOCK_SUFFIX = ".lock"
# A lock this old is broken whoever holds it (a hung process, or one on another host sharing the folder).
LOCK_STALE_AGE = 600.0


def _lock_path(root: Path, key: str) -> Path:
    return Path(root) / key[:2] / f".{key}{LOCK_SUFFIX}"


def _lock_wait() -> float:
    """Seconds to wait for another process's compile of the same key (PYKERN_LOCK_TIMEOUT, default 300)."""
    try:
        return max(0.0, float(os.environ.get("PYKERN_LOCK_TIMEOUT", "300")))
    except ValueError:
        return 300.0


_HOST = None


def _hostname() -> str:
    global _HOST
    if _HOST is None:
        import socket

        _HOST = socket.gethostname()
    return _HOST


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return True
    return True


def _lock_stale(path: Path, max_age: float) -> str:
    """Why the lock at `path` is stale ("" when its owner may still be compiling)."""
    try:
        text = path.read_text()
        st = path.stat()
    except OSError:
        return ""  # gone meanwhile: the next O_EXCL attempt decides
    parts = text.split()
    if len(parts) >= 2 and parts[0].isdigit() and parts[1] == _hostname() and not _pid_alive(int(parts[0])):
        return f"its owner, process {parts[0]}, is gone"
    age = time.time() - st.st_mtime
    if age > max_age:
        return f"it is {age:.0f} s old"
    return ""


def _create_lock(path: Path, token: str) -> bool:
    """Create the lock file at `path` holding `token`; False when it exists already.

    The token is written to a temp file first and hard-linked into place, so the lock never exists
    without its owner's pid: a worker killed between an O_EXCL create and its write would leave an
    empty lock that nobody can attribute (and `remove_leftovers` could not clean). The temp file
    carries the pid in its name, like every temp file of the cache. File systems without hard links
    get the O_EXCL create."""
    tmp = path.parent / f"{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"  # path.name starts with "."
    try:
        with open(tmp, "x") as f:
            f.write(token)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(token)
        return True
    finally:
        try:
            tmp.unlink()
        except OSError:
            pass


class KeyLock:
    """A lock file per cache key, so that processes sharing a cache compile each key once.

    `acquire` returns True when this process owns the lock, False when it gave up waiting (the caller
    compiles anyway: the lock saves work, correctness comes from the atomic publish of entries). A lock
    whose owner died on this host, or older than the wait limit, is broken. `ready()` is polled while
    waiting and ends the wait early (the entry appeared).
    """

    def __init__(self, root: Path, key: str) -> None:
        self.path = _lock_path(root, key)
        self.owned = False
        self.token = ""

    def acquire(self, ready: Any = None, timeout: float | None = None) -> bool:
        timeout = _lock_wait() if timeout is None else timeout
        deadline = time.monotonic() + timeout
        delay = 0.02
        logged = False
        while True:
            token = f"{os.getpid()} {_hostname()} {time.time():.6f}\n"
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                created = _create_lock(self.path, token)
            except OSError:
                return False  # an unwritable cache: nothing to share, nothing to wait for
            if created:
                self.token = token
                self.owned = True
                return True
            why = _lock_stale(self.path, LOCK_STALE_AGE)
            if why:
                log.info("pykern cache: breaking stale lock %s (%s)", self.path, why)
                try:
                    self.path.unlink()
                except OSError:
                    pass
                continue
            if ready is not None and ready():
                return False
            if time.monotonic() >= deadline:
                log.warning("pykern cache: gave up waiting %.0f s for lock %s; compiling without it",
                            timeout, self.path)
                return False
            if not logged:
                log.debug("pykern cache: waiting for another process compiling %s", self.path.name)
                logged = True
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    def release(self) -> None:
        if self.owned:
            self.owned = False
            try:
                if self.path.read_text() == self.token:  # not a lock someone took over as stale
                    self.path.unlink()
            except OSError:
                pass


def remove_leftovers(root: str | os.PathLike[str], pids: Sequence[int]) -> int:
    """Delete the temp files and lock files that the (killed) processes `pids` left under `root`."""
    root = Path(root)
    if not root.is_dir() or not pids:
        return 0
    wanted = {str(p) for p in pids}
    n = 0
    for p in root.glob("??/.*.tmp"):
        parts = p.name.split(".")  # ".<name>.pkc.<pid>.<hex>.tmp"
        if len(parts) >= 3 and parts[-3] in wanted:
            try:
                p.unlink()
                n += 1
            except OSError:
                pass
    for p in root.glob(f"??/.*{LOCK_SUFFIX}"):
        try:
            owner = p.read_text().split()[0]
        except (OSError, IndexError):
            continue
        if owner in wanted:
            try:
                p.unlink()
                n += 1
            except OSError:
                pass
    return n


def _touch(path: Path) -> None:
    # The mtime is the LRU clock of `prune`; a read-only cache simply keeps its old order.
    try:
        os.utime(path)
    except OSError:
        pass


# --------------------------------------------------------------------------- the lookup


def _meta_from(compiled: Any, key: str, source: Source, nvrtc: str, portable: Sequence[str],
               seconds: float) -> dict[str, Any]:
    return {
        "key": key,
        "arch": compiled.arch,
        "kind": compiled.kind,
        "kernels": list(compiled.kernels),
        "resources": {k: r.to_dict() for k, r in compiled.resources.items()},
        "options": list(portable),
        "nvrtc": nvrtc,
        "source": source.path.name,
        "log": compiled.log,
        "compile_seconds": round(seconds, 4),
        "created": time.time(),
    }


def _check_kernel(mod: CachedModule, kernel: str | None, source: Source) -> CachedModule:
    if kernel is not None and kernel not in mod.kernels:
        raise KernelNotFound(
            f"kernel {kernel!r} is not in {source.path.name}; it defines {', '.join(mod.kernels) or '(none)'}"
        )
    return mod


# Compute capabilities that exist (PTX targets); a PTX for compute_XX runs on every GPU of XX or later.
KNOWN_COMPUTE = (50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 88, 89, 90, 100, 101, 103, 110, 120, 121)


def compatible_archs(arch: str | int) -> tuple[str, ...]:
    """The archs whose images run on a GPU of `arch`, best first.

    For a plain sm_XY: the cubins sm_XY, sm_XYa (arch-specific, runs on exactly XY), then sm_X(Y-1) ...
    sm_X0 (a cubin runs on later minors of its major, never across majors), then PTX compute_XY and every
    older compute_NN, newest first (the driver JIT-compiles PTX for any later GPU). For compute_XX: that
    PTX, then older ones. sm_XXa / sm_XXf: only themselves. Archs no GPU has cost a failed open, nothing more.
    """
    from .compiler import normalize_arch, parse_arch

    name = normalize_arch(arch, check_supported=False)
    kind, num, suffix = parse_arch(name)
    if kind == "sm" and suffix:
        return (name,)
    cubins: list[str] = []
    if kind == "sm":
        major, minor = divmod(num, 10)
        cubins = [name, f"{name}a", *(f"sm_{major * 10 + m}" for m in range(minor - 1, -1, -1))]
    ptx = [f"compute_{n}" for n in sorted({num, *(k for k in KNOWN_COMPUTE if k <= num)}, reverse=True)]
    return tuple(cubins + ptx)


_logged_ptx: set[tuple[str, str]] = set()


def get_module(
    source_path: str | os.PathLike[str] | Source,
    arch: str | int,
    options: Sequence[str] = (),
    kernel: str | None = None,
    defines: Mapping[str, Any] | None = None,
    *,
    cache_root: str | os.PathLike[str] | None = None,
    use_bundle: bool = True,
    jit: bool | None = None,
    compatible: bool = False,
) -> CachedModule:
    """The compiled module of one source for one arch: bundle, then cache folder, then NVRTC (and store).

    cache_root overrides the cache folder; use_bundle=False skips PYKERN_CUBIN_DIR; jit=False (default:
    not PYKERN_DISABLE_JIT) turns a miss into CacheMiss. `kernel` only names the wanted kernel in errors
    and is checked to be in the module. compatible=True means "a module that runs on a GPU of `arch`"
    (`compatible_archs`): when the exact arch is in neither the bundle nor the cache, a compatible cubin
    (sm_XYa, an older minor of the same major) is used before compiling; when no cubin can be had (JIT
    disabled, or NVRTC cannot target the GPU) the newest compatible PTX is loaded, logged once. Its origin
    then names that arch ("bundle:sm_80", "cache:compute_90"). Off by default, so that precompiling sm_86
    never settles for an sm_80 entry.
    """
    if jit is None:
        jit = not jit_disabled()
    from .compiler import compile as nvrtc_compile
    from .compiler import normalize_arch, portable_options

    src = source_path if isinstance(source_path, Source) else load_source(source_path)
    arch = normalize_arch(arch, check_supported=False)
    archs = compatible_archs(arch) if compatible else (arch,)
    # Cubins (and the exact arch) before compiling; PTX of an older arch only when nothing can compile.
    first = [a for a in archs if a == arch or not a.startswith("compute_")]
    fallback = [a for a in archs if a not in first]
    sdigest = src.digest()
    bundle = bundle_dir() if use_bundle else None
    root = Path(cache_root) if cache_root is not None else cache_dir()
    nvrtc: str | None = None
    no_nvrtc: BackendUnavailable | None = None

    def lookup(cands: Sequence[str]) -> CachedModule | None:
        # Each arch in every store before the next arch; within an arch the bundle, the cache folder,
        # then memory. NVRTC is loaded only once the cache folder is consulted, so a bundle hit works
        # where no NVRTC is installed.
        nonlocal nvrtc, no_nvrtc
        for cand in cands:
            portable = portable_options(cand, options, defines)
            suffix = "" if cand == arch else f":{cand}"
            if bundle is not None:
                bkey = _key(sdigest, portable, _BUNDLE_NVRTC)
                bpath = entry_path(bundle, bkey)
                got = _read(bpath, bkey)
                if got is not None:
                    log.debug("pykern cache: hit %s for %s in bundle %s", src.path.name, cand, bundle)
                    return _to_module(*got, hit=True, origin="bundle" + suffix, path=bpath)
            if nvrtc is None and no_nvrtc is None:
                try:
                    nvrtc = _nvrtc_str()
                except BackendUnavailable as e:
                    no_nvrtc = e
            if nvrtc is None:
                continue  # no cache key without the NVRTC version; the bundle may still serve another arch
            key = _key(sdigest, portable, nvrtc)
            path = entry_path(root, key)
            got = _read(path, key)
            if got is not None:
                _touch(path)
                log.debug("pykern cache: hit %s for %s in %s", src.path.name, cand, root)
                return _to_module(*got, hit=True, origin="cache" + suffix, path=path)
            if key in _memory:
                return _to_module(*_memory[key], hit=True, origin="memory" + suffix, path=None)
        return None

    mod = lookup(first)
    if mod is not None:
        return _check_kernel(mod, kernel, src)
    can_compile = jit and no_nvrtc is None
    if can_compile and fallback:
        try:
            normalize_arch(arch)  # can this NVRTC emit the GPU's own arch?
        except (ArgumentError, BackendUnavailable):
            can_compile = False
    if not can_compile and fallback:
        mod = lookup(fallback)
        if mod is not None:
            if (str(src.path), arch) not in _logged_ptx:
                _logged_ptx.add((str(src.path), arch))
                log.warning("pykern: no cubin of %s for this %s GPU%s; loading PTX %s (%s), which the CUDA "
                            "driver JIT-compiles. Precompile `--arch %s` to skip the JIT", src.path.name, arch,
                            " and JIT is disabled" if not jit else "", mod.arch, mod.origin.split(":")[0], arch)
            return _check_kernel(mod, kernel, src)

    if jit and no_nvrtc is not None:
        raise no_nvrtc
    if not jit:
        looked = [f"bundle {bundle}"] if bundle is not None else []
        if no_nvrtc is None:
            looked.append(f"cache {root}")
        what = f"kernel {kernel!r}" if kernel else f"the kernels of {src.path.name}"
        tried = f"arch {arch}" if len(archs) == 1 else f"arch {arch} (archs tried: {', '.join(archs)})"
        why = "" if no_nvrtc is None else f" (the cache folder needs the NVRTC version for its key: {no_nvrtc})"
        raise CacheMiss(
            f"PYKERN_DISABLE_JIT=1 and no compiled binary for {what} ({src.path.name}) for {tried}; "
            f"looked in {', '.join(looked) or '(nothing)'}{why}. Run `python -m pykern.precompile --arch {arch}` "
            "or unset PYKERN_DISABLE_JIT"
        )

    assert nvrtc is not None
    portable = portable_options(arch, options, defines)
    key = _key(sdigest, portable, nvrtc)
    path = entry_path(root, key)
    lock = KeyLock(root, key)
    # Another process compiling this key: wait for its entry instead of compiling it a second time.
    lock.acquire(ready=path.exists)
    try:
        got = _read(path, key)
        if got is not None:
            log.debug("pykern cache: hit %s for %s (compiled by another process meanwhile)", src.path.name, arch)
            return _check_kernel(_to_module(*got, hit=True, origin="cache", path=path), kernel, src)
        log.debug("pykern cache: miss %s for %s (key %s); compiling", src.path.name, arch, key[:12])
        t0 = time.perf_counter()
        compiled = nvrtc_compile(src, arch, options, defines)  # raises: a failed compile is never stored
        seconds = time.perf_counter() - t0
        log.info("pykern: compiled %s for %s in %.2f s", src.path, arch, seconds)
        meta = _meta_from(compiled, key, src, nvrtc, portable, seconds)
        stored = _store(root, key, meta, compiled.image)
    finally:
        lock.release()
    mod = _to_module(meta, compiled.image, hit=False, origin="compiled", path=stored, seconds=seconds)
    return _check_kernel(mod, kernel, src)


def export_to_bundle(mod: CachedModule, source: Source, out_dir: str | os.PathLike[str]) -> Path:
    """Write one module into a bundle folder under its NVRTC-independent key (used by precompile --out)."""
    bkey = make_key(source, mod.options, _BUNDLE_NVRTC)
    meta = dict(mod.meta, key=bkey, cache_key=mod.digest)
    path = entry_path(Path(out_dir), bkey)
    write_atomic(path, encode_entry(meta, mod.image))
    return path


# --------------------------------------------------------------------------- maintenance


@dataclass(frozen=True)
class EntryInfo:
    path: Path
    size: int
    mtime: float


def iter_entries(root: str | os.PathLike[str] | None = None) -> Iterator[EntryInfo]:
    root = Path(root) if root is not None else cache_dir()
    if not root.is_dir():
        return
    for sub in sorted(root.iterdir()):
        if not sub.is_dir() or len(sub.name) != 2:
            continue
        for p in sorted(sub.iterdir()):
            if p.suffix == SUFFIX and not p.name.startswith("."):
                try:
                    st = p.stat()
                except OSError:
                    continue
                yield EntryInfo(p, st.st_size, st.st_mtime)


HOST_SUBDIR = "host"  # the host backend's libraries (pykern.host.build) share the cache folder


def iter_host_builds(root: str | os.PathLike[str] | None = None) -> Iterator[EntryInfo]:
    """The host backend's built libraries and runtime objects under `<root>/host/`."""
    d = (Path(root) if root is not None else cache_dir()) / HOST_SUBDIR
    if not d.is_dir():
        return
    for p in sorted(d.iterdir()):
        if p.suffix in (".so", ".o") and not p.name.startswith("."):
            try:
                st = p.stat()
            except OSError:
                continue
            yield EntryInfo(p, st.st_size, st.st_mtime)


def _older(paths: Iterable[Path], older_than: float) -> list[Path]:
    """Those of `paths` last modified more than older_than seconds ago (one that vanished meanwhile: left out)."""
    now = time.time()
    out = []
    for p in paths:
        try:
            if now - p.stat().st_mtime > older_than:
                out.append(p)
        except OSError:
            pass
    return out


def _stale_temps(root: Path, older_than: float) -> list[Path]:
    if not root.is_dir():
        return []
    return _older([*root.glob("??/.*.tmp"), *root.glob(f"{HOST_SUBDIR}/.*.tmp")], older_than)


def read_meta(path: Path) -> dict[str, Any] | None:
    """Metadata of an entry without reading the image (None when the header or metadata is unreadable)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size + _META_LEN.size)
            if len(head) < _HEADER.size + _META_LEN.size or head[:8] != MAGIC:
                return None
            (mlen,) = _META_LEN.unpack_from(head, _HEADER.size)
            return json.loads(f.read(mlen))
    except (OSError, ValueError):
        return None


def info(root: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    root = Path(root) if root is not None else cache_dir()
    entries = list(iter_entries(root))
    by_arch: dict[str, int] = {}
    unreadable = 0
    for e in entries:
        meta = read_meta(e.path)
        if meta is None:
            unreadable += 1
            continue
        by_arch[meta.get("arch", "?")] = by_arch.get(meta.get("arch", "?"), 0) + 1
    try:
        nvrtc = _nvrtc_str()
    except BackendUnavailable as e:
        nvrtc = f"unavailable ({e})"
    b = bundle_dir()
    host = list(iter_host_builds(root))
    return {
        "cache_dir": str(root),
        "exists": root.is_dir(),
        "writable": _writable(root),
        "entries": len(entries),
        "bytes": sum(e.size for e in entries),
        "by_arch": dict(sorted(by_arch.items(), key=lambda kv: _arch_order(kv[0]))),
        "unreadable_entries": unreadable,
        "host_builds": len(host),
        "host_bytes": sum(e.size for e in host),
        "temp_files": len(_stale_temps(root, 0)),
        "oldest": min((e.mtime for e in entries), default=None),
        "newest": max((e.mtime for e in entries), default=None),
        "nvrtc": nvrtc,
        "format_version": FORMAT_VERSION,
        "bundle_dir": str(b) if b else None,
        "jit_disabled": jit_disabled(),
    }


def _writable(root: Path) -> bool:
    p = root
    while not p.exists() and p != p.parent:
        p = p.parent
    return p.is_dir() and os.access(p, os.W_OK)


def clear(root: str | os.PathLike[str] | None = None) -> tuple[int, int]:
    """Delete every entry, host backend build and leftover temp file; returns (files removed, bytes freed)."""
    root = Path(root) if root is not None else cache_dir()
    n = freed = 0
    for e in [*iter_entries(root), *iter_host_builds(root)]:
        try:
            e.path.unlink()
            n, freed = n + 1, freed + e.size
        except FileNotFoundError:
            pass
    for p in [*_stale_temps(root, 0), *_stale_locks(root, 0)]:
        try:
            p.unlink()
        except FileNotFoundError:
            pass
    return n, freed


def prune(max_size: int, root: str | os.PathLike[str] | None = None) -> tuple[int, int]:
    """Delete least recently used files until the total size is <= max_size; returns (removed, freed).

    Kernel entries and the host backend's builds count alike (one LRU order by mtime: a cache hit
    touches its entry). Temp files and lock files older than an hour belong to a process that died."""
    if max_size < 0:
        raise ArgumentError(f"max_size: expected >= 0 bytes, got {max_size}")
    root = Path(root) if root is not None else cache_dir()
    for p in [*_stale_temps(root, 3600.0), *_stale_locks(root, 3600.0)]:
        try:
            p.unlink()
        except FileNotFoundError:
            pass
    entries = sorted([*iter_entries(root), *iter_host_builds(root)], key=lambda e: e.mtime)
    total = sum(e.size for e in entries)
    n = freed = 0
    for e in entries:
        if total <= max_size:
            break
        try:
            e.path.unlink()
        except FileNotFoundError:
            continue
        total -= e.size
        n, freed = n + 1, freed + e.size
    return n, freed


def _stale_locks(root: Path, older_than: float) -> list[Path]:
    return _older(root.glob(f"??/.*{LOCK_SUFFIX}"), older_than) if root.is_dir() else []


def _arch_order(arch: str) -> tuple[int, int, str]:
    # sm_75 before sm_100 (numeric), cubins before PTX of the same number.
    try:
        from .compiler import parse_arch

        kind, num, suffix = parse_arch(arch)
        return num, kind == "compute", suffix
    except PykernError:
        return 1 << 30, False, arch


_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2, "mib": 1024**2,
          "g": 1024**3, "gb": 1024**3, "gib": 1024**3, "t": 1024**4, "tb": 1024**4, "tib": 1024**4}


def parse_size(text: str) -> int:
    """'500M', '2G', '1.5GB', '4096' -> bytes (binary units)."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ArgumentError(f"size: expected a number with an optional unit K/M/G/T, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ArgumentError as e:  # argparse prints an ArgumentTypeError's own message, not "invalid value"
        raise argparse.ArgumentTypeError(str(e)) from None


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def main(argv: Sequence[str] | None = None) -> int:
    # --cache-dir works before or after the subcommand: on the main parser it sets the default, on each
    # subparser it is SUPPRESSed unless given, so the later spelling wins without erasing the earlier.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", default=argparse.SUPPRESS, metavar="DIR",
                        help="cache folder to act on (default: PYKERN_CACHE_DIR, else $XDG_CACHE_HOME/pykern, "
                             "else ~/.cache/pykern)")
    ap = argparse.ArgumentParser(
        prog="python -m pykern.cache",
        description="Inspect and manage pykern's compiled-kernel cache "
        "(PYKERN_CACHE_DIR, else $XDG_CACHE_HOME/pykern, else ~/.cache/pykern): NVRTC entries and the "
        "host backend's builds alike. Options may come before or after the subcommand.",
        parents=[common],
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_info = sub.add_parser("info", help="show location, entry count, size and archs", parents=[common])
    p_info.add_argument("--json", action="store_true", help="print JSON on stdout")
    sub.add_parser("clear", help="delete every entry and host backend build", parents=[common])
    p_prune = sub.add_parser("prune", help="delete least recently used entries and host builds down to a size",
                             parents=[common])
    p_prune.add_argument("--max-size", required=True, type=_size_arg, metavar="SIZE",
                         help="size to keep, e.g. 500M, 2G, 0 (binary units)")
    args = ap.parse_args(argv)
    root = Path(getattr(args, "cache_dir", None) or cache_dir()).expanduser()
    if args.cmd == "info":
        d = info(root)
        if args.json:
            print(json.dumps(d, indent=2))
            return 0
        print(f"cache folder : {d['cache_dir']}{'' if d['exists'] else ' (does not exist yet)'}")
        print(f"writable     : {'yes' if d['writable'] else 'no'}")
        print(f"entries      : {d['entries']} ({_human(d['bytes'])})")
        for a, n in d["by_arch"].items():
            print(f"  {a:<12} {n}")
        print(f"host builds  : {d['host_builds']} ({_human(d['host_bytes'])})")
        if d["unreadable_entries"]:
            print(f"unreadable   : {d['unreadable_entries']} (rebuilt on next use)")
        print(f"nvrtc        : {d['nvrtc']}")
        print(f"bundle       : {d['bundle_dir'] or '(PYKERN_CUBIN_DIR not set)'}")
        print(f"jit          : {'disabled (PYKERN_DISABLE_JIT)' if d['jit_disabled'] else 'enabled'}")
        return 0
    if args.cmd == "clear":
        n, freed = clear(root)
        print(f"removed {n} files (kernel entries and host builds, {_human(freed)}) from {root}")
        return 0
    n, freed = prune(args.max_size, root)
    left = sum(e.size for e in [*iter_entries(root), *iter_host_builds(root)])
    print(f"removed {n} least recently used files (kernel entries and host builds, {_human(freed)}); "
          f"{_human(left)} left in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
