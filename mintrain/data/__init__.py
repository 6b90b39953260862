"""Input pipeline: tokenizer -> sources -> Grain pipeline -> sharded global batches.

tokenizer.py  byte-level ids (256 bytes + BOS)
sources.py    the embedded stdlib corpus, text globs, token files; train/eval split
pipeline.py   Grain: packing (segment ids, positions, target weights), shuffle per epoch, process shards
synthetic.py  deterministic sequences from the seed, for tests and benchmarks
batches.py    per-process rows -> one global batch sharded on `batch`; iterator state
"""
