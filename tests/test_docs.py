"""Code and docs speak of the project itself: no pointers to files outside the repository (the design contract is
docs/design.md), and no wording about how the work was organised (the project's initial defects as "seeds", a
tracker's "issues", GPU "leases", engineers' "sessions") where the text should say what a thing is.

Legitimate uses stay allowed: RNG seeds ("the seed contract", "--seed N"), the issue term of a performance model
("the issue term", "issue slots"), torch / HTTP sessions, the file name tools/gpu_session.sh, "release" / "released".
"""
from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (pattern, what to write instead). Each is narrow on purpose: a hit names file:line and is reworded, not allowed.
PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\bDESIGN\b"), "docs/design.md, the design contract in the repository"),
    (re.compile(r"\.\./shared\b|/work/shared\b"), "a file in the repository (docs/design.md)"),
    (re.compile(r"\bseed defects?\b", re.I), "what the defect is (e.g. the shared-scratch race)"),
    (re.compile(r"\bthe seeds\b|\bbeyond the seeds?\b", re.I), "what the set is (e.g. training.cu's ops)"),
    (re.compile(r"\bleases?\b", re.I), "a run on a GPU, named by its date or report"),
    (re.compile(r"(?<![\w.])sessions?\b(?!\s*(?:=|\(|\.|object))", re.I),
     "a run on a GPU (torch / HTTP sessions are fine)"),
    (re.compile(r"\bissue's\b|\bthe issue\b(?!\s+(?:term|slots?|rate|width|bound|port|cycles?)\b)", re.I),
     "what the list or budget is (e.g. the shape list in tools/measure_gpu.py)"),
    (re.compile(r"\b(?:issue|ticket) (?:tracker|number)\b|\btickets? (?:says|asks|lists)\b", re.I),
     "what is asked for, in the project's own terms"),
]

# Files being reworded elsewhere may be listed here for a while (fnmatch patterns); none are now.
ALLOWED_FOR_NOW: list[str] = []

THIS = "tests/test_docs.py"  # holds the patterns themselves


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): nothing lists the tracked files")
    return [p for p in out.decode().split("\0") if p]


def hits(text: str) -> list[tuple[int, str, str]]:
    """(line number, the line, what to write instead) for every pattern hit in `text`."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for pat, instead in PATTERNS:
            if pat.search(line):
                found.append((n, line.strip(), instead))
    return found


def test_patterns_catch_what_they_are_for_and_spare_legitimate_uses() -> None:
    bad = [
        "Read `../shared/DESIGN.md` (beside the repo) first.",
        "scratch[0] before a slow warp has read it (seed defect 1).",
        "// Training ops beyond the seeds: fused residual-add",
        "The lease re-checked what changed since the run of 2026-11-27",
        "# Measured on an H200 (second lease)",
        "- `tools/gpu_session.sh`: one GPU session, each stage time-boxed",
        "The issue's shape list is covered value by value",
        "# The cases of the issue, spelled out.",
    ]
    good = [
        "the seed contract: the same seed gives the same samples",
        "python -m pykern.difftest --seed 3",
        "the release half of the acq_rel ticket; released barriers",
        "counted once -- every path, so the issue term over-counts code",
        "OUT=/tmp/out BUDGET=440 bash tools/gpu_session.sh",
        "s = requests.Session(); session = s",
        "4 schedulers per SM issue one instruction a cycle (issue slots)",
    ]
    assert [bool(hits(t)) for t in bad] == [True] * len(bad)
    assert [t for t in good if hits(t)] == []


def test_no_tracked_file_speaks_of_seeds_issues_leases_or_sessions() -> None:
    found = []
    for rel in tracked_files():
        if rel == THIS or any(fnmatch.fnmatch(rel, pat) for pat in ALLOWED_FOR_NOW):
            continue
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):
            continue  # binary data, or a file deleted in the working tree
        found += [f"{rel}:{n}: {line[:120]!r} -> write {instead}" for n, line, instead in hits(text)]
    assert not found, "reword these lines:\n" + "\n".join(found)


def test_design_contract_is_in_the_repository() -> None:
    design = ROOT / "docs" / "design.md"
    assert design.is_file()
    internals = (ROOT / "docs" / "internals.md").read_text()
    assert "(design.md)" in internals.split("\n## ")[0]  # the first thing internals.md sends a reader to
    # every section the code and docs cite by name is there
    headings = re.findall(r"^## (.+)$", design.read_text(), re.M)
    for want in ("Tests and tolerance", "Serving conventions", "Judging GPU speed without a GPU"):
        assert want in headings, (want, headings)
