"""Input pipeline: tokenizer -> sources -> Grain pipeline -> sharded global batches.

tokenizer.py    tokenizers: bytes (256 + BOS), Hugging Face tokenizer.json, SentencePiece; one load()
sources.py      the embedded stdlib corpus, text globs, token files; train/eval split
pipeline.py     Grain: packing, shuffle per epoch, per-process shards, prefetch
segments.py     document boundaries in packed rows: segment ids, positions, target weights
records.py      JSONL / Parquet / ArrayRecord corpora listed as blocks, read a block at a time; bad records
hf_datasets.py  a Hugging Face dataset (save_to_disk, load_dataset of files or a Hub name, streamed) as blocks
splits.py       a source's train or eval blocks, their order per epoch; a changed corpus's eras
streaming.py    a packed (or padded) stream per batch row over shuffled blocks; mixtures; state of every row
synthetic.py    deterministic sequences from the seed, for tests and benchmarks
batches.py      per-process rows -> one global batch sharded on `batch`; iterator state
"""
