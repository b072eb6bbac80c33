"""What every backend provides to the launcher."""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from ..registry import KernelSpec


class Backend(Protocol):
    name: str

    def available(self) -> tuple[bool, str]:
        """(usable here, why not)."""

    def launch(
        self,
        spec: KernelSpec,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[Any],
        shared_mem: int,
        stream: Any,
        device: int | None = None,
        pdl: bool = False,
        cluster: tuple[int, int, int] | None = None,
    ) -> None:
        """Run one launch; args are arrays (pointer params) and ctypes scalars (value params). `device` is
        passed only when the caller named one (pykern.launch(device=...)); backends without devices ignore it.
        `pdl` is passed only when True (a kernel that waits for its predecessor: spec.pdl): backends that run
        launches one after another whole ignore it. `cluster` (passed only when the caller named one): the
        thread-block cluster dims, checked by the launcher."""
