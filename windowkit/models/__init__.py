"""Small trained models shipped with windowkit (checkpoints in safetensors, reproducible from their scripts),
and ``windowkit.models.load.load_model`` (any of them, a tiny built-in or a local checkpoint, by name)."""
