"""Just enough of the C preprocessor to read a kernel's `__launch_bounds__` without a compiler.

The registry needs the thread limit of every kernel, also when it is spelled through macros
(`__launch_bounds__(FA_THREADS, ...)`, `#define PK_THREADS (4 * 32)`, or a function-like
`PK_BOUNDS(128, 1)` that expands to `__launch_bounds__(...)`). This module collects the `#define`s
of a source and the headers it includes, expands identifiers and evaluates integer constant
expressions. Anything it cannot do exactly (a name defined twice with different bodies, `#`/`##`,
casts, constexpr variables) yields None, never a guess: the compiler's PTX check reports it.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)(\([^)]*\))?(.*)$", re.M)
_TOKEN = re.compile(r"[A-Za-z_]\w*|\d[\w.]*|<<|>>|\S")
_INT_SUFFIX = re.compile(r"^(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9]\d*)([uU]?[lL]{0,2}|[lL]{0,2}[uU]?)$")
_MAX_DEPTH = 32


class Unresolved(Exception):
    """The expression uses something this subset of the preprocessor does not handle."""


@dataclass(frozen=True)
class Macro:
    params: tuple[str, ...] | None  # None: object-like
    body: str


# A name defined more than once with different bodies (e.g. under #if): its value depends on
# conditions this module does not evaluate, so it is treated as unknown.
AMBIGUOUS = Macro(None, "\0ambiguous")


def collect(texts: Iterable[str]) -> dict[str, Macro]:
    """Every `#define` of the given texts (a source and its headers); conflicting ones are AMBIGUOUS."""
    out: dict[str, Macro] = {}
    for text in texts:
        text = _COMMENT.sub(" ", text.replace("\\\r\n", " ").replace("\\\n", " "))
        for m in _DEFINE.finditer(text):
            name, params, body = m.group(1), m.group(2), m.group(3).strip()
            plist = None if params is None else tuple(p.strip() for p in params[1:-1].split(",") if p.strip())
            macro = Macro(plist, body)
            if name in out and out[name] != macro:
                out[name] = AMBIGUOUS
            else:
                out[name] = macro
    return out


def _split_args(tokens: list[str], i: int) -> tuple[list[list[str]], int]:
    """Arguments of a call whose "(" is tokens[i]: (args, index after the closing ")")."""
    depth, args, cur = 0, [], []
    for j in range(i, len(tokens)):
        t = tokens[j]
        if t == "(":
            depth += 1
            if depth == 1:
                continue
        elif t == ")":
            depth -= 1
            if depth == 0:
                args.append(cur)
                return args, j + 1
        elif t == "," and depth == 1:
            args.append(cur)
            cur = []
            continue
        cur.append(t)
    raise Unresolved("unbalanced parentheses")


def expand(text: str, macros: Mapping[str, Macro]) -> list[str]:
    """The tokens of `text` with every known macro expanded (rescanned, no self-recursion)."""
    text = text.replace("\\\r\n", " ").replace("\\\n", " ")  # line splices, as in translation phase 2
    return _expand(_TOKEN.findall(text), macros, frozenset(), 0)


def _expand(tokens: list[str], macros: Mapping[str, Macro], hidden: frozenset[str], depth: int) -> list[str]:
    if depth > _MAX_DEPTH:
        raise Unresolved("macro expansion too deep")
    out: list[str] = []
    i = 0
    while i < len(tokens):
        t = tokens[i]
        m = macros.get(t)
        if m is None or t in hidden:
            out.append(t)
            i += 1
            continue
        if m is AMBIGUOUS or "#" in m.body:
            # Left as the bare name: an error only if the value is needed (eval_int names it), so an
            # ambiguous min-blocks argument does not hide a plain thread count beside it.
            out.append(t)
            i += 1
            continue
        if m.params is None:
            out += _expand(_TOKEN.findall(m.body), macros, hidden | {t}, depth + 1)
            i += 1
            continue
        if i + 1 >= len(tokens) or tokens[i + 1] != "(":
            out.append(t)  # a function-like macro's name without a call is left alone, as in C
            i += 1
            continue
        args, i = _split_args(tokens, i + 1)
        if args == [[]] and not m.params:
            args = []
        if len(args) != len(m.params):
            raise Unresolved(f"{t} expects {len(m.params)} arguments, got {len(args)}")
        # Arguments are fully expanded before substitution (no # or ## here, so that is what C does).
        values = {p: _expand(a, macros, hidden, depth + 1) for p, a in zip(m.params, args)}
        body = [tok for bt in _TOKEN.findall(m.body) for tok in values.get(bt, [bt])]
        out += _expand(body, macros, hidden | {t}, depth + 1)
    return out


_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: _c_div(a, b),
    ast.Mod: lambda a, b: a - b * _c_div(a, b),
    ast.LShift: lambda a, b: a << b,
    ast.RShift: lambda a, b: a >> b,
    ast.BitAnd: lambda a, b: a & b,
    ast.BitOr: lambda a, b: a | b,
    ast.BitXor: lambda a, b: a ^ b,
}
_UNOPS = {ast.USub: lambda a: -a, ast.UAdd: lambda a: a, ast.Invert: lambda a: ~a}


def _c_div(a: int, b: int) -> int:
    if b == 0:
        raise Unresolved("division by zero")
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q  # C truncates toward zero


def eval_int(tokens: list[str]) -> int:
    """The value of an integer constant expression (literals, + - * / % << >> & | ^ ~, parentheses)."""
    py = []
    for t in tokens:
        if t[0].isdigit():
            m = _INT_SUFFIX.match(t)
            if m is None:
                raise Unresolved(f"not an integer literal: {t}")
            lit = m.group(1)
            py.append(str(int(lit, 8)) if len(lit) > 1 and lit[0] == "0" and lit[1] not in "xX" else str(int(lit, 0)))
        elif t in ("+", "-", "*", "/", "%", "&", "|", "^", "~", "(", ")", "<<", ">>"):
            py.append(t)
        else:  # an unknown name, a macro defined twice differently, a cast, a constexpr variable, ...
            raise Unresolved(f"cannot evaluate {t!r} to an integer")
    src = " ".join(py)
    try:
        node = ast.parse(src, mode="eval").body
    except SyntaxError:
        raise Unresolved(f"cannot evaluate {' '.join(tokens)!r}") from None
    return _eval(node)


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_eval(node.operand))
    raise Unresolved(f"unsupported expression {ast.dump(node)}")


def launch_bounds(attrs: str, macros: Mapping[str, Macro]) -> int | None:
    """maxThreadsPerBlock of the `__launch_bounds__(...)` that `attrs` (the words between `__global__`
    and the kernel's name) spells or expands to; None when there is none. Raises Unresolved."""
    tokens = expand(attrs, macros)
    for i, t in enumerate(tokens):
        if t == "__launch_bounds__" and i + 1 < len(tokens) and tokens[i + 1] == "(":
            args, _ = _split_args(tokens, i + 1)
            if not args or not args[0]:
                raise Unresolved("__launch_bounds__ without arguments")
            return eval_int(args[0])
    return None
