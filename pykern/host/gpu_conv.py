"""Source-to-source rewrite giving plain C++ float-to-int conversions and shifts the GPU's results.

NVRTC turns `(int)f`, `static_cast<unsigned>(f)`, `int i = f;` into `cvt.rzi` (truncate, saturate
to the destination range, NaN -> 0) and `x << n`, `x >> n` into `shl`/`shr`, which clamp the count
(n >= width gives 0, or the sign for a signed `>>`). On x86 the same C++ gives INT_MIN
("integer indefinite") and a masked count, and GCC has no flag to change either. So, before g++,
the kernel sources are parsed with libclang (as C++ with the emulation header) and each such
expression is wrapped in a helper of pk_cuda_host.h: `__pk_f2i<To>(e)`, `__pk_shl(a, b)`,
`__pk_shr(a, b)`, `__pk_shl_eq(a, b)`, `__pk_shr_eq(a, b)`. Only text inside the kernel sources
(the .cu and the headers it includes from its own folder or the include folders) changes, every
edit keeps the line count, and the helpers are constexpr, so a rewritten constant expression
still compiles. What is skipped: expressions inside macro expansions, shifts by an integer
literal below the width (nothing to change), compound assignments to bit-fields, and
implicit conversions whose types are only known at template instantiation (`int i = t;` with
t of type T: clang has no conversion node in the template's pattern). Explicit casts and shifts
with dependent types are wrapped; the helpers fall back to the plain operation for other types.

Off with PYKERN_HOST_GPU_CONVERSIONS=0; without libclang (the `libclang` wheel) or when it
cannot parse a source, the build goes on un-rewritten after one warning.
"""
from __future__ import annotations

import bisect
import ctypes
import hashlib
import os
import re
import subprocess
import threading
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Sequence

_INT_KINDS = {
    "INT": 32, "UINT": 32, "LONG": 64, "ULONG": 64, "LONGLONG": 64, "ULONGLONG": 64,
}
_FLOAT_KINDS = {"FLOAT", "DOUBLE", "LONGDOUBLE"}
_SHIFT_WIDTH_KINDS = {
    "INT": 32, "UINT": 32, "LONG": 64, "ULONG": 64, "LONGLONG": 64, "ULONGLONG": 64,
    "CHAR_S": 32, "SCHAR": 32, "UCHAR": 32, "SHORT": 32, "USHORT": 32, "CHAR_U": 32, "BOOL": 32,
    "CHAR16": 32, "CHAR32": 32, "WCHAR": 32,
}

_DEPENDENT = {"UNEXPOSED", "DEPENDENT"}  # a template parameter's type, or an expression of one
_IDENT = re.compile(r"[A-Za-z_]\w*")

_warned: set[str] = set()
# Warnings of the build under way: issued by the build only once its compile succeeded (a source
# that g++ rejects too needs the compiler's error, not a note that libclang could not parse it).
# Per thread: HostBackend.prebuild builds several sources at once.
_pending = threading.local()


def enabled() -> bool:
    """PYKERN_HOST_GPU_CONVERSIONS (default 1)."""
    return os.environ.get("PYKERN_HOST_GPU_CONVERSIONS", "1").strip().lower() not in ("0", "off", "false", "no")


def _warn_once(key: str, msg: str) -> None:
    if not hasattr(_pending, "items"):
        _pending.items = []
    _pending.items.append((key, msg))


def flush_warnings(ok: bool) -> None:
    """Issue the pending warnings (once per key and process) when the build succeeded; drop them otherwise."""
    items, _pending.items = getattr(_pending, "items", []), []
    for key, msg in items if ok else ():
        if key not in _warned:
            _warned.add(key)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)


@lru_cache(maxsize=None)
def _cindex():
    try:
        import clang.cindex as ci  # the `libclang` wheel: bindings plus libclang.so
        ci.Index.create()
        return ci
    except Exception as e:  # noqa: BLE001 -- ImportError, or a libclang.so that will not load
        return e


def tag() -> bytes:
    """What the build key must cover: off, or this rewriter's code and the libclang in use."""
    if not enabled():
        return b"gpu-conv-off"
    ci = _cindex()
    if isinstance(ci, Exception):
        return b"gpu-conv-unavailable"
    h = hashlib.sha256(Path(__file__).read_bytes())
    try:
        from importlib.metadata import version

        h.update(version("libclang").encode())
    except Exception:  # noqa: BLE001 -- bindings installed some other way
        h.update(str(getattr(ci, "__file__", "")).encode())
    return b"gpu-conv-" + h.hexdigest()[:16].encode()


@lru_cache(maxsize=None)
def _builtin_include(cxx: tuple[str, ...]) -> str | None:
    """The compiler's own header folder (float.h, stddef.h): the wheel ships libclang without one."""
    try:
        out = subprocess.run([*cxx, "-print-file-name=include"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    p = out.stdout.strip()
    return p if out.returncode == 0 and p and Path(p).is_dir() else None


@dataclass
class _Edits:
    inserts: list[tuple[int, int, int, str]] = field(default_factory=list)  # (offset, phase, order, text)
    replaces: list[tuple[int, int, str]] = field(default_factory=list)  # (start, end, text)

    seen: set[tuple[int, int, str]] = field(default_factory=set)

    def wrap(self, start: int, end: int, prefix: str, suffix: str) -> None:
        # One expression reached twice (e.g. a default argument seen from a call) is wrapped once.
        if (start, end, prefix) in self.seen:
            return
        self.seen.add((start, end, prefix))
        n = end - start
        # At one offset: closing suffixes first (inner before outer), then opening prefixes (outer first).
        self.inserts.append((start, 2, -n, prefix))
        self.inserts.append((end, 0, n, suffix))

    def apply(self, text: bytes) -> bytes:  # libclang's offsets count bytes
        ops = [(o, ph, k, t, o) for o, ph, k, t in self.inserts] + [(s, 1, 0, t, e) for s, e, t in self.replaces]
        ops.sort(key=lambda x: (x[0], x[1], x[2]))
        out, last = [], 0
        for start, _ph, _k, t, end in ops:
            out.append(text[last:start])
            out.append(t.encode())
            last = end
        out.append(text[last:])
        return b"".join(out)


@dataclass
class Result:
    tu: str                      # the rewritten translation unit
    headers: dict[Path, str]     # original header path -> text to build from (every kernel header it includes)
    edits: int


def _kind(t) -> str:
    return t.get_canonical().kind.name


def rewrite(tu_path: Path, tu_text: str, body_start: int, roots: Sequence[Path], args: Sequence[str],
            cxx: tuple[str, ...], label: str) -> Result | None:
    """Rewrite `tu_text` (already written at tu_path) from offset body_start on, and its kernel headers.

    None (after one warning naming `label`) when libclang is missing or cannot parse the source.
    """
    ci = _cindex()
    if isinstance(ci, Exception):
        _warn_once("libclang", (
            "pykern host backend: libclang is not installed (pip install libclang), so plain float-to-int "
            "conversions and shifts by >= the width keep x86's results instead of the GPU's; "
            f"set PYKERN_HOST_GPU_CONVERSIONS=0 to silence this ({ci})"))
        return None
    inc = _builtin_include(cxx)
    cargs = ["-x", "c++", "-std=c++17", *(["-isystem", inc] if inc else []), *args]
    try:
        index = ci.Index.create()
        tu = index.parse(str(tu_path), args=cargs, unsaved_files=[(str(tu_path), tu_text)],
                         options=ci.TranslationUnit.PARSE_DETAILED_PROCESSING_RECORD)
    except Exception as e:  # noqa: BLE001 -- TranslationUnitLoadError
        _warn_once(label, f"pykern host backend: libclang could not parse {label} ({e}); building it without "
                          "the GPU conversion/shift rewrite (x86 results for out-of-range casts and big shifts)")
        return None
    errs = [d for d in tu.diagnostics if d.severity >= ci.Diagnostic.Error]
    if errs:
        _warn_once(label, f"pykern host backend: libclang could not parse {label} ({errs[0]}); building it "
                          "without the GPU conversion/shift rewrite (x86 results for out-of-range casts and big shifts)")
        return None

    roots = [r.resolve() for r in roots]
    here = Path(__file__).resolve().parent  # the emulation header is never a kernel source
    tu_key = str(tu_path)

    def in_roots(name: str) -> Path | None:
        p = Path(name).resolve()
        if p.is_relative_to(here):
            return None
        for r in roots:
            if p.is_relative_to(r):
                return p
        return None

    files: dict[str, Path | None] = {}

    def file_ok(name: str) -> bool:
        if name == tu_key:
            return True
        if name not in files:
            files[name] = in_roots(name)
        return files[name] is not None

    # Macro expansions: an expression there has no text of its own to rewrite.
    macro_spans: dict[str, list[tuple[int, int]]] = {}
    edits: dict[str, _Edits] = {}
    count = 0
    K = ci.CursorKind

    def extent(c) -> tuple[str, int, int] | None:
        s, e = c.extent.start, c.extent.end
        if s.file is None or e.file is None or s.file.name != e.file.name:
            return None
        name = s.file.name
        if not file_ok(name) or (name == tu_key and s.offset < body_start) or e.offset <= s.offset:
            return None
        # An expression from a macro expansion (body or argument) lies within the invocation or
        # starts or ends inside it; one that contains a whole invocation has text of its own.
        so, eo = s.offset, e.offset
        spans = macro_spans.get(name)
        if spans:  # sorted, non-overlapping: only the invocations around so and eo matter
            for j in {bisect.bisect_right(spans, (so, 1 << 62)) - 1, bisect.bisect_right(spans, (eo, 1 << 62)) - 1}:
                if j >= 0:
                    ms, me = spans[j]
                    if (ms <= so and eo <= me) or ms < so < me or ms < eo < me:
                        return None
        return name, so, eo

    top = list(tu.cursor.get_children())  # preprocessing cursors are the TU's own children
    for c in top:
        if c.kind == K.MACRO_INSTANTIATION:
            f = c.location.file
            if f is not None and file_ok(f.name):
                macro_spans.setdefault(f.name, []).append((c.extent.start.offset, c.extent.end.offset))
    for v in macro_spans.values():
        v.sort()
    shift_ops = _shift_opcodes(ci)

    texts: dict[str, bytes] = {tu_key: tu_text.encode()}

    def text_of(name: str) -> bytes:
        if name not in texts:
            texts[name] = Path(name).read_bytes()
        return texts[name]

    # Walk function bodies only (a constant expression at namespace or class scope stays as is).
    def visit(c, in_body: bool) -> None:
        nonlocal count
        kind = c.kind
        if kind in (K.FUNCTION_DECL, K.CXX_METHOD, K.FUNCTION_TEMPLATE, K.CONSTRUCTOR, K.DESTRUCTOR,
                    K.CONVERSION_FUNCTION, K.LAMBDA_EXPR):
            in_body = True
        elif kind in (K.STATIC_ASSERT, K.ENUM_DECL, K.TEMPLATE_REF, K.TYPE_REF):
            in_body = False
        kids = list(c.get_children())
        if in_body:
            if kind == K.CASE_STMT:
                # the label is a constant expression; the statement after it is not
                for k in kids[:-1]:
                    visit(k, False)
                visit(kids[-1], True)
                return
            if kind in (K.BINARY_OPERATOR, K.COMPOUND_ASSIGNMENT_OPERATOR) and len(kids) == 2:
                if shift_ops is None or shift_ops(c):
                    count += _shift(c, kids)
            elif (kind in (K.CSTYLE_CAST_EXPR, K.CXX_STATIC_CAST_EXPR, K.CXX_FUNCTIONAL_CAST_EXPR) and kids) or (
                    kind == K.UNEXPOSED_EXPR and len(kids) == 1):  # an implicit conversion has one operand
                count += _conv(c, kids[-1])
        for k in kids:
            visit(k, in_body)

    def _shift(c, kids) -> int:
        a, b = kids
        ea, eb, ec = extent(a), extent(b), extent(c)
        if ea is None or eb is None or ec is None:
            return 0
        name = ec[0]
        src = text_of(name)
        op = src[ea[2]:eb[1]].decode("utf-8", "replace").strip()
        if op not in ("<<", ">>", "<<=", ">>="):
            return 0
        ka, kb = _kind(a.type), _kind(b.type)
        if ka not in _SHIFT_WIDTH_KINDS and ka not in ("DEPENDENT", "UNEXPOSED"):
            return 0
        if kb not in _SHIFT_WIDTH_KINDS and kb not in ("DEPENDENT", "UNEXPOSED"):
            return 0
        width = 64 if _SHIFT_WIDTH_KINDS.get(ka, 0) == 64 else 32
        if ka in ("DEPENDENT", "UNEXPOSED"):
            width = 32
        v = _literal(b, K)
        if v is not None:
            lit = src[v.extent.start.offset:v.extent.end.offset].decode().rstrip("uUlL")
            try:
                n = int(lit, 0)
            except ValueError:
                n = None
            if n is not None and 0 <= n < width:
                return 0
        if op.endswith("="):
            # a bit-field cannot bind to the helper's reference
            if _is_bitfield(a, K):
                return 0
        helper = {"<<": "__pk_shl", ">>": "__pk_shr", "<<=": "__pk_shl_eq", ">>=": "__pk_shr_eq"}[op]
        ed = edits.setdefault(name, _Edits())
        if (ec[1], ec[2], f"{helper}(") in ed.seen:
            return 0
        ed.wrap(ec[1], ec[2], f"{helper}(", ")")
        # the operator token itself becomes the argument separator
        i = src.index(op.encode(), ea[2], eb[1])
        ed.replaces.append((i, i + len(op), ","))
        return 1

    def _conv(c, child) -> int:
        to, frm = _kind(c.type), _kind(child.type)
        explicit = c.kind != K.UNEXPOSED_EXPR
        if to in _INT_KINDS and frm in _FLOAT_KINDS:
            spelled = c.type.get_canonical().spelling
        elif explicit and to in _INT_KINDS and frm in _DEPENDENT:
            spelled = c.type.get_canonical().spelling  # `(int)v` with v of type T: the helper decides
        elif explicit and to in _DEPENDENT and (frm in _FLOAT_KINDS or frm in _DEPENDENT) and \
                _IDENT.fullmatch(c.type.spelling):
            spelled = c.type.spelling  # `(T)f`, `(T)v`: T is in scope where the cast is
        else:
            return 0
        ek = extent(child)
        if ek is None:
            return 0
        if explicit and extent(c) is None:
            return 0
        edits.setdefault(ek[0], _Edits()).wrap(ek[1], ek[2], f"__pk_f2i<{spelled}>(", ")")
        return 1

    for inc_ in tu.get_includes():  # every kernel header goes to the overlay, rewritten or not
        file_ok(inc_.include.name)
    for c in top:
        loc = c.location.file
        if loc is not None and file_ok(loc.name):  # the kernel sources, not the system headers
            visit(c, False)
    if count == 0:
        return Result(tu_text, {}, 0)
    new_tu = edits[tu_key].apply(texts[tu_key]).decode("utf-8") if tu_key in edits else tu_text
    headers: dict[Path, str] = {}
    for name, p in files.items():
        if p is None or name == tu_key:
            continue
        t = text_of(name)
        headers[p] = (edits[name].apply(t) if name in edits else t).decode("utf-8", "surrogateescape")
    return Result(new_tu, headers, count)


@lru_cache(maxsize=None)
def _shift_opcodes(ci):
    """A fast test `cursor is <<, >>, <<= or >>=` (clang_getCursorBinaryOperatorKind, libclang >= 17), or None.

    The opcodes are read off a parsed snippet rather than assumed from the C enum.
    """
    try:
        kind_of = ci.conf.lib.clang_getCursorBinaryOperatorKind
        kind_of.argtypes, kind_of.restype = [ci.Cursor], ctypes.c_int
        snippet = "void f(int a, int b) { a <<= b; a >>= b; a = (a << b) + (a >> b) * (a < b); }\n"
        tu = ci.Index.create().parse("pk_snippet.cpp", args=["-x", "c++"], unsaved_files=[("pk_snippet.cpp", snippet)])
        K = ci.CursorKind
        found: dict[str, int] = {}
        for c in tu.cursor.walk_preorder():
            if c.kind in (K.BINARY_OPERATOR, K.COMPOUND_ASSIGNMENT_OPERATOR):
                kids = list(c.get_children())
                op = snippet[kids[0].extent.end.offset:kids[1].extent.start.offset].strip()
                found[op] = kind_of(c)
        wanted = {found[o] for o in ("<<", ">>", "<<=", ">>=")}
        if len(wanted) != 4 or found.get("<", -1) in wanted or found.get("=", -1) in wanted:
            return None
    except Exception:  # noqa: BLE001 -- older libclang: the text test alone
        return None
    return lambda c: kind_of(c) in wanted


def _literal(c, K):
    """The integer literal under implicit conversions / parentheses, if that is all there is."""
    while c.kind in (K.UNEXPOSED_EXPR, K.PAREN_EXPR):
        kids = list(c.get_children())
        if len(kids) != 1:
            return None
        c = kids[0]
    return c if c.kind == K.INTEGER_LITERAL else None


def _is_bitfield(c, K) -> bool:
    while c.kind in (K.UNEXPOSED_EXPR, K.PAREN_EXPR):
        kids = list(c.get_children())
        if len(kids) != 1:
            return False
        c = kids[0]
    if c.kind == K.MEMBER_REF_EXPR and c.referenced is not None:
        return bool(c.referenced.is_bitfield())
    return False
