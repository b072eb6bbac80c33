"""The layout rules of pykern/ops, read from the source with `ast` (nothing is imported):

- an op module never reaches into another family module's private names: what several families share lives in
  the private shared modules (`_common`, `_prefill`, `_window`, `_kvcache`, `_decode_waves`, `_attention_sm90`);
- an op never branches on NumPy vs torch vs CuPy itself: that knowledge lives in `pykern.arrays`.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

OPS = Path(__file__).resolve().parent.parent / "pykern" / "ops"

# Private names a family module may still take from another one: none (the attention family imports what it
# shares with the paged kernels from _prefill and the launch helpers from _common). Each entry would be
# (importer, source module, name).
ATTENTION_ALLOWED: set[tuple[str, str, str]] = set()


def _family(module: str) -> bool:
    """A family module of pykern.ops (not a private shared module)."""
    return not module.startswith("_")


def _ops_module(node: ast.ImportFrom, importer_pkg_level: int = 1) -> str | None:
    """The pykern.ops module an import takes names from ("training" for `from .training import x`), else None."""
    mod = node.module or ""
    if node.level == 1:
        return mod.split(".")[0] if mod else ""
    if node.level == 2 and mod.startswith("ops."):
        return mod.split(".")[1]
    if node.level == 0 and mod.startswith("pykern.ops."):
        return mod.split(".")[2]
    return None


def private_imports(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(source module, private name, line) of every private name taken from another op module: imported by
    name (`from .training import _launch`) or read through a module alias (`from . import forward as _fwd`,
    then `_fwd._x`)."""
    found: list[tuple[str, str, int]] = []
    aliases: dict[str, str] = {}  # local name -> family module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _ops_module(node)
            if src is None:
                continue
            for a in node.names:
                if src == "":  # from . import forward [as _fwd]
                    aliases[a.asname or a.name] = a.name
                elif _family(src) and a.name.startswith("_"):
                    found.append((src, a.name, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("pykern.ops.") and a.asname:
                    aliases[a.asname] = a.name.split(".")[2]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and _family(aliases[node.value.id]) and node.attr.startswith("_")):
            found.append((aliases[node.value.id], node.attr, node.lineno))
    return found


def layout_violations(ops_dir: Path) -> list[str]:
    out = []
    for path in sorted(ops_dir.glob("*.py")):
        importer = path.stem
        for src, name, line in private_imports(ast.parse(path.read_text(), str(path))):
            if src == importer or (importer, src, name) in ATTENTION_ALLOWED:
                continue
            out.append(f"{path.name}:{line}: takes the private {src}.{name} (move it to _common)")
    return out


def test_no_op_module_imports_another_family_s_private_names() -> None:
    assert layout_violations(OPS) == []


def test_the_private_import_check_sees_every_form(tmp_path: Path) -> None:
    # A check that cannot fail proves nothing: each form of reaching into a family is reported, a shared
    # private module is not.
    (tmp_path / "a.py").write_text(
        "from .training import _launch, rms_norm_backward\n"
        "from . import serving as _sv\n"
        "import pykern.ops.moe as moe\n"
        "from ..ops.decode import _flat\n"
        "from ._common import launch, _private_helper\n"
        "def f():\n"
        "    from .sampling import _unused\n"
        "    return _sv._index, _sv.PagedDecodePlan, moe._tc\n"
    )
    got = sorted(v.split(": takes the private ")[1].split(" ")[0] for v in layout_violations(tmp_path))
    assert got == ["decode._flat", "moe._tc", "sampling._unused", "serving._index", "training._launch"]


# --------------------------------------------------------------------------- array kinds

# Source patterns by which an op would tell NumPy, torch and CuPy apart itself.
KIND_PATTERNS = re.compile(
    r"isinstance\([^)]*np\.ndarray|arrays\.is_torch\(|is_torch_cuda\(|__cuda_array_interface__|^\s*import torch"
    r"|^\s*import cupy|from numba import cuda|__module__|torch_module\(\)|\.is_cuda\b",
    re.MULTILINE,
)

# How many such branches a module still holds. Each number may only go down (lower it when a branch moves to
# pykern.arrays); a module not listed holds none. They wait for a function of `arrays` of their own (a
# framework's matmul namespace for the fused linear cross-entropy, strided cache views, torch generators, a fill
# with a value).
KIND_BRANCHES_LEFT = {
    "_kvcache": 13,  # strided K/V cache views (shared by serving, decode, mla)
    "attention": 1,  # the fill of lse with -inf
    "decode": 7,
    "forward": 5,
    "gemm_fp8": 4,
    "mla": 3,
    "norm_act_loss": 1,  # the fused linear cross-entropy's targets beside a torch hidden
    "sampling": 7,  # torch generators' Philox state, torch's float-to-int truncation
    "serving": 4,  # the run memo's key of an array
}


def kind_branches(ops_dir: Path) -> dict[str, int]:
    counts = {}
    for path in sorted(ops_dir.glob("*.py")):
        n = len(KIND_PATTERNS.findall(path.read_text()))
        if n:
            counts[path.stem] = n
    return counts


@pytest.mark.parametrize("module", sorted(p.stem for p in OPS.glob("*.py")))
def test_ops_leave_array_kinds_to_arrays(module: str) -> None:
    n = kind_branches(OPS).get(module, 0)
    assert n <= KIND_BRANCHES_LEFT.get(module, 0), (
        f"pykern/ops/{module}.py tells NumPy / torch / CuPy apart in {n} places (at most "
        f"{KIND_BRANCHES_LEFT.get(module, 0)}): put the branch in a pykern.arrays function")


def test_the_kind_budget_names_only_modules_that_exist() -> None:
    # a renamed or removed module must leave the table too, or its budget would wait for the next one of its name
    assert sorted(set(KIND_BRANCHES_LEFT) - {p.stem for p in OPS.glob("*.py")}) == []


def test_the_kind_check_sees_each_pattern() -> None:
    src = ("if isinstance(a, np.ndarray): pass\nif arrays.is_torch(a): pass\nx = a.__cuda_array_interface__\n"
           "    import torch\nimport cupy\nfrom numba import cuda\nm = type(a).__module__\nt = arrays.torch_module()\n"
           "c = a.is_cuda\n")
    assert len(KIND_PATTERNS.findall(src)) == 9
