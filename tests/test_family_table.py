"""docs/internals.md's family table holds to the tree: every kernels_cu/*.cu in exactly one row, every public op
module, reference module and difftest case module in some row, and every file or glob a row names present."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# column -> the folder its names are relative to
FOLDERS = {"sources": "kernels_cu", "ops": "pykern/ops", "reference": "pykern/reference",
           "cases": "pykern/difftest/cases", "tests": "tests", "doc": "docs"}
SHARED_HEADERS = {"pk_common.cuh", "pk_ptx.cuh", "pk_vec.cuh"}  # every family's


def family_table() -> dict[str, dict[str, list[str]]]:
    text = (ROOT / "docs" / "internals.md").read_text()
    section = text.split("\n## Kernel families\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["family", *FOLDERS], head
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0]] = {col: re.findall(r"`([^`]+)`", cell) for col, cell in zip(head[1:], cells[1:])}
    return rows


def _files(folder: str, pattern: str) -> list[Path]:
    return sorted((ROOT / folder).glob(pattern))


def test_every_named_file_exists() -> None:
    missing = [f"{fam}: {col} {name}" for fam, row in family_table().items() for col, names in row.items()
               for name in names if not _files(FOLDERS[col], name)]
    assert not missing, missing
    assert all(row[col] for row in family_table().values() for col in FOLDERS), "a row with an empty column"


def test_every_source_in_exactly_one_row() -> None:
    owner: dict[str, list[str]] = {}
    for fam, row in family_table().items():
        for pattern in row["sources"]:
            for f in _files("kernels_cu", pattern):
                owner.setdefault(f.name, []).append(fam)
    sources = {f.name for f in (ROOT / "kernels_cu").iterdir() if f.suffix in (".cu", ".cuh")} - SHARED_HEADERS
    assert sorted(sources - set(owner)) == [], "sources in no row"
    assert {k: v for k, v in owner.items() if len(v) > 1} == {}, "sources in two rows"


def test_every_family_module_in_some_row() -> None:
    table = family_table()
    for col, skip in (("ops", "__init__.py"), ("reference", ("__init__.py", "base.py")), ("cases", ("__init__.py", "_sm90.py", "_fp8.py"))):
        named = {f.name for row in table.values() for p in row[col] for f in _files(FOLDERS[col], p)}
        present = {f.name for f in (ROOT / FOLDERS[col]).glob("*.py") if f.name not in skip}
        assert sorted(present - named) == [], f"{FOLDERS[col]} modules in no row"

