"""The Window deque (admit / evict / recall / reorder / assign / materialize / forward)."""
from windowkit.window.config import WindowConfig
from windowkit.window.window import FIDELITY, Edit, Mode, RepairRule, Window, WindowStats

__all__ = ["Window", "WindowConfig", "WindowStats", "Edit", "Mode", "RepairRule", "FIDELITY"]
