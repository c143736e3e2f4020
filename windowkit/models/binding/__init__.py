"""A small trained Qwen2.5-VL-shaped model on a synthetic multi-frame binding task (issue #5).

    from windowkit.models.binding import load, make_item
    model = load()                                    # committed checkpoint
    python -m windowkit.models.binding.train          # reproduce it (CPU, one thread)
    python -m windowkit.models.binding.eval --n 200   # accuracy per strategy and question kind
"""
from windowkit.models.binding.model import build, config, load
from windowkit.models.binding.task import make_item

# not part of the documented surface (docs/api.md): a research model, loaded by name through
# ``windowkit.models.load.load_model``; the names above stay importable from here and from their modules
__all__: list[str] = []
