"""What the tests share besides fixtures: configs, the small model, devices, script runs, layer layouts.

conftest.py sets up the process (8 simulated devices, the compilation cache) before anything here runs.
"""

import os
import pathlib
import subprocess
import sys

import jax
from conftest import TEST_XLA_FLAGS

from mintrain import config as config_lib
from mintrain import configs
from mintrain.configs import test_small

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


def script_flags(*overrides: str) -> list[str]:
  """TEST_DEFAULTS and `key=value` overrides as scripts/train.py's `--config.key=value` flags."""
  return [f'--config.{item}' for item in (*TEST_DEFAULTS, *overrides)]


SCRIPT_DEFAULTS = script_flags()

SMALL = test_small.OVERRIDES  # mintrain/configs/test_small.py's model and batch on any other config.
# test_small narrower still (32 wide, 4 heads of 8) on 8 rows of 16 tokens.
TINY = (*SMALL, 'model.embed_dim=32', 'model.mlp_dim=64', 'model.num_heads=4', 'model.head_dim=8',
        'train.global_batch_size=8', 'train.seq_len=16')


def mesh_devices(config: config_lib.Config) -> list:
  """As many of the 8 simulated devices as the config's mesh uses."""
  from mintrain.mesh import devices_needed
  return jax.devices()[:devices_needed(config.mesh.sizes)]


def build(config: config_lib.Config):
  """The config's run on the devices its mesh uses."""
  from mintrain.build import build
  return build(config, mesh_devices(config))


def spec_entries(spec) -> tuple:
  """A PartitionSpec's entries without the trailing Nones, which mean the same as leaving them out."""
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return tuple(entries)


def equations(jaxpr: jax.extend.core.Jaxpr, primitive: str) -> list:
  """Every equation of `primitive` in a jaxpr, those of nested jaxprs (scans, remat, shard_map) included."""
  found = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == primitive]
  for eqn in jaxpr.eqns:
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += equations(sub, primitive)
  return found


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


def fresh_compilation_cache(root: os.PathLike) -> dict[str, str]:
  """Environment for a script that should pick its own compilation cache under `root` (the tests
  otherwise name theirs) and log its cache hits, even for the tests' models that compile in under a
  second."""
  return {'MINTRAIN_CACHE_DIR': str(root), 'JAX_COMPILATION_CACHE_DIR': '', 'JAX_LOG_COMPILES': '1',
          'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0'}


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


def flat(tree) -> dict:
  """A tree's leaves by path (`blocks.0.attn.wq_DHK`, as Orbax names saved arrays)."""
  from mintrain.train_state import path_str
  return {path_str(path): x for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def fill(target, flat: dict):
  """The tree of `target` (abstract arrays), each leaf taken from `flat` by path, in the target's sharding."""
  from mintrain.train_state import path_str
  leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
  return jax.tree_util.tree_unflatten(
      treedef, [jax.device_put(flat[path_str(path)], x.sharding) for path, x in leaves])


# The corpus of the tokenizers conftest.py trains (no download): a few seconds per session.
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


def train_in_process(config: config_lib.Config, workdir, *, stop_at: int | None = None, **kwargs):
  """`loop.run` of `config` on its devices; `stop_at` raises SIGTERM while step `stop_at - 1` is logged, as a
  preemption: the loop then finishes step `stop_at`, saves and stops."""
  import signal

  from mintrain import loop

  def print_fn(line: str) -> None:
    if stop_at is not None and line.startswith(f'step {stop_at - 1}/'):
      signal.raise_signal(signal.SIGTERM)

  return loop.run(config, workdir, devices=mesh_devices(config), print_fn=print_fn, **kwargs)
