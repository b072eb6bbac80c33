"""KernelSpecs parsed from the `extern "C" __global__` functions of the .cu sources: the one source of truth."""
from __future__ import annotations

import fnmatch
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import cmacros
from .ctypes_ import ALIASES, POINTEE_DTYPES, SCALARS
from .errors import KernelNotFound, RegistryError
from .sources import KERNELS_DIR
from .sources import load as load_source

# Balanced parentheses three levels deep: `__launch_bounds__((4 * 32), 1)`, `PK_BOUNDS(X(1), 2)`.
_ARGS = r"\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)"
# Words between `__global__` and the name: `__launch_bounds__(...)` or macros that may expand to it.
_ATTRS = rf"(?:[A-Za-z_]\w*\b\s*(?:{_ARGS}\s*)?)*?"
_KERNEL = re.compile(
    rf'extern\s+"C"\s+__global__\s+({_ATTRS})void\s+({_ATTRS})'
    # The name is the word whose parenthesized list is followed by the body (or `;`): a macro call
    # such as `PK_BOUNDS(128, 1)` before it is an attribute, not the kernel.
    r"([A-Za-z_]\w*)\s*\(([^)]*)\)(?=\s*[{;])"
)
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_QUALIFIERS = {"__restrict__", "__restrict", "restrict", "volatile", "__grid_constant__"}
# `// pykern: arch sm_90a[, sm_100a]` in a source: its kernels are built only for these (arch-specific) targets.
_ARCH_PRAGMA = re.compile(r"^[ \t]*//[ \t]*pykern:[ \t]*archs?[ \t]+([^\n]+)$", re.M)
# `// pykern: pdl decode_tc_*[, ...]`: the kernels of a source (fnmatch patterns) that call
# pk_grid_dependency_wait() before their first global access, so they may be launched with programmatic
# dependent launch (pykern.launch(..., pdl=True)); launching any other kernel so would race its predecessor.
_PDL_PRAGMA = re.compile(r"^[ \t]*//[ \t]*pykern:[ \t]*pdl[ \t]+([^\n]+)$", re.M)
# A #define (with its continuation lines): the instantiation macros' own bodies are not kernels.
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define\b(?:[^\n]*\\\n)*[^\n]*", re.M)

# The kernel families written once over their I/O element type T (kernels_cu/pk_common.cuh):
#   PK_IO_KERNELS(name, (bounds), (params using T), (args))    -> name, name_bf16, name_f16
#   PK_IO16_KERNELS(name, (bounds), (params using T), (args))  -> name_bf16, name_f16
# Each instantiation is an extern "C" kernel whose parameters are `params` with T replaced by its type.
# This table and the macros in pk_common.cuh must agree (tests/test_registry.py checks the compiled names).
IO_INSTANTIATIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "PK_IO_KERNELS": (("", "float"), ("_bf16", "__nv_bfloat16"), ("_f16", "__half")),
    "PK_IO16_KERNELS": (("_bf16", "__nv_bfloat16"), ("_f16", "__half")),
}
# Families over a query type T and a K/V cache type whose storage type TKS spells the cache pointers
# (kernels_cu/paged.cu): (suffix, T, TKS). In the IO_INSTANTIATIONS families above TKS is T.
_FP8 = (("float", ""), ("__nv_bfloat16", "_bf16"), ("__half", "_f16"))
KV_INSTANTIATIONS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "PK_KV16_KERNELS": (("_bf16kv", "float", "__nv_bfloat16"), ("_f16kv", "float", "__half")),
    "PK_FP8KV_KERNELS": tuple((f"{q}_{f}kv", t, "unsigned char") for t, q in _FP8 for f in ("e4m3", "e5m2")),
    "PK_FP8_KERNELS": tuple((f"{q}_{f}", t, "unsigned char") for t, q in _FP8 for f in ("e4m3", "e5m2")),
    "PK_FP8KV16_KERNELS": tuple((f"{q}_{f}kv", t, "unsigned char") for t, q in _FP8 if q for f in ("e4m3", "e5m2")),
}


def instantiations(macro: str) -> tuple[tuple[str, str, str], ...]:
    """(suffix, T, TKS) of every kernel one call of an instantiation macro makes."""
    if macro in KV_INSTANTIATIONS:
        return KV_INSTANTIATIONS[macro]
    return tuple((sfx, t, t) for sfx, t in IO_INSTANTIATIONS[macro])


_IO_CALL = re.compile(r"^[ \t]*(" + "|".join([*IO_INSTANTIATIONS, *KV_INSTANTIATIONS]) + r")\s*\(", re.M)


class RegistryWarning(UserWarning):
    """A kernel (or source) outside kernels_cu/ was skipped because it cannot be typed; others keep working."""


def strict() -> bool:
    """PYKERN_STRICT=1: a kernel the registry cannot type is an error for every kernel, not a skip."""
    return os.environ.get("PYKERN_STRICT", "").strip().lower() not in ("", "0", "false", "no", "off")


def _is_strict(path: Path) -> bool:
    # The project's own kernels are always strict: a broken signature there is a bug to fail on.
    return strict() or Path(path).resolve().parent == KERNELS_DIR.resolve()


_warned: set[str] = set()


def _skip(msg: str) -> None:
    """One warning per distinct problem per process (the registry is re-parsed after every edit)."""
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(f"pykern: skipped {msg} (set PYKERN_STRICT=1 to make this an error)", RegistryWarning,
                      stacklevel=4)


def suggest(name: str, known: list[str] | tuple[str, ...] | set[str], n: int = 5) -> str:
    """'did you mean a, b?' for the names closest to `name`, else a short count of what exists."""
    import difflib  # only on the error path: keeps `import pykern` lean
    close = difflib.get_close_matches(name, list(known), n=n, cutoff=0.6)
    if close:
        return "did you mean " + ", ".join(close) + "?"
    return f"{len(known)} kernels are registered (pykern.kernels() lists them)" if known else "no kernel is registered"


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str  # canonical: "const float*", "float*", "unsigned int", ...

    @property
    def is_pointer(self) -> bool:
        return self.ctype.endswith("*")

    @property
    def pointee(self) -> str:
        """Base type a pointer points to, without const ("float" for "const float*")."""
        return self.ctype.rstrip("*").removeprefix("const ").strip()

    @property
    def is_const(self) -> bool:
        return self.ctype.startswith("const ")


@dataclass(frozen=True)
class KernelSpec:
    name: str
    source: Path
    line: int
    params: tuple[Param, ...]
    max_threads: int | None = None  # __launch_bounds__(N): more threads per block is refused
    archs: tuple[str, ...] = ()  # `// pykern: arch sm_90a`: the only targets it is built for; () = every arch
    pdl: bool = False  # `// pykern: pdl NAME`: waits for the previous grid first; a PDL launch is safe

    def __repr__(self) -> str:
        sig = ", ".join(f"{p.ctype} {p.name}" for p in self.params)
        return f"<KernelSpec {self.name}({sig}) at {self.source.name}:{self.line}>"


def _blank_comments(text: str) -> str:
    # Keep newlines so match offsets still give the right line numbers.
    return _COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def source_archs(text: str, where: str = "") -> tuple[str, ...]:
    """The targets a source opts in to with `// pykern: arch sm_90a[, sm_100a]` lines (() when none).

    Only arch-specific `a` targets may be named: such a source is compiled for them and nothing else,
    while every other source is compiled for whatever arch is asked.
    """
    out: list[str] = []
    for m in _ARCH_PRAGMA.finditer(text):
        for part in re.split(r"[,\s]+", m.group(1).strip()):
            if not part:
                continue
            a = part.lower()
            if not re.fullmatch(r"sm_\d+a", a):
                raise RegistryError(f"{where}: `// pykern: arch` names arch-specific targets (sm_90a, sm_100a, ...), "
                                    f"got {part!r}")
            if a not in out:
                out.append(a)
    return tuple(out)


def source_pdl(text: str) -> tuple[str, ...]:
    """The kernel-name patterns of a source's `// pykern: pdl PATTERN[, PATTERN]` lines (() when none)."""
    return tuple(p for m in _PDL_PRAGMA.finditer(text) for p in re.split(r"[,\s]+", m.group(1).strip()) if p)


def _parse_param(decl: str, where: str) -> Param:
    toks = re.findall(r"[A-Za-z_]\w*|\*|&|\[|\]", decl)
    toks = [t for t in toks if t not in _QUALIFIERS]
    if len(toks) < 2 or not re.fullmatch(r"[A-Za-z_]\w*", toks[-1]) or "&" in toks or "[" in toks:
        raise RegistryError(f"{where}: cannot type parameter {decl.strip()!r}")
    name, typ = toks[-1], toks[:-1]
    stars = typ.count("*")
    if stars > 1:
        raise RegistryError(f"{where}: parameter {name!r}: pointer-to-pointer {decl.strip()!r} is not supported")
    first_star = typ.index("*") if stars else len(typ)
    base_toks = typ[:first_star]  # const after the star is top-level: it does not change the ABI
    const = "const" in base_toks
    base = " ".join(t for t in base_toks if t != "const")
    base = ALIASES.get(base, base)
    if base not in SCALARS:
        raise RegistryError(f"{where}: parameter {name!r} has unsupported type {decl.strip()!r}")
    if stars:
        if base not in POINTEE_DTYPES:
            raise RegistryError(f"{where}: parameter {name!r}: no array dtype for {base}*")
        return Param(name, f"{'const ' if const else ''}{base}*")
    return Param(name, base)


def _split_call(text: str, open_at: int) -> tuple[list[str], int]:
    """Top-level comma-separated arguments of the call whose "(" is text[open_at], and the index after ")"."""
    depth, args, start = 0, [], open_at + 1
    for i in range(open_at, len(text)):
        c = text[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                args.append(text[start:i].strip())
                return args, i + 1
        elif c == "," and depth == 1:
            args.append(text[start:i].strip())
            start = i + 1
    raise RegistryError("unbalanced parentheses")


def _list_arg(arg: str, macros: dict[str, cmacros.Macro]) -> str | None:
    """A parenthesized list argument as written, or the body of the object-like macro it names
    (`#define PA_PARAMS (const T* q, ...)`: a family states its parameter list once), expanded when that body
    is itself a macro call (`#define PA_PARAMS_FP8 PA_PARAMS_KV(unsigned char)`: lists that differ only in a
    type, written once); None if neither."""
    if arg.startswith("(") and arg.endswith(")"):
        return arg
    m = macros.get(arg) if re.fullmatch(r"[A-Za-z_]\w*", arg) else None
    if m is None or m.params is not None or m is cmacros.AMBIGUOUS:
        return None
    body = m.body.strip()
    if not (body.startswith("(") and body.endswith(")")):
        try:
            body = " ".join(cmacros.expand(body, macros))
        except cmacros.Unresolved:
            return None
    return body if body.startswith("(") and body.endswith(")") else None


def _io_kernels(text: str, macros: Callable[[], dict[str, cmacros.Macro]] = dict) -> list[tuple[int, str, str, str]]:
    """(offset, name, attrs, parameter list) of every instantiation of the PK_IO*_KERNELS calls in `text`.

    `macros` gives the #defines of the source and its headers, read only when a call names its bounds or
    parameter list through an object-like macro."""
    out = []
    table: dict[str, cmacros.Macro] | None = None
    for m in _IO_CALL.finditer(text):
        macro = m.group(1)
        line = text.count("\n", 0, m.start()) + 1
        try:
            args, _ = _split_call(text, m.end() - 1)
        except RegistryError:
            raise RegistryError(f"line {line}: {macro}: unbalanced parentheses") from None
        lists: list[str | None] = []
        if len(args) == 4:
            for a in args[1:]:
                if not (a.startswith("(") and a.endswith(")")) and table is None:
                    table = macros()
                lists.append(_list_arg(a, table or {}))
        if len(args) != 4 or not re.fullmatch(r"[A-Za-z_]\w*", args[0]) or None in lists[:2]:
            raise RegistryError(f"line {line}: expected {macro}(name, (bounds), (params), (args)) (or object-like "
                                f"macros holding those lists), got {macro}({', '.join(args)})")
        name, bounds, params = args[0], lists[0], lists[1][1:-1]
        for suffix, ctype, kv_ctype in instantiations(macro):
            typed = re.sub(r"\bTKS\b", kv_ctype, re.sub(r"\bT\b", ctype, params))
            out.append((m.start(), name + suffix, f"__launch_bounds__{bounds}", typed))
    return out


def parse_file(path: Path, strict: bool | None = None) -> list[KernelSpec]:
    """Every `extern "C" __global__ void` kernel of one source file, in file order.

    A kernel whose signature cannot be typed raises RegistryError when strict (PYKERN_STRICT=1, and
    always for kernels_cu/), else it is left out with one RegistryWarning naming file:line and why.
    """
    strict = _is_strict(path) if strict is None else strict
    try:
        raw = Path(path).read_text(encoding="utf-8")
        text = _blank_comments(raw)
    except UnicodeDecodeError as e:
        err = RegistryError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})")
        if strict:
            raise err from None
        _skip(f"every kernel of {err}")
        return []
    specs = []
    try:
        archs = source_archs(raw, str(path))
    except RegistryError as e:
        if strict:
            raise
        _skip(f"every kernel of {e}")
        return []
    pdl_patterns = source_pdl(raw)
    macros: dict[str, cmacros.Macro] | None = None

    def read_macros() -> dict[str, cmacros.Macro]:
        nonlocal macros
        if macros is None:
            macros = _macros(path, defines)
        return macros

    defines = text  # what _macros reads; the scan below must not see kernels inside macro bodies
    text = _DEFINE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    found = [(m.start(), m.group(3), f"{m.group(1)} {m.group(2)}".strip(), m.group(4)) for m in _KERNEL.finditer(text)]
    try:
        found += _io_kernels(text, read_macros)
    except RegistryError as e:
        if strict:
            raise RegistryError(f"{path}: {e}") from None
        _skip(f"kernels of {path}: {e}")
    for start, name, attrs, body in sorted(found, key=lambda f: f[0]):
        line = text.count("\n", 0, start) + 1
        where = f"{path}:{line}"
        body = body.strip()
        decls = [] if body in ("", "void") else body.split(",")
        try:
            params = tuple(_parse_param(d, where) for d in decls)
            names = [p.name for p in params]
            if len(set(names)) != len(names):
                raise RegistryError(f"{where}: kernel {name!r} repeats a parameter name")
        except RegistryError as e:
            if strict:
                raise
            _skip(f"kernel {name!r}: {e}")
            continue
        max_threads = None
        if attrs:
            if not _LITERAL_BOUNDS.fullmatch(attrs):
                read_macros()
            try:
                max_threads = cmacros.launch_bounds(attrs, macros or {})
                if max_threads is not None and max_threads <= 0:
                    raise cmacros.Unresolved(f"it evaluates to {max_threads}")
            except cmacros.Unresolved as e:
                err = RegistryError(f"{where}: kernel {name!r}: cannot read __launch_bounds__ from {attrs!r}: {e}")
                if strict:
                    raise err from None
                _unbounded(f"{err}; its thread limit is not checked before launch")
                max_threads = None
        pdl = any(fnmatch.fnmatchcase(name, p) for p in pdl_patterns)
        specs.append(KernelSpec(name, Path(path).resolve(), line, params, max_threads, archs, pdl))
    return specs


# The common case needs no macro table: a literal first argument.
_LITERAL_BOUNDS = re.compile(r"__launch_bounds__\s*\(\s*(0[xX][0-9a-fA-F]+|\d+)[uU]?\s*(?:,[^()]*)?\)\s*")


def _macros(path: Path, text: str) -> dict[str, cmacros.Macro]:
    """The #defines of a source (comments already blanked) and of every header it includes."""
    texts = [text]
    try:
        texts += [h.decode("utf-8", "replace") for h in load_source(path).headers.values()]
    except (OSError, UnicodeDecodeError):  # headers are the compiler's to complain about
        pass
    return cmacros.collect(texts)


def _unbounded(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(f"pykern: {msg} (set PYKERN_STRICT=1 to make this an error)", RegistryWarning, stacklevel=4)


def kernel_dirs() -> list[Path]:
    """kernels_cu/ then the folders of PYKERN_KERNEL_PATH (os.pathsep-separated)."""
    dirs = [KERNELS_DIR]
    for d in os.environ.get("PYKERN_KERNEL_PATH", "").split(os.pathsep):
        if d.strip():
            p = Path(d).expanduser().resolve()
            if not p.is_dir():
                raise RegistryError(f"PYKERN_KERNEL_PATH entry {d!r} is not a folder")
            if p not in dirs:
                dirs.append(p)
    return dirs


def source_files() -> list[Path]:
    return [f for d in kernel_dirs() for f in sorted(d.glob("*.cu"))]


def _file_stamp(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:  # removed since it was listed: the next load drops its kernels
        return None
    return st.st_mtime_ns, st.st_size


# (stamp of the whole kernel path, name -> spec, resolved source path -> stamp when parsed)
_state: tuple[object, dict[str, KernelSpec], dict[str, tuple[int, int] | None]] | None = None


def _stamp(files: list[Path]) -> object:
    # The registry is rebuilt when the kernel path or any source changes (cheap stat calls).
    return (os.environ.get("PYKERN_KERNEL_PATH", ""), tuple((str(f), _file_stamp(f)) for f in files))


def _load() -> dict[str, KernelSpec]:
    global _state
    files = source_files()
    stamp = _stamp(files)
    if _state is not None and _state[0] == stamp:
        return _state[1]
    table: dict[str, KernelSpec] = {}
    # Stamped before parsing: an edit racing the parse shows up as a changed stamp next time.
    per_file = {str(f.resolve()): s for f, (_, s) in zip(files, stamp[1])}  # type: ignore[index]
    for f in files:
        for spec in parse_file(f):
            if spec.name in table:
                old = table[spec.name]
                err = RegistryError(
                    f"kernel {spec.name!r} defined twice: {old.source}:{old.line} and {spec.source}:{spec.line}"
                )
                if _is_strict(f):
                    raise err
                _skip(f"the second definition: {err}; the first one is used")  # kernels_cu/ comes first
                continue
            table[spec.name] = spec
    _state = (stamp, table, per_file)
    return table


# The launcher's fast path: name -> (spec, its source as a str, the source's stamp when parsed).
_fast: dict[str, tuple[KernelSpec, str, tuple[int, int] | None]] = {}
_fast_key: str | None = None


def _reload_fast() -> None:
    global _fast
    table = _load()
    assert _state is not None
    per_file = _state[2]
    _fast = {n: (s, str(s.source), per_file.get(str(s.source))) for n, s in table.items()}


def get(name: str) -> KernelSpec:
    """The spec of one kernel; the launcher's fast path: one stat() of the kernel's own source per call,
    so an edited signature (or a removed kernel) is noticed before its arguments are packed."""
    global _fast_key
    key = os.environ.get("PYKERN_KERNEL_PATH", "")
    if _fast_key != key:
        _reload_fast()
        _fast_key = key
    entry = _fast.get(name)
    if entry is None or _file_stamp(entry[1]) != entry[2]:
        _reload_fast()  # a source was added, edited or removed since
        entry = _fast.get(name)
        if entry is None:
            raise KernelNotFound(f"no kernel named {name!r}; {suggest(name, sorted(_fast))}")
    return entry[0]


def refresh() -> None:
    """Forget parsed specs. Needed after editing an included header in a running process
    (`.cu` edits are noticed by `get` and `kernels` on their own)."""
    global _state, _fast_key
    _state, _fast_key = None, None


def kernels() -> list[KernelSpec]:
    """Every registered kernel, sorted by name."""
    return sorted(_load().values(), key=lambda s: s.name)
