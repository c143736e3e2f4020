"""Small trained models shipped with windowkit (checkpoints in safetensors, reproducible from their scripts)."""
