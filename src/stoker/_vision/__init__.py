"""Image decoding for training pipelines (the `vision` extra: Pillow)."""
