"""The Window deque (admit / evict / recall / reorder / assign / materialize / forward)."""
from windowkit.window.config import WindowConfig
from windowkit.window.window import FIDELITY, Edit, Mode, RepairRule, Window, WindowStats

# the public names (docs/api.md); the others imported above stay importable from here and from their modules
__all__ = ["Window", "WindowConfig", "RepairRule"]
