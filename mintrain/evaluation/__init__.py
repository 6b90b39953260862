"""Evaluation of a run's model on lm-evaluation-harness tasks (the `eval` extra): `restore` builds the model
of a checkpoint on a chosen mesh, `harness` serves it to lm-eval."""
