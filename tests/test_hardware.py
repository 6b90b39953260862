"""Peak FLOP/s: table lookup by device kind, config override, CPU calibration."""

import json
import math
import time
import types

import jax
import pytest

from mintrain.runtime import caches, hardware


def fake_device(kind: str, platform: str = 'gpu'):
  return types.SimpleNamespace(device_kind=kind, platform=platform)


@pytest.mark.parametrize('kind,name,bf16', [
    ('NVIDIA H100 80GB HBM3', 'H100 SXM', 989.4),
    ('NVIDIA H100 PCIe', 'H100 PCIe', 756.0),
    ('NVIDIA H100 NVL', 'H100 NVL', 835.0),
    ('NVIDIA H200', 'H200 SXM', 989.4),
    ('NVIDIA GH200 480GB', 'GH200', 989.4),
    ('NVIDIA A100-SXM4-40GB', 'A100', 312.0),
    ('NVIDIA A100 80GB PCIe', 'A100', 312.0),
    ('NVIDIA L4', 'L4', 121.0),
    ('TPU v4', 'TPU v4', 275.0),
    ('TPU v5 lite', 'TPU v5e', 197.0),
    ('TPU v5', 'TPU v5p', 459.0),
    ('TPU v6 lite', 'TPU v6e', 918.0),
])
def test_known_device_kinds_find_their_bf16_peak(kind, name, bf16):
  assert hardware.peak_tflops(fake_device(kind), 'bfloat16') == (bf16, f'table: {name}')


@pytest.mark.parametrize('kind', ['NVIDIA L40S', 'NVIDIA GeForce RTX 4090', 'cpu'])
def test_unknown_device_kinds_are_not_in_the_table(kind):
  assert hardware.lookup(kind) is None


def test_float32_peak_is_tf32_at_default_precision_and_fp32_at_highest():
  h100 = fake_device('NVIDIA H100 80GB HBM3')
  assert hardware.peak_tflops(h100, 'float32') == (494.7, 'table: H100 SXM')
  with jax.default_matmul_precision('highest'):
    assert hardware.peak_tflops(h100, 'float32') == (66.9, 'table: H100 SXM (full float32)')


def test_config_override_wins_over_the_table():
  h100 = fake_device('NVIDIA H100 80GB HBM3')
  assert hardware.peak_tflops(h100, 'bfloat16', override=400.0) == (400.0, 'config: metrics.peak_tflops')


def test_cpu_falls_back_to_a_measurement_shared_by_the_simulated_devices(monkeypatch, tmp_path):
  monkeypatch.setenv('MINTRAIN_CACHE_DIR', str(tmp_path))
  monkeypatch.setattr(hardware, 'measure_matmul_tflops', lambda dtype, device: 0.25)
  assert jax.local_device_count() == 8
  assert hardware.peak_tflops(jax.devices('cpu')[0], 'float32') == (
      0.25 / 8, 'measured: CPU matmul calibration / 8 simulated devices')


def test_the_cpu_calibration_is_measured_once_per_machine_and_keeps_the_best(monkeypatch, tmp_path):
  monkeypatch.setenv('MINTRAIN_CACHE_DIR', str(tmp_path))
  cpu = jax.devices('cpu')[0]
  measured = []
  monkeypatch.setattr(hardware, 'measure_matmul_tflops', lambda dtype, device: measured.append(dtype) or 0.5)
  assert hardware.calibrated_tflops('float32', cpu) == 0.5
  assert hardware.calibrated_tflops('float32', cpu) == 0.5  # From the cache: measured once.
  assert measured == ['float32']
  assert hardware.calibrated_tflops('bfloat16', cpu) == 0.5 and len(measured) == 2  # Per dtype.
  [key] = [k for k in json.loads(hardware.calibration_cache().read_text()) if k.endswith('float32')]
  assert hardware.keep_best(key, 0.2) == 0.5 and hardware.keep_best(key, 0.8) == 0.8
  assert hardware.calibrated_tflops('float32', cpu) == 0.8 and len(measured) == 2
  hardware.observed(cpu, 'float32', 0.6 / jax.local_device_count())  # 75% of the peak: nothing measured.
  assert len(measured) == 2
  # A run at 87.5% of the peak (a calibration taken under load reads so, the case that made the default
  # run report 95.7% MFU) is measured again, the best figure kept; so is a run that beats it.
  hardware.observed(cpu, 'float32', 0.7 / jax.local_device_count())
  assert len(measured) == 3 and hardware.calibrated_tflops('float32', cpu) == 0.8
  monkeypatch.setattr(hardware, 'measure_matmul_tflops', lambda dtype, device: measured.append(dtype) or 1.6)
  hardware.observed(cpu, 'float32', 0.9 / jax.local_device_count())
  assert len(measured) == 4 and hardware.calibrated_tflops('float32', cpu) == 1.6
  hardware.calibration_cache().write_text('{not json')  # A damaged cache is measured again.
  assert hardware.calibrated_tflops('float32', cpu) == 1.6 and len(measured) == 5


def test_calibration_is_positive_finite_and_quick():
  start = time.perf_counter()
  tflops = hardware.measure_matmul_tflops('float32', size=512, seconds=0.5, device=jax.devices()[0])
  assert time.perf_counter() - start < 5
  assert tflops > 0 and math.isfinite(tflops)


def test_mfu_is_model_flops_over_peak_and_never_above_one():
  assert hardware.mfu(494.7e12, 989.4) == pytest.approx(0.5)
  assert hardware.mfu(3e12, 2.0) == 1.0  # A peak measured too low does not print 150%.
  with pytest.raises(ValueError, match='positive'):
    hardware.mfu(1e12, 0.0)


@pytest.fixture
def jax_cache_settings():
  """The process's compilation cache settings, restored after the test (the tests' own cache)."""
  saved = jax.config.jax_compilation_cache_dir, jax.config.jax_compilation_cache_max_size
  yield
  jax.config.update('jax_compilation_cache_dir', saved[0])
  jax.config.update('jax_compilation_cache_max_size', saved[1])


def test_a_machine_is_its_processor_model_and_instruction_set():
  zen4 = 'processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx512f avx512_bf16\n'
  zen5 = zen4.replace('avx512_bf16', 'avx512_bf16 avx512_vp2intersect')
  reordered = zen4.replace('fpu sse2', 'sse2 fpu')
  assert caches.machine(zen4).startswith('AMD EPYC isa ')
  # Virtual machines of two processor generations share a model name; their compiled code may not run on
  # each other, nor are their timings comparable.
  assert caches.machine(zen4) != caches.machine(zen5)
  assert caches.machine(zen4) == caches.machine(reordered)
  arm = 'processor\t: 0\nFeatures\t: fp asimd sve\n'
  assert ' isa ' in caches.machine(arm) and caches.machine(arm) != caches.machine(arm.replace(' sve', ''))


def test_runs_compile_into_a_bounded_cache_per_machine_unless_one_is_named(monkeypatch, tmp_path,
                                                                         jax_cache_settings):
  monkeypatch.setenv('MINTRAIN_CACHE_DIR', str(tmp_path))
  jax.config.update('jax_compilation_cache_dir', None)
  jax.config.update('jax_compilation_cache_max_size', -1)
  chosen = caches.use_compilation_cache()
  assert chosen == jax.config.jax_compilation_cache_dir
  assert chosen.startswith(str(tmp_path / 'xla')) and chosen != str(tmp_path / 'xla')
  assert jax.config.jax_compilation_cache_max_size == caches.COMPILATION_CACHE_BYTES
  # Another processor (or core count, or JAX) is another directory.
  monkeypatch.setattr(caches, 'machine', lambda: 'another machine')
  jax.config.update('jax_compilation_cache_dir', None)
  assert caches.use_compilation_cache() != chosen
  # One the user named (JAX_COMPILATION_CACHE_DIR) is kept, and so is its size.
  jax.config.update('jax_compilation_cache_dir', str(tmp_path / 'mine'))
  jax.config.update('jax_compilation_cache_max_size', -1)
  assert caches.use_compilation_cache() == str(tmp_path / 'mine')
  assert jax.config.jax_compilation_cache_max_size == -1
  # A run with `train.compilation_cache=False` leaves JAX as it is.
  jax.config.update('jax_compilation_cache_dir', None)
  assert caches.use_compilation_cache(False) is None and jax.config.jax_compilation_cache_dir is None
