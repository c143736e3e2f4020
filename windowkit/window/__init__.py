"""The Window deque (admit / evict / recall / reorder / assign / materialize / forward)."""
from windowkit.window.window import FIDELITY, Edit, Mode, RepairRule, Window, WindowStats

__all__ = ["Window", "WindowStats", "Edit", "Mode", "RepairRule", "FIDELITY"]
