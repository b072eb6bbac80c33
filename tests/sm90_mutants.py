"""The sm_90a tests' mutants: a copy of a kernel source with one piece of text replaced, its kernels renamed so
they do not collide with the real ones, found through PYKERN_KERNEL_PATH. A check that passes the real kernel
must fail each mutant: that is what shows the check can see the defect the mutant plants."""
from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path

import pytest

_FAMILY_CALL = re.compile(r"^PK_\w+_KERNELS\((\w+),", re.M)


def keep_families(text: str, keep: Collection[str]) -> str:
    """text without its top-level kernel-family macro calls (`PK_IO16_KERNELS(name, ...)` and the like, up to
    the closing parenthesis, continuation lines included) whose name is not in `keep`.

    A mutant launches one or two kernels, but each copy is a host build of its own: with every family of a big
    source in it (attention_fwd_sm90.cu: 48 kernels), g++ takes about 35 s a mutant; with the launched family
    alone about 7 s. The kept kernels' code is the same text either way (the device functions stay; only the
    extern "C" entry points of the other families go), so the mutant proves the same thing."""
    out: list[str] = []
    pos = 0
    found: set[str] = set()
    for m in _FAMILY_CALL.finditer(text):
        if m.start() < pos:
            continue
        depth, end = 0, m.start(1) - 1  # at the call's opening parenthesis
        while True:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
            if depth == 0:
                break
        if text.startswith("\n", end):
            end += 1
        if m.group(1) in keep:
            found.add(m.group(1))
        else:
            out.append(text[pos:m.start()])
            pos = end
    # a misspelt name would leave a mutant with no kernel of that family: say so here, not as a missing kernel
    assert found == set(keep), sorted(set(keep) - found)
    out.append(text[pos:])
    return "".join(out)


def write_mutant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, src: Path, old: str, new: str, file_name: str,
                 rename: tuple[str, str], keep: Collection[str] | None = None) -> None:
    """src with `old` (which must stand there exactly once) replaced by `new` and every rename[0] in it spelled
    rename[1], written to tmp_path / file_name, which goes on PYKERN_KERNEL_PATH. With `keep`, only those
    kernel families' entry points stay (keep_families): a smaller, faster host build."""
    text = src.read_text()
    assert text.count(old) == 1, old
    text = text.replace(old, new)
    if keep is not None:
        text = keep_families(text, keep)
    (tmp_path / file_name).write_text(text.replace(*rename))
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(tmp_path))


def launch_mutants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, src: Path, old: str, new: str, file_name: str,
                   real: str, mutant: str) -> None:
    """write_mutant with `real` spelled `mutant`, and the launcher spied so that the ops, asking for their real
    kernel names, launch the mutant's kernels instead."""
    from pykern import launcher

    write_mutant(tmp_path, monkeypatch, src, old, new, file_name, (real, mutant))
    launch = launcher.launch
    monkeypatch.setattr(launcher, "launch", lambda name, *a, **kw: launch(name.replace(real, mutant), *a, **kw))
