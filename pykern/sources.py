"""A kernel source file and the headers it includes: what a compile reads, and so what its cache key hashes."""
from __future__ import annotations

import hashlib
import os
import re
from functools import lru_cache
from pathlib import Path



def _kernels_dir() -> Path:
    # A source checkout keeps kernels_cu/ beside the package; a wheel ships it as pykern/_kernels_cu.
    here = Path(__file__).resolve().parent
    checkout = here.parent / "kernels_cu"
    return checkout if checkout.is_dir() else here / "_kernels_cu"


KERNELS_DIR = _kernels_dir()
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def include_dirs(source_dir: Path | None = None) -> tuple[Path, ...]:
    """Folders searched for `#include "x.cuh"`: the source's own folder, then kernels_cu/."""
    dirs = [] if source_dir is None else [Path(source_dir)]
    if KERNELS_DIR not in dirs:
        dirs.append(KERNELS_DIR)
    return tuple(dirs)


class Source:
    """The text of one `.cu` file plus every header it pulls in, resolved recursively."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).resolve()
        self.data = self.path.read_bytes()
        self.text = self.data.decode("utf-8")
        self.headers: dict[Path, bytes] = {}
        self._collect(self.text, self.path.parent)

    def _collect(self, text: str, here: Path) -> None:
        for name in _INCLUDE.findall(text):
            for d in (here, *include_dirs(self.path.parent)):
                cand = (d / name).resolve()
                if cand.is_file():
                    break
            else:
                continue  # a missing header is the compiler's error to report, with file:line
            if cand not in self.headers:
                self.headers[cand] = cand.read_bytes()
                self._collect(self.headers[cand].decode("utf-8"), cand.parent)

    def digest(self) -> str:
        """SHA-256 over the source bytes and each included header (name and bytes), order-independent."""
        h = hashlib.sha256()
        h.update(b"src\0" + self.data)
        for p in sorted(self.headers, key=lambda p: p.name):
            h.update(b"\0hdr\0" + p.name.encode() + b"\0" + self.headers[p])
        return h.hexdigest()


@lru_cache(maxsize=None)
def _cached(path: str, mtime_ns: int, size: int) -> Source:
    return Source(path)


def load(path: str | os.PathLike[str]) -> Source:
    """A Source, re-read only when the file's mtime or size changed (headers are re-checked too)."""
    st = os.stat(path)
    src = _cached(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)
    for h, data in src.headers.items():
        try:
            if h.read_bytes() != data:
                _cached.cache_clear()
                return Source(path)
        except OSError:
            _cached.cache_clear()
            return Source(path)
    return src
