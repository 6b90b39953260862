"""Evaluation of a run's model on lm-evaluation-harness tasks (the `eval` extra): `harness` serves a model
(`mintrain.checkpoint.model.restore_model` builds a checkpoint's) to lm-eval."""
