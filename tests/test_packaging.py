"""Every subpackage of pykern ships in the wheel: pyproject lists packages explicitly
(kernels_cu is mapped to pykern._kernels_cu), so a new folder must be added there."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "pykern").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found - listed == set(), f"add to [tool.setuptools] packages: {sorted(found - listed)}"
    assert "pykern._kernels_cu" in listed
    assert all(re.fullmatch(r"pykern(\.\w+)*", name) for name in listed)


def test_pykern_torch_without_torch_names_the_extra() -> None:
    # A fresh interpreter in which `import torch` fails: pykern.torch must say which extra installs it.
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import pykern.torch\nexcept ImportError as e:\n"
        "    import pykern; assert isinstance(e, pykern.PykernError), type(e); print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "pip install 'pykern[torch]'" in r.stdout, r.stdout


def _install_section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]


def test_readme_install_section_names_every_extra_and_what_it_adds() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    # One list item per extra, "- `name`: adds ...; for ...", wrapped for a terminal (continuation lines indented).
    items = re.findall(r"^- `(\w+)`: adds (.+?); for ", re.sub(r"\n  (?=\S)", " ", _install_section()), re.M)
    rows = dict(items)
    assert set(rows) == set(extras), f"README's extras list vs pyproject: {sorted(rows)} != {sorted(extras)}"
    for name, reqs in extras.items():
        for req in reqs:  # each requirement's distribution is named in its row (nvidia-cuda-X as X)
            dist = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()
            short = dist.removeprefix("nvidia-cuda-")
            assert dist in rows[name].lower() or short in rows[name].lower(), (name, req, rows[name])


def test_cpu_torch_path_is_consistent() -> None:
    # The test extra pins the CPU wheel CI carries; the torch/hf extras never pin (an installed torch,
    # CPU or CUDA, is kept), and the README tells a CPU machine to install that version first.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "torch==2.13.0" in extras["test"]
    assert [r for r in extras["torch"] + extras["hf"] if r.startswith("torch")] == ["torch>=2.5", "torch>=2.5"]
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in _install_section()


def test_readme_reads_in_a_terminal() -> None:
    # Tables cannot wrap: a row longer than a wide terminal is unreadable there, so long rows became wrapped lists.
    readme = (ROOT / "README.md").read_text()
    long_rows = [ln[:60] for ln in readme.splitlines() if ln.startswith("|") and len(ln) > 170]
    assert not long_rows, long_rows
    assert "<PyTorch's CPU wheel index>" not in readme  # the real URL, not a placeholder
