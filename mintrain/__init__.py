"""mintrain: a small Flax NNX / JAX trainer with logical-axis partitioning on explicit meshes."""

__version__ = '0.1.0'
