"""The command-line programs (installed as `mintrain-*` commands; `scripts/*.py` run them from a checkout).
Each parses its arguments before importing JAX, so `--help` answers at once."""
