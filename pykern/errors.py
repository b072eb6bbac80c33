"""The one exception hierarchy of pykern: everything raised on purpose derives from PykernError."""
from __future__ import annotations


class PykernError(Exception):
    """Base of every error pykern raises on purpose."""


class RegistryError(PykernError):
    """A kernels_cu source could not be turned into KernelSpecs (duplicate name, untypable signature)."""


class KernelNotFound(PykernError, KeyError):
    """No registered kernel has the requested name."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class ArgumentError(PykernError, ValueError):
    """A bad value for a launch or op argument; the message names the argument."""


class ArgumentTypeError(PykernError, TypeError):
    """A launch or op argument of the wrong type or dtype; the message names the argument."""


class CompileError(PykernError):
    """NVRTC (or the host C++ compiler) rejected a source; carries the log and the options used."""

    def __init__(self, message: str, log: str = "", options: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.log = log
        self.options = tuple(options)

    def __str__(self) -> str:
        parts = [self.args[0]]
        if self.options:
            parts.append("options: " + " ".join(self.options))
        if self.log:
            parts.append(self.log.rstrip())
        return "\n".join(parts)


class LayoutMismatch(PykernError):
    """The PTX .entry parameters disagree with the KernelSpec parsed from the .cu source."""


class CacheMiss(PykernError):
    """PYKERN_DISABLE_JIT=1 and no cached or bundled binary exists for the kernel and arch."""


class BackendUnavailable(PykernError, RuntimeError):
    """The requested backend cannot run here (no driver, no GPU, no compiler, ...); says why."""


class KernelExecutionError(PykernError, RuntimeError):
    """The host backend found a deadlock, a barrier reached by part of a block, or a bad shuffle mask."""


class MissingDependency(PykernError, ImportError):
    """An optional package is needed for this feature; the message names the pip extra that installs it."""

    def __init__(self, package: str, extra: str, purpose: str) -> None:
        super().__init__(
            f"{purpose} needs the optional package {package!r}, which is not installed: "
            f"pip install 'pykern[{extra}]' (or pip install {package})"
        )
        self.name = package  # ImportError's attribute: which module is missing
        self.package = package
        self.extra = extra
