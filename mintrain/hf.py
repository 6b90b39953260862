"""Hugging Face checkpoints in and out: `from_pretrained(path)` and `save_pretrained(model, out_dir)`.

A directory holds `config.json` and `model.safetensors`, or shards named by
`model.safetensors.index.json`. The model family that claims the config's `model_type`
(`Family.hf`, e.g. `models.hf_llama`) says which options it sets and where each tensor goes;
this module only reads and writes. Loading reads, for each parameter, only the slices that this
process's devices hold (safetensors reads slices lazily), so no host holds a whole sharded parameter.
Saving writes one tensor at a time from process 0, in shards of at most `max_shard_size` bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from mintrain import config as config_lib
from mintrain import train_state
from mintrain.build import Run, build
from mintrain.fields import ConfigError
from mintrain.models import FAMILIES, hf_model_options

INDEX = 'model.safetensors.index.json'
SINGLE = 'model.safetensors'


def make_config(path: str | os.PathLike, base: ml_collections.ConfigDict | None = None,
                mesh_sizes: dict[str, int] | None = None) -> config_lib.Config:
  """`base` (default configs/base.py) with the checkpoint's model options (and mesh sizes), validated."""
  config = (base or config_lib.defaults()).copy_and_resolve_references()
  model = ml_collections.ConfigDict(config_lib.defaults().model.to_dict())  # A fresh transformer section.
  model.update(hf_model_options(path))
  config.model = model
  if mesh_sizes:
    config.mesh.update(mesh_sizes)
  return config_lib.validate(config)


class _Tensors(contextlib.ExitStack):
  """Lazy handles to every tensor of a checkpoint directory, by name."""

  def __init__(self, path: str | os.PathLike):
    super().__init__()
    from safetensors import safe_open

    root = epath.Path(path)
    if (root / INDEX).exists():
      files = sorted(set(json.loads((root / INDEX).read_text())['weight_map'].values()))
    elif (root / SINGLE).exists():
      files = [SINGLE]
    else:
      raise ConfigError(f'{path} holds neither {SINGLE} nor {INDEX}.')
    self.handles: dict[str, Any] = {}
    for name in files:
      handle = self.enter_context(safe_open(os.fspath(root / name), framework='numpy'))
      self.handles.update(dict.fromkeys(handle.keys(), handle))

  def slice(self, name: str, path: str) -> Any:
    if name not in self.handles:
      raise ConfigError(f'{path}: the checkpoint has no tensor {name!r}.')
    return self.handles[name].get_slice(name)


def load_params(path: str | os.PathLike, run: Run, mesh: jax.sharding.Mesh | None = None) -> nnx.State:
  """The checkpoint's weights as `run`'s parameters, each device's slice read on its own process."""
  conversion = run.config.family.hf
  names = conversion.weight_names(run.config.model)
  mesh = mesh or run.mesh
  leaves, treedef = jax.tree_util.tree_flatten_with_path(run.abstract_state.params, is_leaf=_is_variable)
  loaded = []
  with _Tensors(path) as tensors:
    for key, var in leaves:
      ours = train_state.path_str(key)
      if ours not in names:
        raise ConfigError(f'{path}: mintrain parameter {ours} has no Hugging Face tensor (load with '
                          'scan_layers off).')
      name, kind = names[ours]
      abstract = jax.tree.leaves(var)[0]
      # A tuple of names: one tensor per index of the parameter's first axis (a mixture's experts).
      stacked = isinstance(name, tuple)
      parts = list(zip(name, [abstract.shape[1:]] * len(name))) if stacked else [(name, abstract.shape)]
      for part, shape in parts:
        expected = tuple(conversion.their_shape(kind, shape))
        found = tuple(tensors.slice(part, path).get_shape())
        if found != expected:
          raise ConfigError(f'{path}: tensor {part} has shape {found}, but config.json makes it {expected}.')

      def callback(index, kind=kind, name=name, stacked=stacked, shape=abstract.shape, dtype=abstract.dtype):
        bounds = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
        head_dim = run.config.model.head_dim
        if not stacked:
          return conversion.read(kind, tensors.slice(name, path), bounds, head_dim).astype(dtype)
        return np.stack([conversion.read(kind, tensors.slice(name[i], path), bounds[1:], head_dim)
                         for i in range(bounds[0].start, bounds[0].stop)]).astype(dtype)

      sharding = NamedSharding(mesh, abstract.sharding.spec)
      value = jax.make_array_from_callback(abstract.shape, sharding, callback)
      loaded.append(var.replace(value) if _is_variable(var) else value)
  return jax.tree_util.tree_unflatten(treedef, loaded)


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def from_pretrained(path: str | os.PathLike, *, base: ml_collections.ConfigDict | None = None) -> nnx.Module:
  """The model of a Hugging Face directory on the current mesh (`jax.set_mesh`; one device without one),
  laid out by `base`'s rules (default configs/base.py); `model(tokens_BL)` gives the logits."""
  mesh = jax.sharding.get_mesh()
  if mesh.empty:
    sizes, devices = {'data': 1, 'fsdp': 1, 'expert': 1, 'model': 1}, jax.devices()[:1]
  else:
    sizes, devices = dict(mesh.shape), list(mesh.devices.flat)
  run = build(make_config(path, base, sizes), devices)
  params = load_params(path, run, None if mesh.empty else mesh)
  return nnx.merge(run.graphdef, params)


def _host(x: jax.Array) -> np.ndarray:
  """The whole array on this host (a collective when it spans processes)."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_pretrained(model: nnx.Module, out_dir: str | os.PathLike, *, dtype: str | None = None,
                    max_shard_size: int = 2**30) -> list[str]:
  """Writes `model` as a Hugging Face directory that `transformers` loads; returns the files written.

  Every process must call it (a sharded parameter is gathered collectively); process 0 writes.
  """
  from safetensors.numpy import save_file

  cfg = model.cfg
  family = next((f for f in FAMILIES.values() if isinstance(cfg, f.config) and f.hf is not None), None)
  if family is None:
    raise ConfigError(f'{type(cfg).__name__} models have no Hugging Face architecture.')
  out_dtype = np.dtype(dtype or cfg.param_dtype)
  names = family.hf.weight_names(cfg)
  is_main = jax.process_index() == 0
  out = epath.Path(out_dir)
  if is_main:
    out.mkdir(parents=True, exist_ok=True)
  # Each shard is written once full; its final name needs the shard count, so it is renamed at the end.
  shard: dict[str, np.ndarray] = {}
  shard_names: list[list[str]] = []
  total = 0

  def flush() -> None:
    save_file(shard, os.fspath(out / f'part-{len(shard_names)}.tmp'), metadata={'format': 'pt'})
    shard_names.append(list(shard))
    shard.clear()

  for key, value in _params(model):
    name, kind = names[train_state.path_str(key)]
    host = _host(value)  # Every process takes part in the gather; process 0 keeps the tensor.
    if not is_main:
      continue
    for part, value_part in zip(name, host) if isinstance(name, tuple) else [(name, host)]:
      tensor = family.hf.write(kind, value_part).astype(out_dtype)
      if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > max_shard_size:
        flush()
      shard[part] = tensor
      total += tensor.nbytes
  if not is_main:
    return []
  flush()
  count = len(shard_names)
  files = [SINGLE] if count == 1 else [f'model-{i + 1:05d}-of-{count:05d}.safetensors' for i in range(count)]
  for i, file in enumerate(files):
    (out / f'part-{i}.tmp').rename(out / file)
  if count > 1:
    weight_map = {name: file for file, names_in in zip(files, shard_names) for name in names_in}
    (out / INDEX).write_text(json.dumps({'metadata': {'total_size': total}, 'weight_map': weight_map},
                                        indent=2))
  (out / 'config.json').write_text(json.dumps(family.hf.config_json(cfg, str(out_dtype)), indent=2))
  return files + ([INDEX] if len(files) > 1 else []) + ['config.json']


def _params(model: nnx.Module) -> Iterator[tuple[Sequence[Any], jax.Array]]:
  _, params = nnx.split(model, nnx.Param)
  for key, var in nnx.to_flat_state(params):
    yield key, var[...] if _is_variable(var) else var
