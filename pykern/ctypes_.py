"""The C types a kernel parameter may have: ctypes class, value range, size/alignment, accepted array dtypes."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass


@dataclass(frozen=True)
class ScalarType:
    name: str
    ctype: type
    kind: str  # "int" | "float" | "bool"
    lo: float
    hi: float

    @property
    def size(self) -> int:
        return ctypes.sizeof(self.ctype)


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
}

# Array dtypes (numpy dtype names) accepted for a pointer to each C type. bf16 travels
# as raw 16-bit words, so `unsigned short*` also takes ml_dtypes.bfloat16.
POINTEE_DTYPES: dict[str, tuple[str, ...]] = {
    "float": ("float32",),
    "double": ("float64",),
    "bool": ("bool",),
    "char": ("int8",),
    "signed char": ("int8",),
    "unsigned char": ("uint8",),
    "short": ("int16",),
    "unsigned short": ("uint16", "bfloat16"),
    "int": ("int32",),
    "unsigned int": ("uint32",),
    "long long": ("int64",),
    "unsigned long long": ("uint64",),
}

# CUDA array interface typestr (without byte order) for each accepted dtype name.
TYPESTR: dict[str, str] = {
    "f4": "float32", "f8": "float64", "b1": "bool", "i1": "int8", "u1": "uint8",
    "i2": "int16", "u2": "uint16", "i4": "int32", "u4": "uint32", "i8": "int64", "u8": "uint64",
    "V2": "bfloat16",
}

POINTER_SIZE = 8


def size_align(ctype: str) -> tuple[int, int]:
    """Size and alignment in bytes of a parameter of this (canonical) C type."""
    if ctype.endswith("*"):
        return POINTER_SIZE, POINTER_SIZE
    s = SCALARS[ctype].size
    return s, s
