"""The Window deque (admit / evict / recall / reorder / assign / materialize / forward)."""
from windowkit.window.window import Edit, Mode, Window, WindowStats

__all__ = ["Window", "WindowStats", "Edit", "Mode"]
