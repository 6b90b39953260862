#!/usr/bin/env python
"""The streamed input pipeline alone: tokens per second per process, and a run's peak memory by corpus size.

Throughput: one process reading every row of the default run's batch (32 rows of 64 tokens) from a generated
JSONL corpus, with the byte tokenizer and with a BPE tokenizer (a byte-level BPE of --bpe_vocab ids trained on
the corpus with Hugging Face `tokenizers`), and from the same corpus pre-tokenized into ArrayRecord ids by
scripts/tokenize_corpus.py; against what the default train step consumes (its tokens per step over the
default run's step time, measured by running it first (or --step_ms).

Memory (--memory): the peak resident memory of scripts/train.py (mintrain/configs/dp4_tp2.py,
                                                                 data.source=jsonl) on a
generated 2 GB JSONL corpus and on a 20 MB one, read from the kernel's rusage of each run.

  python benchmarks/data_pipeline.py                 # throughput (~1 min on 2 CPU cores)
  python benchmarks/data_pipeline.py --memory        # plus the 2 GB run (needs ~2.1 GB in --tmp)
  python benchmarks/data_pipeline.py --smoke         # a small corpus, a second per mode: checks that it runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from mintrain import config as config_lib
from mintrain.data import streaming, tokenizer
from mintrain.data.config import DataConfig

REPO = pathlib.Path(__file__).resolve().parents[1]


ROWS, SEQ_LEN = 32, 64  # mintrain/configs/base.py's batch: what the default train step consumes.


def write_corpus(root: pathlib.Path, megabytes: float, seed: int = 0, file_mb: float = 20.0) -> int:
  """JSONL files of English-like documents (Zipf-distributed words, 50-2000 of them); bytes written.

  One file of `file_mb` is generated and then copied, so a corpus of gigabytes takes seconds to make.
  """
  rng = np.random.default_rng(seed)
  letters = np.array(list('etaoinshrdlcumwfgypbvkjxqz'))
  words = [''.join(rng.choice(letters, size=rng.integers(1, 10))) for _ in range(20000)]
  p = 1.0 / np.arange(1, len(words) + 1)
  root.mkdir(parents=True, exist_ok=True)
  first, size, lines = root / 'part00000.jsonl', 0, []
  target = min(megabytes, file_mb) * 1e6
  while size < target:
    text = ' '.join(rng.choice(words, size=rng.integers(50, 2000), p=p / p.sum())) + '.'
    line = json.dumps({'id': len(lines), 'text': text}) + '\n'
    lines.append(line)
    size += len(line)
  first.write_text(''.join(lines))
  total, index = size, 1
  while total < megabytes * 1e6:
    shutil.copyfile(first, root / f'part{index:05d}.jsonl')
    total, index = total + size, index + 1
  return total


def bpe_tokenizer(corpus: pathlib.Path, vocab: int, out: pathlib.Path) -> tuple[str, float]:
  """A byte-level BPE trained on the corpus's first file, saved as `out`/tokenizer.json (its
  post-processor puts <bos> first, as Llama's): (the `data.tokenizer` that names it, bytes per token)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  first = sorted(corpus.glob('*.jsonl'))[0]
  texts = [json.loads(line)['text'] for line in first.read_text().splitlines()[:2000]]
  tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=['<bos>'],
                                                     show_progress=False))
  tok.post_processor = processors.TemplateProcessing(single='<bos> $A', special_tokens=[('<bos>', 0)])
  out.mkdir(parents=True, exist_ok=True)
  tok.save(str(out / 'tokenizer.json'))
  sample = ' '.join(texts[:200])
  return str(out / 'tokenizer.json'), len(sample.encode()) / len(tok.encode(sample).ids)


def throughput(data_cfg: DataConfig, seconds: float) -> float:
  """Tokens per second of one process reading all ROWS of each batch with the run's tokenizer
  (`data.tokenizer`; prefetch on, as in training)."""
  it = streaming.make_iterator(data_cfg, tokenizer.load(data_cfg.tokenizer), split='train', seq_len=SEQ_LEN,
                               global_batch_size=ROWS, micro_batch_size=ROWS, rows=np.arange(ROWS), seed=0)
  next(it)  # The first batch opens the first windows of every row.
  start, batches = time.perf_counter(), 0
  while time.perf_counter() - start < seconds:
    next(it)
    batches += 1
  return batches * ROWS * SEQ_LEN / (time.perf_counter() - start)


def peak_rss_mb(args: list[str]) -> tuple[float, float]:
  """(peak resident MB, seconds) of `python scripts/train.py *args`, from the kernel's rusage."""
  start = time.perf_counter()
  proc = subprocess.Popen([sys.executable, 'scripts/train.py', *args], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  out = proc.stdout.read()
  _, status, usage = os.wait4(proc.pid, 0)
  if os.waitstatus_to_exitcode(status):
    raise SystemExit(f'scripts/train.py failed:\n{out[-3000:]}')
  return usage.ru_maxrss / 1024, time.perf_counter() - start


def default_step_ms(steps: int) -> float:
  """The mean step of the default run (dp4_tp2 on its default data), from its summary line."""
  with tempfile.TemporaryDirectory(prefix='mintrain_step_') as workdir:
    out = subprocess.run([sys.executable, 'scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py',
                          '--workdir',
                          workdir, f'--config.train.steps={steps}', '--config.eval.steps=0'],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
  return float(re.search(r'mean step ([0-9.]+) ms', out).group(1))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--corpus_mb', type=float, default=100.0, help='size of the throughput corpus')
  parser.add_argument('--seconds', type=float, default=10.0, help='timed reading per mode')
  parser.add_argument('--bpe_vocab', type=int, default=8192)
  parser.add_argument('--step_ms', type=float, default=0.0,
                      help='the default train step (default: measured, a 100-step default run)')
  parser.add_argument('--memory', action='store_true', help='also the 2 GB / 20 MB peak-memory runs')
  parser.add_argument('--memory_steps', type=int, default=60, help='train steps of each memory run')
  parser.add_argument('--tmp', default=tempfile.gettempdir(), help='where the corpora are generated')
  parser.add_argument('--smoke', action='store_true', help='a 2 MB corpus, 1 s per mode, no memory runs')
  args = parser.parse_args()
  if args.smoke:
    args.corpus_mb, args.seconds, args.bpe_vocab, args.memory = 2.0, 1.0, 512, False

  base = config_lib.validate(config_lib.defaults()).data
  args.step_ms = args.step_ms or default_step_ms(20 if args.smoke else 100)
  consumed = ROWS * SEQ_LEN / (args.step_ms / 1e3)
  print(f'the default train step consumes {ROWS} x {SEQ_LEN} tokens per {args.step_ms} ms: '
        f'{consumed:,.0f} tokens/s', flush=True)
  with tempfile.TemporaryDirectory(dir=args.tmp, prefix='mintrain_data_bench_') as tmp:
    root = pathlib.Path(tmp)
    size = write_corpus(root / 'jsonl', args.corpus_mb)
    jsonl = dataclasses.replace(base, source='jsonl', path=str(root / 'jsonl' / '*.jsonl'))
    bpe, bytes_per_token = bpe_tokenizer(root / 'jsonl', args.bpe_vocab, root / 'bpe')
    tokenized = subprocess.run(
        [sys.executable, 'scripts/tokenize_corpus.py', '--config.data.source=jsonl',
         f'--config.data.path={jsonl.path}', '--out', str(root / 'ids'), '--workers', '2'],
        cwd=REPO, capture_output=True, text=True)
    if tokenized.returncode:
      raise SystemExit(tokenized.stderr)
    ids = dataclasses.replace(base, source='arrayrecord', record_format='tokens',
                              path=str(root / 'ids' / '*.arrayrecord'))
    print(f'corpus: {size / 1e6:.0f} MB of JSONL; BPE of {args.bpe_vocab} ids, {bytes_per_token:.2f} bytes '
          f'per token', flush=True)
    for name, cfg in (('JSONL, byte tokenizer', jsonl),
                      ('JSONL, BPE tokenizer', dataclasses.replace(jsonl, tokenizer=bpe)),
                      ('ArrayRecord ids', ids)):
      rate = throughput(cfg, args.seconds)
      print(f'{name:24s} {rate:>12,.0f} tokens/s per process  ({rate / consumed:5.1f}x the train step)',
            flush=True)

    if args.memory:
      train = ['--config', 'mintrain/configs/dp4_tp2.py', '--config.data.source=jsonl',
               f'--config.train.steps={args.memory_steps}', '--config.eval.steps=0',
               '--config.checkpoint.keep=0', '--config.metrics.peak_tflops=1']
      results = {}
      for mb in (20, 2000):
        corpus = root / f'memory_{mb}'
        written = write_corpus(corpus, mb)
        peak, seconds = peak_rss_mb([*train, f'--config.data.path={corpus}/*.jsonl'])
        results[mb] = peak
        print(f'peak memory of a {args.memory_steps}-step run on {written / 1e9:.2f} GB of JSONL: '
              f'{peak:,.0f} MB ({seconds:.0f} s)', flush=True)
        shutil.rmtree(corpus)
      print(f'difference: {results[2000] - results[20]:+,.0f} MB (2 GB corpus minus 20 MB corpus)')
  return 0


if __name__ == '__main__':
  sys.exit(main())
