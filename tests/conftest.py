"""Tests run on 8 simulated CPU devices, chosen before the JAX backend starts.

Compiled programs go to a persistent compilation cache for this session, shared with the scripts the
tests start (they inherit the environment), so the many runs of the same small models compile once.
The tests check equalities, not speed: XLA:CPU's backend optimisation is off, which halves the compile
time of their tiny models (11.5 s -> 6.0 s for one run's three programs), its element-wise code comes
from the older emitters, not the MLIR fusion emitters (2-3x less again), and its matmuls run on one
thread each, which saves the pools' spinning (11% of the CPU time of a run). For the same reason the
reference libraries (torch) run OpenMP on one thread, and the objects alive after collection (modules,
JAX's caches) are frozen out of Python's cyclic collector, which otherwise walks them again at every full
collection: together 12-14% of the CPU time of tests/test_hf.py. The collector's youngest generation then
runs every 100,000 allocations, not 700.
"""

import atexit
import os
import shutil
import tempfile

os.environ['JAX_PLATFORMS'] = 'cpu'
if 'MINTRAIN_TEST_JAX_CACHE' not in os.environ:  # The first process of the session; its workers share it.
  os.environ['MINTRAIN_TEST_JAX_CACHE'] = tempfile.mkdtemp(prefix='mintrain_test_jax_cache_')
  atexit.register(shutil.rmtree, os.environ['MINTRAIN_TEST_JAX_CACHE'], ignore_errors=True)
os.environ['JAX_COMPILATION_CACHE_DIR'] = os.environ['MINTRAIN_TEST_JAX_CACHE']
# Matmul calibrations (runtime.hardware) stay in the session's cache, not the user's.
os.environ['MINTRAIN_CACHE_DIR'] = os.environ['MINTRAIN_TEST_JAX_CACHE']
os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'
TEST_XLA_FLAGS = ('--xla_backend_optimization_level=0 --xla_cpu_multi_thread_eigen=false '
                  '--xla_cpu_use_fusion_emitters=false')
os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
os.environ.setdefault('OMP_NUM_THREADS', '1')  # Inherited by the scripts the tests start.

import jax  # noqa: E402

jax.config.update('jax_num_cpu_devices', 8)  # Wins over a count in XLA_FLAGS; subprocesses do not inherit it.

from mintrain.runtime import host_allocator  # noqa: E402

host_allocator.keep_freed_memory()  # As the scripts do on the CPU backend (mesh.simulate_cpu_devices).

import gc  # noqa: E402
import pathlib  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope='session')
def short_docs(tmp_path_factory) -> tuple[str, ...]:
  """Overrides that train on 200 short text files (one document each), packed several to a row."""
  from helpers import short_documents
  root = tmp_path_factory.mktemp('short_docs')
  for i, doc in enumerate(short_documents(200)):
    (root / f'doc{i:03d}.txt').write_bytes(doc)
  return ('data.source=text', f'data.path={root}/*.txt', 'data.eval_fraction=0.1')


@pytest.fixture(scope='session', autouse=True)
def _eight_devices():
  assert jax.device_count() == 8, 'tests expect 8 simulated CPU devices (see conftest.py)'


# Real tokenizers, trained here on the embedded corpus (no download): a few seconds per session.


@pytest.fixture(scope='session')
def bpe_tokenizer(tmp_path_factory) -> pathlib.Path:
  """A directory holding a byte-level BPE of 512 ids saved by transformers (tokenizer.json and
  tokenizer_config.json naming <s> and </s>); its post-processor puts <s> before a text, as Llama's."""
  import transformers
  from helpers import TOKENIZER_VOCAB, stdlib_texts
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=['<s>', '</s>'],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(stdlib_texts(), trainer)
  tok.post_processor = processors.TemplateProcessing(single='<s> $A', special_tokens=[('<s>', 0)])
  directory = tmp_path_factory.mktemp('bpe')
  transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token='<s>',
                                       eos_token='</s>').save_pretrained(directory)
  return directory


@pytest.fixture(scope='session')
def sentencepiece_model(tmp_path_factory) -> pathlib.Path:
  """A SentencePiece BPE of 512 ids (<unk>, <s>, </s> first) trained as Llama's: no normalization,
  whitespace kept, unknown characters as bytes; a `.model` file."""
  import sentencepiece
  from helpers import TOKENIZER_VOCAB, stdlib_texts

  path = tmp_path_factory.mktemp('sentencepiece') / 'code.model'
  lines = [line for text in stdlib_texts() for line in text.splitlines() if line.strip()]
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(lines), model_prefix=str(path.with_suffix('')), vocab_size=TOKENIZER_VOCAB,
      model_type='bpe', normalization_rule_name='identity', remove_extra_whitespaces=False,
      byte_fallback=True, character_coverage=1.0, split_digits=True, allow_whitespace_only_pieces=True,
      minloglevel=2)
  return path


def pytest_collection_finish(session) -> None:
  """What collection imported lives to the end: out of the collector's way. The youngest generation is
  then collected every 100,000 container allocations, not 700: tracing makes millions (BENCHMARKS.md)."""
  gc.collect()
  gc.freeze()
  gc.set_threshold(100_000, 50, 10)
