"""Peak dense matmul FLOP/s per JAX device, for MFU: the datasheets' figures (half their "with sparsity"
ones; float32 at the TF32/bfloat16-pass rate JAX uses by default), or a measurement on CPU. Sources:
nvidia.com/en-us/data-center/{h100,h200,a100,l4}/, cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e}."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from mintrain.runtime import caches


@dataclasses.dataclass(frozen=True)
class Peak:
  name: str
  bfloat16: float  # Dense bf16 matmul TFLOP/s.
  float32: float  # Dense TFLOP/s of float32 matmuls at JAX's default precision (TF32 / one bf16 pass).
  float32_full: float | None  # Non-tensor-core FP32 TFLOP/s (GPUs); None where unpublished (TPUs).


# (device_kind pattern, peak): the first full, case-insensitive match wins, so specific variants
# come before the family. Patterns follow `jax.devices()[0].device_kind`.
PEAKS: tuple[tuple[str, Peak], ...] = (
    (r'NVIDIA H100.*PCIe', Peak('H100 PCIe', 756.0, 378.0, 51.0)),
    (r'NVIDIA H100 NVL', Peak('H100 NVL', 835.0, 417.5, 60.0)),
    (r'NVIDIA H100.*', Peak('H100 SXM', 989.4, 494.7, 66.9)),  # e.g. 'NVIDIA H100 80GB HBM3'.
    (r'NVIDIA GH200.*', Peak('GH200', 989.4, 494.7, 66.9)),
    (r'NVIDIA H200 NVL', Peak('H200 NVL', 835.0, 417.5, 60.0)),
    (r'NVIDIA H200.*', Peak('H200 SXM', 989.4, 494.7, 66.9)),
    (r'NVIDIA A100.*', Peak('A100', 312.0, 156.0, 19.5)),  # SXM and PCIe, 40 and 80 GB.
    (r'NVIDIA L4', Peak('L4', 121.0, 60.0, 30.3)),
    (r'TPU v4', Peak('TPU v4', 275.0, 275.0, None)),
    (r'TPU v5 ?lite|TPU v5e', Peak('TPU v5e', 197.0, 197.0, None)),
    (r'TPU v5p?', Peak('TPU v5p', 459.0, 459.0, None)),  # JAX reports v5p as 'TPU v5'.
    (r'TPU v6 ?lite|TPU v6e', Peak('TPU v6e', 918.0, 918.0, None)),  # Trillium.
)


def lookup(device_kind: str) -> Peak | None:
  """The table entry for a `device_kind` string, or None for an unknown device."""
  return next((peak for pattern, peak in PEAKS
               if re.fullmatch(pattern, device_kind.strip(), re.IGNORECASE)), None)


def measure_matmul_tflops(dtype: jnp.dtype | str = jnp.float32, size: int | None = None,
                          seconds: float = 1.0, device: jax.Device | None = None) -> float:
  """Median TFLOP/s of a square matmul on one device, timed for about `seconds`.

  A stand-in peak where there is no table entry (CPUs). It measures one device
  alone: simulated CPU devices share the host's cores, so each of N gets
  less than this while all N train.
  """
  device = device or jax.devices()[0]
  size = size or (1024 if device.platform == 'cpu' else 4096)
  rng = np.random.default_rng(0)
  a, b = (jax.device_put(rng.standard_normal((size, size), np.float32).astype(jnp.dtype(dtype)), device)
          for _ in range(2))
  # Summed into float32, as the model's matmuls are on the CPU (`models.layers.matmul`): XLA:CPU multiplies
  # bfloat16 operands as they are only into a float32 result, and converts them to float32 first otherwise.
  matmul = jax.jit(functools.partial(jnp.matmul, preferred_element_type=jnp.float32))
  times: list[float] = []
  # A one-device mesh of its own, so a training mesh that is active around the call does not apply.
  with jax.set_mesh(jax.make_mesh((1,), ('device',), devices=[device])):
    matmul(a, b).block_until_ready()  # Compile and warm up.
    deadline = time.perf_counter() + seconds
    while len(times) < 3 or time.perf_counter() < deadline:
      start = time.perf_counter()
      matmul(a, b).block_until_ready()
      times.append(time.perf_counter() - start)
  return 2 * size ** 3 / statistics.median(times) / 1e12


def _full_float32() -> bool:
  precision = str(jax.config.jax_default_matmul_precision or '').lower()
  return precision in ('highest', 'float32', 'f32_f32_f32')


def peak_tflops(device: jax.Device, dtype: jnp.dtype | str,
                override: float | None = None) -> tuple[float, str]:
  """Peak TFLOP/s of one device for matmuls in `dtype`, and where the number came from.

  `override` (e.g. `metrics.peak_tflops` from the config) wins when positive;
  then the table; an unknown device is measured.
  """
  if override is not None and override > 0:
    return float(override), 'config: metrics.peak_tflops'
  dtype = jnp.dtype(dtype)
  peak = lookup(device.device_kind)
  if peak is not None:
    if dtype == jnp.bfloat16:
      return peak.bfloat16, f'table: {peak.name}'
    if _full_float32() and peak.float32_full is not None:
      return peak.float32_full, f'table: {peak.name} (full float32)'
    return peak.float32, f'table: {peak.name}'
  value = calibrated_tflops(dtype, device)
  if device.platform == 'cpu' and jax.local_device_count() > 1:
    # Simulated CPU devices share the host's cores: while all of them train, each gets 1/N.
    shared = jax.local_device_count()
    return value / shared, f'measured: CPU matmul calibration / {shared} simulated devices'
  return value, f'measured: {device.platform.upper()} matmul calibration'


def calibration_cache() -> pathlib.Path:
  """Where measured peaks are kept: `caches.root()`."""
  return caches.root() / 'matmul_peak.json'


def calibrated_tflops(dtype: jnp.dtype | str, device: jax.Device) -> float:
  """The matmul calibration of this machine: measured once and cached (a second of every start-up
  saved, and one stable figure where a loaded machine's measurements vary severalfold), measured again
  when a run beats it (`observed`)."""
  cached = _read_cache().get(_key(device, dtype))
  if cached is not None:
    return float(cached)
  return keep_best(_key(device, dtype), measure_matmul_tflops(dtype, device=device))


def _key(device: jax.Device, dtype: jnp.dtype | str) -> str:
  return f'{device.platform} {caches.machine()} {jnp.dtype(dtype).name}'


# A run that reaches this share of the cached calibration makes it suspect: no model keeps the matmul unit
# that busy, so the calibration was more likely taken on a loaded machine (and its MFU reads too high).
SUSPECT_SHARE = 0.8


def observed(device: jax.Device, dtype: jnp.dtype | str, tflops_per_device: float) -> None:
  """A run's achieved model TFLOP/s per device: where it comes within `SUSPECT_SHARE` of the cached
  calibration, the matmul is measured again and the better figure kept for later runs."""
  if lookup(device.device_kind) is not None:
    return
  shared = jax.local_device_count() if device.platform == 'cpu' else 1
  if tflops_per_device * shared >= SUSPECT_SHARE * _read_cache().get(_key(device, dtype), 0.0):
    keep_best(_key(device, dtype), measure_matmul_tflops(dtype, device=device))


def keep_best(key: str, tflops: float) -> float:
  """Records `tflops` under `key` unless a higher figure is there; returns the best. A cache that cannot
  be written only costs the next run a measurement."""
  cache = _read_cache()
  best = max(float(cache.get(key, 0.0)), tflops)
  cache[key] = best
  path = calibration_cache()
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f'{path.name}.{os.getpid()}')
    partial.write_text(json.dumps(cache, indent=1, sort_keys=True))
    partial.replace(path)
  except OSError:
    pass
  return best


def _read_cache() -> dict[str, float]:
  try:
    cache = json.loads(calibration_cache().read_text())
  except (OSError, ValueError):
    return {}
  return cache if isinstance(cache, dict) else {}


def mfu(model_flops_per_sec_per_device: float, peak: float) -> float:
  """Model FLOPs utilisation: achieved model FLOP/s over the peak (`peak` in TFLOP/s), at most 1: a
  measured peak below what a run achieves is the measurement's error, not a utilisation."""
  if not peak > 0 or not math.isfinite(peak):
    raise ValueError(f'Peak must be a positive number of TFLOP/s; got {peak}.')
  return min(model_flops_per_sec_per_device / (peak * 1e12), 1.0)
