"""Tests run on 8 simulated CPU devices; XLA reads this before the backend starts."""

import os

os.environ['JAX_PLATFORMS'] = 'cpu'
_FLAGS = os.environ.get('XLA_FLAGS', '')
os.environ['XLA_FLAGS'] = f'{_FLAGS} --xla_force_host_platform_device_count=8'.strip()

from mintrain import host_allocator  # noqa: E402

host_allocator.keep_freed_memory()  # As the scripts do (mesh.simulate_cpu_devices).

import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

from mintrain import config as config_lib  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
MESH_CONFIGS = ('single', 'dp8', 'dp4_tp2', 'tp8', 'fsdp8', 'fsdp4_tp2')


def load_config(name: str, *overrides: str):
  """configs/NAME.py with `key=value` overrides, validated."""
  config = config_lib.load(REPO / 'configs' / f'{name}.py', overrides)
  config_lib.validate(config)
  return config


def mesh_devices(config) -> list:
  """As many of the 8 simulated devices as the config's mesh uses."""
  from mintrain.mesh import devices_needed
  return jax.devices()[:devices_needed(config.mesh)]


def quiet(*_):
  pass


def run_script(*args, timeout=300, env_extra=None) -> subprocess.CompletedProcess:
  """`python *args` from the repo root, with no device flags: the scripts must set up devices."""
  env = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'JAX_PLATFORMS')}
  env.update(env_extra or {})
  return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=timeout)


@pytest.fixture(scope='session', autouse=True)
def _eight_devices():
  assert jax.device_count() == 8, 'tests expect 8 simulated CPU devices (see conftest.py)'
