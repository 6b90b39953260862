"""Device setup from public JAX only: simulated CPU devices, the CPU-only allocator setting, and the
cluster launchers read from their environment variables."""

import os
import re
import subprocess
import sys
import time
import types

import jax
import pytest
from helpers import REPO, free_port

from mintrain import errors
from mintrain import mesh as mesh_lib
from mintrain.errors import MeshError
from mintrain.runtime import distributed, host_allocator

CUDA_PLUGIN = ['jax_plugins.xla_cuda12']
# Variables that would make this machine look like part of a cluster.
LAUNCHER_PREFIXES = ('SLURM_', 'OMPI_', 'TPU_', 'MEGASCALE_', 'KUBERNETES_', 'JOB_COMPLETION_INDEX',
                     distributed.ENV_ADDRESS, distributed.ENV_COUNT, distributed.ENV_ID)


def fresh_python(code: str, **env_extra: str) -> str:
  """Runs `code` in a new interpreter with no device settings inherited from the tests; its stdout."""
  env = {k: v for k, v in os.environ.items()
         if k not in ('XLA_FLAGS', 'JAX_PLATFORMS', 'JAX_NUM_CPU_DEVICES')}
  env.update(env_extra)
  result = subprocess.run([sys.executable, '-c', code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
  assert result.returncode == 0, result.stderr
  return result.stdout.strip()


@pytest.mark.parametrize('count', [2, 8])
def test_simulate_cpu_devices_gives_exactly_that_many_cpu_devices(count):
  out = fresh_python(f'from mintrain import mesh; mesh.simulate_cpu_devices({count}); '
                     'import jax; print(len(jax.devices("cpu")))')
  assert out == str(count)


def test_simulate_cpu_devices_after_the_backend_started_changes_nothing():
  out = fresh_python('import jax; from mintrain import mesh; from mintrain.runtime import host_allocator; '
                     'jax.devices(); '
                     'host_allocator.keep_freed_memory_if_cpu = lambda: print("allocator"); '
                     'mesh.simulate_cpu_devices(4); print(len(jax.devices("cpu")))')
  assert out == '1'


def test_a_device_count_in_xla_flags_is_kept():
  out = fresh_python('from mintrain import mesh; mesh.simulate_cpu_devices(8); '
                     'import jax; print(len(jax.devices("cpu")))',
                     XLA_FLAGS='--xla_force_host_platform_device_count=3')
  assert out == '3'


def test_no_mintrain_module_uses_private_jax():
  users = [p.relative_to(REPO) for p in (REPO / 'mintrain').rglob('*.py') if 'jax._src' in p.read_text()]
  assert not users


def test_allocator_applies_when_jax_platforms_puts_cpu_first():
  assert host_allocator.cpu_backend_expected('cpu', CUDA_PLUGIN)
  assert host_allocator.cpu_backend_expected('cpu,cuda', CUDA_PLUGIN)
  assert not host_allocator.cpu_backend_expected('cuda,cpu', [])
  assert not host_allocator.cpu_backend_expected('tpu,cpu', [])


def test_allocator_applies_without_jax_platforms_only_when_no_accelerator_is_installed():
  assert host_allocator.cpu_backend_expected(None, [])
  assert host_allocator.cpu_backend_expected('', [])
  assert not host_allocator.cpu_backend_expected(None, CUDA_PLUGIN)
  assert not host_allocator.cpu_backend_expected(None, ['libtpu'])


def test_allocator_is_applied_under_jax_platforms_cpu_even_with_an_accelerator_installed(monkeypatch):
  assert jax.config.jax_platforms == 'cpu'  # Set by conftest.py.
  applied = []
  monkeypatch.setattr(host_allocator, 'accelerator_backends', lambda: CUDA_PLUGIN)
  monkeypatch.setattr(host_allocator, 'keep_freed_memory', lambda: applied.append(True) or True)
  assert host_allocator.keep_freed_memory_if_cpu()
  assert applied == [True]


def test_a_pjrt_plugin_in_the_jax_plugins_namespace_is_an_accelerator(tmp_path, monkeypatch):
  (tmp_path / 'jax_plugins' / 'xla_fake').mkdir(parents=True)
  (tmp_path / 'jax_plugins' / 'xla_fake' / '__init__.py').write_text('')
  monkeypatch.syspath_prepend(str(tmp_path))
  assert 'jax_plugins.xla_fake' in host_allocator.accelerator_backends()


def test_libtpu_named_by_tpu_library_path_is_an_accelerator(tmp_path, monkeypatch):
  (tmp_path / 'libtpu.so').write_bytes(b'')
  monkeypatch.setenv('TPU_LIBRARY_PATH', str(tmp_path / 'libtpu.so'))
  assert 'TPU_LIBRARY_PATH' in host_allocator.accelerator_backends()


@pytest.fixture
def no_cluster(monkeypatch):
  """An environment without any launcher's variables, whatever machine the tests run on."""
  for name in list(os.environ):
    if name.startswith(LAUNCHER_PREFIXES):
      monkeypatch.delenv(name)
  return monkeypatch


def test_no_launcher_variables_leave_the_cluster_to_jax_which_finds_none(no_cluster):
  assert distributed.settings() == distributed.Settings(None, None, None)
  code = 'from mintrain.runtime import distributed; print(distributed.initialize(distributed.settings()))'
  assert fresh_python(code) == 'False'


SRUN_STEP = {'SLURM_JOB_ID': '4711', 'SLURM_STEP_NODELIST': 'node[001-002]', 'SLURM_NTASKS': '2',
             'SLURM_STEP_NUM_TASKS': '2', 'SLURM_PROCID': '1', 'SLURM_LOCALID': '0'}


def test_an_srun_step_gives_process_count_and_id(no_cluster):
  for name, value in SRUN_STEP.items():
    no_cluster.setenv(name, value)
  assert distributed.settings() == distributed.Settings(None, 2, 1)
  assert distributed.settings(num_processes=8, process_id=5).num_processes == 8  # Flags win.


def test_a_slurm_batch_shell_without_a_job_step_gives_no_count(no_cluster):
  no_cluster.setenv('SLURM_JOB_ID', '4711')
  no_cluster.setenv('SLURM_NTASKS', '2')
  no_cluster.setenv('SLURM_PROCID', '0')
  assert distributed.settings() == distributed.Settings(None, None, None)


def test_open_mpi_gives_process_count_and_id(no_cluster):
  no_cluster.setenv('OMPI_MCA_orte_hnp_uri', '1531576320.0;tcp://10.96.0.1:34911')
  no_cluster.setenv('OMPI_COMM_WORLD_SIZE', '2')
  no_cluster.setenv('OMPI_COMM_WORLD_RANK', '1')
  assert distributed.settings() == distributed.Settings(None, 2, 1)


def test_a_tpu_pod_leaves_address_count_and_id_to_jax(no_cluster):
  no_cluster.setenv('TPU_WORKER_HOSTNAMES', 'w0,w1')
  no_cluster.setenv('TPU_WORKER_ID', '1')
  assert distributed.settings() == distributed.Settings(None, None, None)


def test_inconsistent_launcher_process_id_is_an_error(no_cluster):
  no_cluster.setenv('OMPI_MCA_orte_hnp_uri', '1531576320.0;tcp://10.96.0.1:34911')
  no_cluster.setenv('OMPI_COMM_WORLD_SIZE', '2')
  no_cluster.setenv('OMPI_COMM_WORLD_RANK', '2')
  with pytest.raises(errors.DistributedError, match=r'process id 2 must be in \[0, 2\)'):
    distributed.settings()


def test_an_incomplete_setting_is_a_one_line_error_once_jax_finds_no_cluster(no_cluster):
  no_cluster.setenv(distributed.ENV_ADDRESS, '127.0.0.1:1')
  code = ('from mintrain.errors import DistributedError\nfrom mintrain.runtime import distributed\n'
          'try:\n  distributed.initialize(distributed.settings())\nexcept DistributedError as e:\n  print(e)')
  out = fresh_python(code)
  assert out.startswith('Multi-process settings are incomplete (') and '\n' not in out, out


def fake_devices(platform: str, count: int, processes: int = 1) -> list:
  """Stand-ins for `jax.devices()` on a host this machine is not: what pick_devices reads of a device."""
  return [types.SimpleNamespace(platform=platform, process_index=i * processes // count, id=i)
          for i in range(count)]


def test_an_accelerator_host_with_fewer_devices_than_the_mesh_is_a_one_line_error():
  with pytest.raises(MeshError) as error:
    mesh_lib.pick_devices(8, fake_devices('gpu', 4))
  message = str(error.value)
  assert '\n' not in message
  assert 'needs 8 devices but this run has 4 gpu device(s)' in message
  assert 'JAX_PLATFORMS=cpu' in message and '-1' in message


def test_an_accelerator_host_never_falls_back_to_simulated_cpu_devices():
  devices, note = mesh_lib.pick_devices(4, fake_devices('tpu', 4))
  assert [d.platform for d in devices] == ['tpu'] * 4 and note is None
  devices, _ = mesh_lib.pick_devices(2, fake_devices('gpu', 4))
  assert [d.id for d in devices] == [0, 1]


def test_minus_one_means_every_device_of_the_backend_in_use():
  devices, _ = mesh_lib.pick_devices(None, fake_devices('gpu', 4))
  assert len(devices) == 4
  devices, note = mesh_lib.pick_devices(None, fake_devices('cpu', 8, processes=2))
  assert len(devices) == 8 and note == '2 processes with 4 cpu device(s) each, 8 in all.'


def test_too_few_cpu_devices_names_the_count_to_set():
  with pytest.raises(MeshError, match='JAX_NUM_CPU_DEVICES .* to 4 per process'):
    mesh_lib.pick_devices(8, fake_devices('cpu', 4, processes=2))


def test_the_cpu_backend_simulates_the_mesh_even_beside_an_accelerator():
  """JAX_PLATFORMS=cpu on a GPU host: the mesh's CPU devices are simulated and used."""
  out = fresh_python('from mintrain import mesh; mesh.simulate_cpu_devices(4); '
                     'devices, note = mesh.pick_devices(4); print(len(devices), note)', JAX_PLATFORMS='cpu')
  assert out == '4 No accelerator in use: simulating 4 CPU devices.'


def announce(address: str, process_id: int) -> subprocess.Popen:
  """A process that waits to join at `address` as `process_id` (it only answers the roll call)."""
  code = ('import time; from mintrain.runtime import distributed; '
          f'distributed.RollCall.start(distributed.Settings({address!r}, 3, {process_id})); '
          'time.sleep(60)')
  return subprocess.Popen([sys.executable, '-c', code], cwd=REPO)


def test_the_roll_call_names_the_processes_that_did_not_join_and_an_id_taken_twice():
  address = f'127.0.0.1:{free_port()}'
  roll_call = distributed.RollCall.start(distributed.Settings(address, 3, 0))
  others = [announce(address, 1)]
  try:
    deadline = time.monotonic() + 60
    while 1 not in roll_call.heard and time.monotonic() < deadline:
      time.sleep(0.1)
    assert roll_call.verdict(3) == 'process(es) 2 of 3 did not join'
    others.append(announce(address, 1))
    while len(roll_call.heard.get(1, ())) < 2 and time.monotonic() < deadline:
      time.sleep(0.1)
    assert re.fullmatch(r'process id 1 was taken by 2 processes \(.* pid \d+, .* pid \d+\)',
                        roll_call.verdict(3)), roll_call.verdict(3)
  finally:
    roll_call.stop()
    for p in others:
      p.kill()
      p.wait(timeout=30)
