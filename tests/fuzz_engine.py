"""The bad-input fuzzer's engine: builds a valid call from an op's spec, mutates one argument, judges the result.

An op's spec (tests/fuzz_specs.py) gives each parameter of its signature a role and a builder of one valid
call. The engine draws (with hypothesis) one parameter and one input class that fits its role, replaces that
argument, calls the op on the host backend and accepts exactly two outcomes:

- an ArgumentError / ArgumentTypeError whose message names the mutated parameter, or
- a result that matches the op's float64 reference on the mutated inputs (pykern/tolerance.py's entry;
  NaN positions must match), with every input unchanged and no byte written next to any array.

Every other outcome fails: another exception type, a wrong result, a changed input, a write into the guard
bytes placed around each NumPy argument. A hang is caught by a faulthandler watchdog that ends the process
with a traceback; a crash ends it too (pytest reports the worker as lost).
"""
from __future__ import annotations

import faulthandler
import fnmatch
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from pykern.errors import ArgumentError, ArgumentTypeError
from pykern.tolerance import TOLERANCES

# --------------------------------------------------------------------------- roles
# A parameter's role says which input classes can be drawn for it (the keys of MUTATIONS below).
FARRAY = "farray"    # float array (data, weights, scores)
PROB = "prob"        # probabilities: a float array or scalar in [0, 1]
IARRAY = "iarray"    # integer array of ids / positions / lengths (values bounded by another argument)
PTABLE = "ptable"    # page table / CSR pointers (kv_indptr, kv_indices, cu_seqlens, offsets)
LENGTH = "length"    # an int size / length / count, or the same as an integer array
INT = "int"          # an int that may be negative (offsets, window sides, pad ids)
FLOAT = "float"      # a float scalar (eps, scale, softcap)
ENUM = "enum"        # one of a few strings
BOOL = "bool"        # a flag
OUT = "out"          # a caller-provided output buffer
FIXED = "fixed"      # not fuzzed: stream, backend, generator, plan objects, `like`

ROLES = (FARRAY, PROB, IARRAY, PTABLE, LENGTH, INT, FLOAT, ENUM, BOOL, OUT, FIXED)


@dataclass
class Spec:
    """One public callable: its valid call, the roles of its parameters, its reference."""

    name: str                                   # "rms_norm", "PagedDecodePlan.run", "torch.rms_norm"
    fn: Callable[..., Any] | None               # None: `call` does the call (methods, constructors)
    build: Callable[[np.random.Generator], dict[str, Any]]  # a valid call's keyword arguments
    roles: dict[str, str]                       # every signature parameter -> role
    ref: Callable[[dict[str, Any]], Any] | None = None  # float64 reference of the (mutated) call
    check: Callable[[dict[str, Any], Any], None] | None = None  # or a property of the result
    tol: str | None = None                      # op name in pykern/tolerance.py (default: name)
    kind_of: str | None = None                  # the argument whose dtype picks the tolerance row
    writes: Callable[[dict[str, Any]], tuple[str, ...]] = lambda kw: ("out",)  # arguments the call may write
    call: Callable[[dict[str, Any]], Any] | None = None  # how to call when fn is None
    signature_of: Callable[..., Any] | None = None  # whose signature the roles must cover (default fn)
    torch: bool = False                         # arrays are passed as CPU torch tensors
    examples: float = 1                         # weight of this op in the example budget (slow ops < 1)


# Defects this fuzzer found that are not fixed yet (docs/fuzzing.md lists them): skipped, so
# the suite stays green; delete an entry with its fix, and the fuzzer checks that class again.
OPEN_DEFECTS: list[tuple[str, str, str, str]] = [
    # The attention kernels take the running max with fmaxf, which drops NaN: a row whose scores are all
    # NaN (a NaN in q) is taken for a row that sees no key and gives out 0 / lse -inf instead of NaN.
    ("flash_attention", "q", "nan", "NaN q gives 0"),
    ("torch.flash_attention", "q", "nan", "NaN q gives 0"),
    ("flash_attention_varlen", "q", "nan", "NaN q gives 0"),
    ("torch.flash_attention_varlen", "q", "nan", "NaN q gives 0"),
    ("torch.flash_attention_varlen", "q", "inf", "lse -inf where out is NaN"),
    ("*decode_attention", "q", "nan", "NaN q gives 0"),
    ("PagedDecodePlan.run", "q", "nan", "NaN q gives 0"),
    ("paged_prefill_attention", "q", "nan", "NaN q gives 0"),
    # and lse = l > 0 ? ... : -inf turns a NaN row sum into -inf (out is NaN there, lse says "no key")
    ("flash_attention", "k", "nan", "lse -inf where out is NaN"),
    ("flash_attention", "k", "inf", "lse -inf where out is NaN"),
    ("flash_attention*", "q", "inf", "lse -inf where out is NaN"),
    ("*decode_attention", "q", "inf", "inf q gives 0"),
    ("PagedDecodePlan.run", "q", "inf", "inf q gives 0"),
    ("paged_prefill_attention", "q", "inf", "inf q gives 0"),
    # a NaN / inf in the pages: lse -inf where the math gives NaN, and where a plan splits the keys, the
    # merge weights that split by exp(-inf) = 0: out 0 instead of NaN
    ("paged_decode_attention", "[kv]_pages", "nan", "NaN pages give lse -inf / out 0"),
    ("paged_decode_attention", "[kv]_pages", "inf", "inf pages give lse -inf / out 0"),
    ("PagedDecodePlan.run", "[kv]_pages", "nan", "NaN pages give lse -inf / out 0"),
    ("PagedDecodePlan.run", "[kv]_pages", "inf", "inf pages give lse -inf / out 0"),
    # attention_backward: a NaN in q or k gives dk = +-inf or finite dv where the math gives NaN
    ("attention_backward", "*", "nan", "NaN not propagated to dq / dk / dv"),
    ("attention_backward", "*", "inf", "inf not propagated like NaN"),
    # flash_attention_varlen_backward runs the same kernels (the tensor-core ones): the same NaN / inf handling
    ("flash_attention_varlen_backward", "*", "nan", "NaN not propagated to dq / dk / dv"),
    ("flash_attention_varlen_backward", "*", "inf", "inf not propagated like NaN"),
    # moe_experts_backward: an inf in the expert weights gives NaN weight-gradient entries the math keeps
    # finite (0 * inf from the zero rows that pad each expert's group to the GEMM tile, presumably)
    ("moe_experts_backward", "gate_up_proj", "inf", "padding rows turn inf weights into NaN gradients"),
    ("moe_experts_backward", "down_proj", "inf", "padding rows turn inf weights into NaN gradients"),
    # shared_prefix_decode is flash_attention over the prefix and paged decode over the suffixes, merged: their
    # NaN drops above reach it (a NaN / inf state taken for an empty one, which the merge then weighs by 0)
    ("shared_prefix_decode", "q", "nan", "NaN q gives 0"),
    ("shared_prefix_decode", "q", "inf", "inf q gives 0"),
    ("shared_prefix_decode", "k_shared", "nan", "lse -inf where out is NaN: the merge drops the prefix"),
    ("shared_prefix_decode", "k_shared", "inf", "lse -inf where out is NaN: the merge drops the prefix"),
    ("shared_prefix_decode", "[kv]_pages", "nan", "NaN pages give lse -inf: the merge drops the suffix"),
    ("shared_prefix_decode", "[kv]_pages", "inf", "inf pages give lse -inf: the merge drops the suffix"),
    # MLA decode (mla.cu) shares the tensor-core online softmax: a NaN / inf score row gives lse -inf (out 0
    # with an inf q, NaN out with a NaN) instead of NaN
    ("MLAPagedDecodePlan.run*", "q_*", "nan", "NaN scores give lse -inf"),
    ("MLAPagedDecodePlan.run*", "q_*", "inf", "inf q gives lse -inf / out 0"),
    ("MLAPagedDecodePlan.run*", "*_cache", "nan", "NaN keys give lse -inf"),
    ("MLAPagedDecodePlan.run*", "*_cache", "inf", "inf keys give lse -inf"),
]


def known_elsewhere(op: str, param: str, cls: str) -> str | None:
    for o, p, c, why in OPEN_DEFECTS:
        if fnmatch.fnmatchcase(op, o) and fnmatch.fnmatchcase(param, p) and fnmatch.fnmatchcase(cls, c):
            return why
    return None


# --------------------------------------------------------------------------- array helpers
GUARD = 256  # bytes of guard pattern before and after each NumPy argument
PATTERN = 0xA5


class Guarded:
    """A NumPy array placed inside a buffer of guard bytes (and, for a strided array, with the gaps between
    its elements guarded too)."""

    def __init__(self, a: np.ndarray) -> None:
        lo, hi = np.lib.array_utils.byte_bounds(a)
        span = hi - lo
        self.raw = np.full(span + 2 * GUARD, PATTERN, np.uint8)
        first = a.__array_interface__["data"][0] - lo  # offset of element [0,...] from the low bound
        self.view = np.ndarray(a.shape, a.dtype, buffer=self.raw, offset=GUARD + first, strides=a.strides)
        self.view[...] = 0 if a.dtype != np.bool_ else False
        self.element = self.raw != PATTERN  # the bytes of elements (all 0 now), the rest is guard
        if a.size and not self.element.any():
            self.element[:] = False
        self.view[...] = a
        self.element_bytes = self.raw[self.element].copy()

    def guard_intact(self) -> bool:
        return bool((self.raw[~self.element] == PATTERN).all())

    def unchanged(self) -> bool:
        return bool((self.raw[self.element] == self.element_bytes).all())


def is_array(a: Any) -> bool:
    return isinstance(a, np.ndarray) or type(a).__module__.split(".")[0] == "torch" and hasattr(a, "dtype")


def to_numpy(a: Any) -> Any:
    """A NumPy array of a torch tensor (bf16 as float32; a meta tensor stays a meta tensor)."""
    if type(a).__module__.split(".")[0] == "torch" and hasattr(a, "detach"):
        import torch

        if a.is_meta:
            return a
        t = a.detach().cpu()
        if t.dtype == torch.bfloat16:
            t = t.float()
        if t.dtype == torch.float8_e4m3fn:  # (NumPy has no such dtype: ml_dtypes' over the same bytes)
            import ml_dtypes

            return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).copy()
        return t.numpy().copy()
    if isinstance(a, (list, tuple)):
        return type(a)(to_numpy(x) for x in a)
    return a


def to_torch(a: Any) -> Any:
    import torch

    if isinstance(a, np.ndarray):
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        if a.dtype.name == "float8_e4m3fn":
            return torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
        if a.dtype == np.uint64 or a.dtype.kind not in "biuf":
            return a
        return torch.from_numpy(a)
    if isinstance(a, tuple):
        return tuple(to_torch(x) for x in a)
    return a


def snapshot(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        return a.copy()
    if type(a).__module__.split(".")[0] == "torch" and hasattr(a, "clone") and not a.is_meta:
        return a.detach().clone()
    if isinstance(a, (list, tuple)):
        return type(a)(snapshot(x) for x in a)
    return None


def same_bits(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return all(same_bits(x, y) for x, y in zip(a, b) if y is not None)
    if b is None:
        return True
    import torch

    ta, tb = a.detach().contiguous().reshape(-1), b.contiguous().reshape(-1)
    if ta.shape != tb.shape or ta.dtype != tb.dtype:
        return False
    return ta.numel() == 0 or torch.equal(ta.view(torch.uint8), tb.view(torch.uint8))


# --------------------------------------------------------------------------- input classes
class Draw:
    """hypothesis's `data.draw` behind a small interface (so the engine also runs without hypothesis)."""

    def __init__(self, data: Any) -> None:
        from hypothesis import strategies as st

        self.st = st
        self.data = data

    def pick(self, seq: list[Any] | tuple[Any, ...], label: str) -> Any:
        return self.data.draw(self.st.sampled_from(list(seq)), label=label)

    def integer(self, lo: int, hi: int, label: str) -> int:
        return self.data.draw(self.st.integers(lo, hi), label=label)


def _float_classes(v: Any) -> list[str]:
    return ["dtype:float64", "dtype:int32", "dtype:bool", "rank+1", "rank-1", "shape", "empty", "strided",
            "nan", "inf", "neg", "kind:torch", "device:meta", "pytype:str", "pytype:none", "pytype:list"]


def _int_array_classes(v: Any) -> list[str]:
    return ["dtype:float32", "dtype:uint64", "rank+1", "rank-1", "shape", "empty", "strided", "index:neg",
            "index:bound", "index:2**31", "index:2**63-1", "kind:torch", "device:meta", "pytype:str",
            "pytype:none", "pytype:list"]


INT_CLASSES = ["int:neg", "int:zero", "int:one", "int:2**31", "int:2**63", "int:2**64", "int:-2**63-1",
               "pytype:float", "pytype:str", "pytype:none", "pytype:list", "int:numpy-uint64"]
FLOAT_CLASSES = ["float:nan", "float:inf", "float:-inf", "float:neg", "float:zero", "float:1e300",
                 "pytype:str", "pytype:list", "pytype:complex"]
ENUM_CLASSES = ["enum:bad", "enum:case", "pytype:none", "pytype:int"]
BOOL_CLASSES = ["pytype:str", "pytype:int2", "pytype:list"]


def classes_for(role: str, v: Any) -> list[str]:
    """The input classes that fit a parameter of this role whose valid value is v."""
    if role == FIXED:
        return []
    if role == ENUM:
        return ENUM_CLASSES
    if role == BOOL:
        return BOOL_CLASSES
    if v is None:
        return ["pytype:str", "pytype:list"] if role != OUT else ["pytype:str", "pytype:list"]
    if is_array(v):
        kind = np.asarray(to_numpy(v)).dtype.kind if not _is_meta(v) else "f"
        return _int_array_classes(v) if kind in "iu" else _float_classes(v)
    if isinstance(v, (bool, np.bool_)):
        return BOOL_CLASSES
    if isinstance(v, (int, np.integer)):
        return INT_CLASSES
    if isinstance(v, (float, np.floating)):
        return FLOAT_CLASSES
    if isinstance(v, str):
        return ENUM_CLASSES
    if isinstance(v, (tuple, list)):
        return ["pytype:none", "tuple:len", "tuple:nan", "tuple:huge"] + (["pytype:str"] if role != OUT else [])
    return []


def _is_meta(a: Any) -> bool:
    return getattr(a, "is_meta", False) is True


def mutate(cls: str, v: Any, draw: Draw, rng: np.random.Generator, spec: Spec, param: str) -> Any:
    """The value of class `cls` derived from the valid value v (a NumPy array, or a torch tensor for torch
    specs, a scalar, a string, ...)."""
    was_torch = not isinstance(v, np.ndarray) and is_array(v)
    a = to_numpy(v) if is_array(v) else v
    if cls == "pytype:str":
        return "bad"
    if cls == "pytype:none":
        return None
    if cls == "pytype:list":
        return a.tolist() if isinstance(a, np.ndarray) and a.dtype.name != "bfloat16" else [1, 2]
    if cls == "pytype:int":
        return 3
    if cls == "pytype:int2":
        return 2
    if cls == "pytype:float":
        return float(v) + 0.5
    if cls == "pytype:complex":
        return complex(1, 1)
    if cls == "enum:bad":
        return "no_such_" + str(v)
    if cls == "enum:case":
        return str(v).upper() if str(v).upper() != str(v) else str(v).lower() + "_"
    if cls.startswith("int:"):
        return {"int:neg": -1 - int(v) if int(v) > 0 else -1, "int:zero": 0, "int:one": 1, "int:2**31": 2**31,
                "int:2**63": 2**63, "int:2**64": 2**64, "int:-2**63-1": -2**63 - 1,
                "int:numpy-uint64": np.uint64(2**64 - 1)}[cls]
    if cls.startswith("float:"):
        return {"float:nan": float("nan"), "float:inf": float("inf"), "float:-inf": float("-inf"),
                "float:neg": -abs(float(v)) - 1.0, "float:zero": 0.0, "float:1e300": 1e300}[cls]
    if cls.startswith("tuple:"):
        if cls == "tuple:len":
            return tuple(v) + (tuple(v)[:1] or (0,))
        if cls == "tuple:nan":
            return (float("nan"),) + tuple(v)[1:]
        return (2**63,) + tuple(v)[1:]
    # array classes
    assert isinstance(a, np.ndarray), (param, cls, type(v))
    out = _mutate_array(cls, a, draw, rng, param)
    if cls == "kind:torch":
        return out if was_torch else to_torch(out)
    if cls == "device:meta":
        return out
    return to_torch(out) if was_torch and isinstance(out, np.ndarray) else out


def _mutate_array(cls: str, a: np.ndarray, draw: Draw, rng: np.random.Generator, param: str) -> Any:
    if cls.startswith("dtype:"):
        return a.astype(cls[6:]) if cls != "dtype:uint64" else np.abs(a.astype(np.int64)).astype(np.uint64)
    if cls == "rank+1":
        return np.stack([a, a])
    if cls == "rank-1":
        return a[0] if a.ndim else a.reshape(1)
    if cls in ("shape", "empty"):
        if a.ndim == 0:
            return a.reshape(1)
        axis = draw.integer(0, a.ndim - 1, "axis")
        if cls == "empty":
            return np.take(a, np.arange(0), axis=axis)
        if draw.pick(["+1", "-1"], "delta") == "-1" and a.shape[axis] > 1:
            return np.take(a, np.arange(a.shape[axis] - 1), axis=axis)
        extra = np.take(a, np.arange(min(1, a.shape[axis])), axis=axis)
        if extra.shape[axis] == 0:
            extra = np.zeros(a.shape[:axis] + (1,) + a.shape[axis + 1:], a.dtype)
        return np.concatenate([a, extra], axis=axis)
    if cls == "strided":
        if a.ndim == 0:
            return a
        axis = draw.integer(0, a.ndim - 1, "axis")
        big = np.repeat(a, 2, axis=axis)
        return big[(slice(None),) * axis + (slice(None, None, 2),)]  # same values, stride 2 along axis
    if cls == "kind:torch":
        return a
    if cls == "device:meta":
        import torch

        t = to_torch(a)
        return t.to("meta") if hasattr(t, "to") else t
    b = a.copy()
    if b.size == 0:
        return b
    flat = b.reshape(-1)
    i = draw.integer(0, flat.size - 1, "element")
    if cls in ("nan", "inf", "neg"):
        # (the ml_dtypes floats are kind "V"; float8_e4m3fn has no inf: an inf entry becomes its NaN)
        if b.dtype.kind != "f" and b.dtype.name not in ("bfloat16", "float8_e4m3fn"):
            flat[i] = -1 if b.dtype.kind == "i" else flat[i]
        else:
            flat[i] = {"nan": np.nan, "inf": np.inf, "neg": -abs(float(flat[i])) - 0.5}[cls]
        return b
    if cls.startswith("index:"):
        if cls == "index:neg":
            flat[i] = -1 if b.dtype.kind == "i" else flat[i]
            return b
        big = {"index:bound": None, "index:2**31": 2**31, "index:2**63-1": 2**63 - 1}[cls]
        if big is None:
            big = int(np.asarray(a).max()) + 1000 if a.size else 1000
        info = np.iinfo(b.dtype)
        if big > info.max:
            b = b.astype(np.int64)
            flat = b.reshape(-1)
        flat[i] = big
        return b
    raise AssertionError(f"unknown input class {cls}")


# --------------------------------------------------------------------------- the oracle
def names_param(msg: str, param: str, aliases: tuple[str, ...] = ()) -> bool:
    return any(p in msg for p in (param,) + aliases)


def compare(op: str, kind: str, got: Any, want: Any, where: str = "result") -> None:
    """got (the op's result, any kind) against want (float64 reference): same structure, NaN at the same
    places, |got - want| <= atol + rtol |want| elsewhere (pykern/tolerance.py's row for (op, kind))."""
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), \
            f"{where}: expected {len(want)} results, got {type(got).__name__} {got!r:.200}"
        for i, (g, w) in enumerate(zip(got, want)):
            compare(op, kind, g, w, f"{where}[{i}]")
        return
    if want is None:
        assert got is None, f"{where}: expected None, got {type(got).__name__}"
        return
    if isinstance(want, (dict, str)):
        assert got == want, f"{where}: expected {want}, got {got}"
        return
    g = np.asarray(to_numpy(got))
    if isinstance(want, np.ma.MaskedArray):  # masked entries are unspecified by the op's contract
        keep = ~np.ma.getmaskarray(want)
        assert g.shape == want.shape, f"{where}: expected shape {want.shape}, got {g.shape}"
        g, want = g[keep], want.data[keep]
    w = np.asarray(want)
    assert g.shape == w.shape, f"{where}: expected shape {w.shape}, got {g.shape}"
    if w.dtype.kind in "iub" or g.dtype.kind in "iub":
        assert np.array_equal(g.astype(np.int64), w.astype(np.int64)), f"{where}: expected {w}, got {g}"
        return
    atol, rtol = TOLERANCES.get((op, kind), TOLERANCES.get((op, "f32"), (0.0, 0.0)))
    g = g.astype(np.float64)
    w = w.astype(np.float64)
    gn, wn = np.isnan(g), np.isnan(w)
    assert (gn == wn).all(), f"{where}: NaN at {np.argwhere(gn != wn)[:5].tolist()} differ (got {g[gn != wn][:5]})"
    fin = ~wn
    ginf, winf = np.isinf(g) & fin, np.isinf(w) & fin
    assert (g[winf] == w[winf]).all() and (ginf == winf).all(), f"{where}: infinities differ"
    ok = fin & ~winf
    err = np.abs(g[ok] - w[ok]) - (atol + rtol * np.abs(w[ok]))
    assert (err <= 0).all(), (f"{where}: max excess {err.max():.3g} over atol {atol} rtol {rtol} "
                              f"(op {op}, {kind})")


def io_kind_of(a: Any) -> str:
    if a is None:
        return "f32"
    name = str(getattr(a, "dtype", "")).replace("torch.", "")
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(name, "f32")


@dataclass
class Outcome:
    param: str
    cls: str
    what: str          # "error" | "result" | "skipped"
    detail: str = ""


def signature_params(spec: Spec) -> list[str]:
    fn = spec.signature_of or spec.fn
    names = []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        names.append(p.name)
    return names


def run_case(spec: Spec, data: Any, watchdog_s: float = 120.0) -> Outcome:
    """One example: a valid call from the spec, one argument replaced by one input class, the oracle."""
    draw = Draw(data)
    seed = draw.integer(0, 2**31 - 1, "values")
    rng = np.random.default_rng(seed)
    kw = spec.build(rng)
    cands = [(p, c) for p in signature_params(spec) if p in kw
             for c in classes_for(spec.roles[p], kw[p])]
    cands = [(p, c) for p, c in cands if not known_elsewhere(spec.name, p, c)]
    if not cands:
        return Outcome("", "", "skipped", "nothing to mutate")
    param, cls = draw.pick(cands, "mutation")
    if spec.torch:
        kw = {k: to_torch(v) for k, v in kw.items()}
    kw[param] = mutate(cls, kw[param], draw, rng, spec, param)
    return call_and_judge(spec, kw, param, cls, watchdog_s)


def call_and_judge(spec: Spec, kw: dict[str, Any], param: str, cls: str, watchdog_s: float = 120.0) -> Outcome:
    # place every NumPy argument between guard bytes; a torch argument over a NumPy buffer is guarded too
    guards: dict[str, Guarded] = {}
    for k, v in list(kw.items()):
        if isinstance(v, np.ndarray) and v.size and v.dtype != object:
            g = Guarded(v)
            guards[k] = g
            kw[k] = g.view
        elif is_array(v) and not isinstance(v, np.ndarray) and not _is_meta(v) and v.numel():
            import torch

            if v.layout == torch.strided and v.device.type == "cpu" and not v.requires_grad \
                    and v.dtype not in (torch.bfloat16, torch.float8_e4m3fn) and all(s >= 0 for s in v.stride()) \
                    and v.dtype != torch.bool:
                base = v.numpy()
                g = Guarded(base)
                guards[k] = g
                kw[k] = torch.from_numpy(g.view)
    before = {k: snapshot(v) for k, v in kw.items()}
    writes = set(spec.writes(kw))
    faulthandler.dump_traceback_later(watchdog_s, exit=True)
    try:
        result = spec.call(kw) if spec.call is not None else spec.fn(**kw)
    except (ArgumentError, ArgumentTypeError) as e:
        msg = str(e)
        assert param and names_param(msg, param), (
            f"{spec.name}: {param} <- {cls}: {type(e).__name__} does not name {param!r}: {msg}")
        _check_untouched(spec, kw, before, guards, writes, param, cls)
        return Outcome(param, cls, "error", f"{type(e).__name__}: {msg[:160]}")
    except Exception as e:  # any other exception type is a defect: the oracle reports it with the input
        raise AssertionError(f"{spec.name}: {param} <- {cls}: raised {type(e).__name__}: {e}") from e
    finally:
        faulthandler.cancel_dump_traceback_later()
    _check_untouched(spec, kw, before, guards, writes, param, cls)
    # the reference sees the inputs as they were before the call (an in-place op has overwritten some)
    rkw = {k: to_numpy(before[k] if k in writes and before.get(k) is not None else v) for k, v in kw.items()}
    if spec.check is not None:
        try:
            spec.check(rkw, result)
        except AssertionError as e:
            raise AssertionError(f"{spec.name}: {param} <- {cls}: accepted, and {e}") from None
        return Outcome(param, cls, "result")
    try:
        with np.errstate(all="ignore"):  # NaN / inf inputs: the reference's arithmetic warns, as it should
            want = spec.ref(rkw)
    except AssertionError:
        raise
    except Exception as e:
        raise AssertionError(f"{spec.name}: {param} <- {cls}: accepted an input the float64 reference "
                             f"rejects ({type(e).__name__}: {e})") from None
    kind = io_kind_of(kw.get(spec.kind_of)) if spec.kind_of else "f32"
    try:
        compare(spec.tol or spec.name, kind, result, want)
    except AssertionError as e:
        raise AssertionError(f"{spec.name}: {param} <- {cls}: accepted, but {e}") from None
    return Outcome(param, cls, "result")


def _check_untouched(spec: Spec, kw: dict[str, Any], before: dict[str, Any], guards: dict[str, Guarded],
                     writes: set[str], param: str, cls: str) -> None:
    for k, g in guards.items():
        assert g.guard_intact(), f"{spec.name}: {param} <- {cls}: bytes next to argument {k!r} were written"
    for k, v in kw.items():
        if k in writes or before.get(k) is None:
            continue
        assert same_bits(v, before[k]), f"{spec.name}: {param} <- {cls}: input {k!r} was changed by the call"
