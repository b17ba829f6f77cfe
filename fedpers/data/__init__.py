"""Data: synthetic generators and file loaders (per-unit tensors with a leading unit dimension)."""
