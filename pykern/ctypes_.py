"""The C types a kernel parameter may have: ctypes class, value range, size/alignment, accepted array dtypes."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass


@dataclass(frozen=True)
class ScalarType:
    name: str
    ctype: type
    kind: str  # "int" | "float" | "bool" | "vector"
    lo: float
    hi: float
    align_: int = 0  # 0: the size (every scalar); CUDA's vector types set their own (float3: 12 bytes, align 4)
    component: str = ""  # vector types: the C type of .x/.y/.z/.w
    count: int = 1  # vector types: how many components

    @property
    def size(self) -> int:
        return ctypes.sizeof(self.ctype)

    @property
    def align(self) -> int:
        return self.align_ or self.size


def _int(name: str, ct: type, signed: bool) -> ScalarType:
    bits = ctypes.sizeof(ct) * 8
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    return ScalarType(name, ct, "int", lo, hi)


_FLT_MAX = 3.4028234663852886e38
SCALARS: dict[str, ScalarType] = {
    "float": ScalarType("float", ctypes.c_float, "float", -_FLT_MAX, _FLT_MAX),
    "double": ScalarType("double", ctypes.c_double, "float", float("-inf"), float("inf")),
    "bool": ScalarType("bool", ctypes.c_bool, "bool", 0, 1),
    "char": _int("char", ctypes.c_int8, True),
    "signed char": _int("signed char", ctypes.c_int8, True),
    "unsigned char": _int("unsigned char", ctypes.c_uint8, False),
    "short": _int("short", ctypes.c_int16, True),
    "unsigned short": _int("unsigned short", ctypes.c_uint16, False),
    "int": _int("int", ctypes.c_int32, True),
    "unsigned int": _int("unsigned int", ctypes.c_uint32, False),
    "long long": _int("long long", ctypes.c_int64, True),
    "unsigned long long": _int("unsigned long long", ctypes.c_uint64, False),
}


def _vector(name: str, comp: str, count: int, align: int) -> ScalarType:
    # CUDA's vector_types.h: float2 is 8-byte aligned, float4/int4/uint4 16, float3/int3 only their
    # component's alignment. By value the launcher passes a ctypes structure of the components.
    base = SCALARS[comp]
    fields = [(c, base.ctype) for c in "xyzw"[:count]]
    struct = type(f"pk_{name}", (ctypes.Structure,), {"_fields_": fields})
    return ScalarType(name, struct, "vector", base.lo, base.hi, align, comp, count)


# (component, per-count alignment) as in CUDA's vector_types.h; 3-vectors align like their component.
_VECTORS = {
    "char": ("signed char", {1: 1, 2: 2, 3: 1, 4: 4}),
    "uchar": ("unsigned char", {1: 1, 2: 2, 3: 1, 4: 4}),
    "short": ("short", {1: 2, 2: 4, 3: 2, 4: 8}),
    "ushort": ("unsigned short", {1: 2, 2: 4, 3: 2, 4: 8}),
    "int": ("int", {1: 4, 2: 8, 3: 4, 4: 16}),
    "uint": ("unsigned int", {1: 4, 2: 8, 3: 4, 4: 16}),
    "float": ("float", {1: 4, 2: 8, 3: 4, 4: 16}),
    "longlong": ("long long", {1: 8, 2: 16, 3: 8, 4: 16}),
    "ulonglong": ("unsigned long long", {1: 8, 2: 16, 3: 8, 4: 16}),
    "double": ("double", {1: 8, 2: 16, 3: 8, 4: 16}),
}
VECTORS: dict[str, ScalarType] = {
    f"{stem}{n}": _vector(f"{stem}{n}", comp, n, aligns[n])
    for stem, (comp, aligns) in _VECTORS.items() for n in (1, 2, 3, 4)
}
SCALARS.update(VECTORS)
# The 16-bit floats are distinct C types (2-byte structs of raw bits, see kernels_cu/pk_common.cuh): a
# pointer to one takes only its own dtype, so a bf16 array never reaches an f16 kernel. By value they
# travel as their raw 16-bit word, as they always have.
SCALARS["__half"] = ScalarType("__half", ctypes.c_uint16, "int", 0, 0xFFFF)
SCALARS["__nv_bfloat16"] = ScalarType("__nv_bfloat16", ctypes.c_uint16, "int", 0, 0xFFFF)


class TensorMapBytes(ctypes.Structure):
    """A CUtensorMap by value: 128 opaque bytes (the kernel's `const __grid_constant__ CUtensorMap`)."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


# TMA descriptors travel by value: 128 bytes, 64-byte aligned (pykern.tensormap makes them).
SCALARS["CUtensorMap"] = ScalarType("CUtensorMap", TensorMapBytes, "tensormap", 0, 0, 64)

# Spellings that mean the same type; the registry canonicalizes to the key's value.
ALIASES: dict[str, str] = {
    "unsigned": "unsigned int",
    "signed": "int",
    "signed int": "int",
    "long long int": "long long",
    "signed long long": "long long",
    "unsigned long long int": "unsigned long long",
    "short int": "short",
    "unsigned short int": "unsigned short",
    "size_t": "unsigned long long",
    "int8_t": "signed char",
    "uint8_t": "unsigned char",
    "int16_t": "short",
    "uint16_t": "unsigned short",
    "int32_t": "int",
    "uint32_t": "unsigned int",
    "int64_t": "long long",
    "uint64_t": "unsigned long long",
    "half": "__half",
    "nv_bfloat16": "__nv_bfloat16",
}

# Array dtypes (numpy dtype names) accepted for a pointer to each C type. The 16-bit floats take their
# own dtype or raw uint16 words; `unsigned short*` (the raw-word spelling of bf16 that older kernels
# use) takes uint16 and ml_dtypes.bfloat16, as it always has.
POINTEE_DTYPES: dict[str, tuple[str, ...]] = {
    "float": ("float32",),
    "double": ("float64",),
    "bool": ("bool",),
    "char": ("int8",),
    "signed char": ("int8",),
    "unsigned char": ("uint8",),
    "short": ("int16",),
    "unsigned short": ("uint16", "bfloat16"),
    "__half": ("float16", "uint16"),
    "__nv_bfloat16": ("bfloat16", "uint16"),
    "int": ("int32",),
    "unsigned int": ("uint32",),
    "long long": ("int64",),
    "unsigned long long": ("uint64",),
}
# A pointer to a vector type takes an array of its component's dtype (float4* <- float32, 4 per element).
POINTEE_DTYPES.update({name: POINTEE_DTYPES[v.component] for name, v in VECTORS.items()})

# CUDA array interface typestr (without byte order) for each accepted dtype name.
TYPESTR: dict[str, str] = {
    "f4": "float32", "f8": "float64", "b1": "bool", "i1": "int8", "u1": "uint8",
    "i2": "int16", "u2": "uint16", "i4": "int32", "u4": "uint32", "i8": "int64", "u8": "uint64",
    "f2": "float16", "V2": "bfloat16",
}

POINTER_SIZE = 8


def size_align(ctype: str) -> tuple[int, int]:
    """Size and alignment in bytes of a parameter of this (canonical) C type."""
    if ctype.endswith("*"):
        return POINTER_SIZE, POINTER_SIZE
    t = SCALARS[ctype]
    return t.size, t.align
