"""Tests run on 8 simulated CPU devices, chosen before the JAX backend starts.

Compiled programs go to a persistent compilation cache for this session, shared with the scripts the
tests start (they inherit the environment), so the many runs of the same small models compile once.
The tests check equalities, not speed: XLA:CPU's backend optimisation is off, which halves the compile
time of their tiny models (11.5 s -> 6.0 s for one run's three programs), and its matmuls run on one
thread each, which saves the pools' spinning (11% of the CPU time of a run).
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
os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'
TEST_XLA_FLAGS = '--xla_backend_optimization_level=0 --xla_cpu_multi_thread_eigen=false'
os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import jax  # noqa: E402

jax.config.update('jax_num_cpu_devices', 8)  # Wins over a count in XLA_FLAGS; subprocesses do not inherit it.

from mintrain import configs  # noqa: E402
from mintrain.runtime import host_allocator  # noqa: E402

host_allocator.keep_freed_memory()  # As the scripts do on the CPU backend (mesh.simulate_cpu_devices).

import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from mintrain import config as config_lib  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
MESH_CONFIGS = ('single', 'dp8', 'dp4_tp2', 'tp8', 'fsdp8', 'fsdp4_tp2', 'cp2_dp2_tp2')


# What every test run leaves out unless it says otherwise: a matmul calibration per run for MFU
# (tests/test_hardware.py covers it) and evaluation, whose program is one more compile per run (tests of
# evaluation ask for it, e.g. eval.steps=1).
TEST_DEFAULTS = ('metrics.peak_tflops=1.0', 'eval.steps=0')


def load_config(name: str, *overrides: str) -> config_lib.Config:
  """mintrain/configs/NAME.py with TEST_DEFAULTS and `key=value` overrides, validated and resolved."""
  return config_lib.resolve(config_lib.validate(config_lib.load(configs.DIR / f'{name}.py',
                                                                (*TEST_DEFAULTS, *overrides))))[0]


SCRIPT_DEFAULTS = [f'--config.{item}' for item in TEST_DEFAULTS]  # The same for scripts/train.py.


def mesh_devices(config: config_lib.Config) -> list:
  """As many of the 8 simulated devices as the config's mesh uses."""
  from mintrain.mesh import devices_needed
  return jax.devices()[:devices_needed(config.mesh.sizes)]


def build(config: config_lib.Config):
  """The config's run on the devices its mesh uses."""
  from mintrain.build import build
  return build(config, mesh_devices(config))


def quiet(*_):
  pass


def free_port() -> int:
  """A loopback TCP port nothing listens on now (for a coordinator address)."""
  import socket
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def script_env() -> dict[str, str]:
  """The environment of a script the tests start: the tests' compile settings and cache, and no device
  count or platform, so the scripts must set up devices themselves."""
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}
  env['XLA_FLAGS'] = TEST_XLA_FLAGS
  return env


def run_script(*args, timeout=300, env_extra=None) -> subprocess.CompletedProcess:
  """`python *args` from the repo root, in `script_env()`."""
  env = script_env()
  env.update(env_extra or {})
  return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=timeout)


def short_documents(n: int, seed: int = 0) -> list[bytes]:
  """Random-letter documents of 2 to 30 bytes: a packed row of 32 tokens holds two or three."""
  import numpy as np
  letters = np.frombuffer(b'abcdefghij klmnop\n', np.uint8)
  rng = np.random.default_rng(seed)
  return [letters[rng.integers(len(letters), size=rng.integers(2, 31))].tobytes() for _ in range(n)]


@pytest.fixture(scope='session')
def short_docs(tmp_path_factory) -> tuple[str, ...]:
  """Overrides that train on 200 short text files (one document each), packed several to a row."""
  root = tmp_path_factory.mktemp('short_docs')
  for i, doc in enumerate(short_documents(200)):
    (root / f'doc{i:03d}.txt').write_bytes(doc)
  return ('data.source=text', f'data.path={root}/*.txt', 'data.eval_fraction=0.1')


@pytest.fixture(scope='session', autouse=True)
def _eight_devices():
  assert jax.device_count() == 8, 'tests expect 8 simulated CPU devices (see conftest.py)'


def _split_layer_path(path: str) -> tuple[str, int | None, str] | None:
  """'params.blocks.3.attn.w' -> ('params.blocks', 3, 'attn.w'); 'params.blocks.attn.w' -> (.., None, ..)."""
  parts = path.split('.')
  if 'blocks' not in parts[:-1]:
    return None
  i = parts.index('blocks') + 1
  if parts[i].isdigit():
    return '.'.join(parts[:i]), int(parts[i]), '.'.join(parts[i + 1:])
  return '.'.join(parts[:i]), None, '.'.join(parts[i:])


def convert_layers(flat: dict, to_scanned: bool) -> dict:
  """A flat {path: host array} of the transformer's state with its blocks stacked (`blocks.<i>.X` ->
  `blocks.X`) or unstacked: the tests' own reference for moving parameters between the two layouts."""
  import numpy as np
  out, groups = {}, {}
  for path, x in flat.items():
    split = _split_layer_path(path)
    if split is None:
      out[path] = x
    elif to_scanned and split[1] is not None:
      groups.setdefault((split[0], split[2]), {})[split[1]] = x
    elif not to_scanned and split[1] is None:
      for i in range(x.shape[0]):
        out[f'{split[0]}.{i}.{split[2]}'] = x[i]
    else:
      out[path] = x
  for (head, rest), layers in groups.items():
    out[f'{head}.{rest}'] = np.stack([layers[i] for i in range(len(layers))])
  return out


def fill(target, flat: dict):
  """The tree of `target` (abstract arrays), each leaf taken from `flat` by path, in the target's sharding."""
  from mintrain.train_state import path_str
  leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
  return jax.tree_util.tree_unflatten(
      treedef, [jax.device_put(flat[path_str(path)], x.sharding) for path, x in leaves])


# Real tokenizers, trained here on the embedded corpus (no download): a few seconds per session.

TOKENIZER_VOCAB = 512
TOKENIZER_CORPUS_BYTES = 1 << 20


def stdlib_texts(max_bytes: int = TOKENIZER_CORPUS_BYTES) -> list[str]:
  """The leading stdlib corpus files' texts, up to about `max_bytes`."""
  from mintrain.data import sources
  texts, total = [], 0
  for _, path in sources.stdlib_files():
    if total >= max_bytes:
      break
    texts.append(path.read_text(encoding='utf-8'))
    total += len(texts[-1])
  return texts


@pytest.fixture(scope='session')
def bpe_tokenizer(tmp_path_factory) -> pathlib.Path:
  """A directory holding a byte-level BPE of 512 ids saved by transformers (tokenizer.json and
  tokenizer_config.json naming <s> and </s>); its post-processor puts <s> before a text, as Llama's."""
  import transformers
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

  path = tmp_path_factory.mktemp('sentencepiece') / 'code.model'
  lines = [line for text in stdlib_texts() for line in text.splitlines() if line.strip()]
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(lines), model_prefix=str(path.with_suffix('')), vocab_size=TOKENIZER_VOCAB,
      model_type='bpe', normalization_rule_name='identity', remove_extra_whitespaces=False,
      byte_fallback=True, character_coverage=1.0, split_digits=True, allow_whitespace_only_pieces=True,
      minloglevel=2)
  return path
