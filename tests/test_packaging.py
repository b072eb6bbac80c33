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
