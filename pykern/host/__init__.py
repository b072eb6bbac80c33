"""The host backend's C++ side (emulation header, fiber runtime) and its build/cache logic."""
from __future__ import annotations
