"""Checkpoints: Orbax save and restore of a run's state (`checkpoints`), and restores across layer layouts
(`relayout`)."""
