"""Loading a Hugging Face checkpoint: `from_pretrained(path)`, or `load_params` into a built run.

A directory holds `config.json` and `model.safetensors`, or shards named by
`model.safetensors.index.json`. The model family that claims the config's `model_type`
(`Family.hf`, e.g. `models.transformer.hf`) says which options it sets and where each tensor goes.
Loading reads, for each parameter, only the rows of its tensor that this process's devices need, once
for all of them, block by block (`safetensors_reader`, positioned reads: no memory map keeps the file's
pages in the process), straight into the arrays the devices keep: no host holds a whole sharded
parameter, nor a second copy of its slices.

The family names its tensors for layers held one by one (`blocks.<i>.X`); with `model.scan_layers`, a
parameter stacked on a leading `layers` axis (`blocks.X`) is layer i's tensor at index i, found as
`layers.Relayout` finds it for Orbax checkpoints. A family may also name a tuple of tensors for one
parameter, stacked on its first axis (a mixture's experts, one tensor each); scanned, such a parameter
is (layers, experts, ...) of one tensor per layer and expert. `save.py` writes by the same `sources`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterable
from typing import Any

import jax
import ml_collections
import numpy as np
from etils import epath
from flax import nnx
from jax.sharding import NamedSharding

from mintrain import config as config_lib
from mintrain import errors, train_state
from mintrain import mesh as mesh_lib
from mintrain.build import Run, build
from mintrain.checkpoint.relayout import Relayout
from mintrain.errors import ConfigError
from mintrain.hf import safetensors as safetensors_reader
from mintrain.models import hf_model_options
from mintrain.runtime import host_allocator

_log = logging.getLogger(__name__)  # The run routes it (metrics.console_logging).
INDEX = 'model.safetensors.index.json'
SINGLE = 'model.safetensors'


def make_config(path: str | os.PathLike, base: ml_collections.ConfigDict | None = None,
                mesh_sizes: dict[str, int] | None = None) -> config_lib.Config:
  """`base` (default: configs/base.py) with the checkpoint's model options (and mesh sizes), validated.

  `base`'s other model options (scan_layers, remat, compute_dtype, ...) stay when its model is of the
  checkpoint's family; otherwise they are mintrain/configs/base.py's.
  """
  config = (base or config_lib.defaults()).copy_and_resolve_references()
  options = hf_model_options(path)
  if config.model.get('name') != options['name']:
    config.model = ml_collections.ConfigDict(config_lib.defaults().model.to_dict())
  config.model.update(options)
  if mesh_sizes:
    config.mesh.update(mesh_sizes)
  return config_lib.resolve(config_lib.validate(config))[0]


class _Tensors(contextlib.ExitStack):
  """Every tensor of a checkpoint directory, by the name the family's `weight_names` gives (its
  `text_tensors`), read lazily (`safetensors_reader.Tensor`); `left_out` says what the family leaves out."""

  def __init__(self, path: str | os.PathLike, conversion: Any):
    super().__init__()
    root = epath.Path(path)
    if (root / INDEX).exists():
      files = _indexed_files(root)
      if (root / SINGLE).exists() and SINGLE not in files:
        raise ConfigError(f'{path} holds {SINGLE} beside an {INDEX} that names other files: two exports '
                          'mixed in one directory; export again into a fresh one.')
    elif (root / SINGLE).exists():
      files = [SINGLE]
    else:
      raise ConfigError(f'{path} holds neither {SINGLE} nor {INDEX}: give the directory that '
                        'save_pretrained (or transformers) wrote.')
    self.path, self.tensors = path, {}
    for name in files:
      try:
        file = self.enter_context(safetensors_reader.File(root / name))
      except FileNotFoundError:
        self.close()
        raise ConfigError(f'{path}: {INDEX} lists {name}, which is missing: copy the whole checkpoint '
                          'directory.') from None
      except errors.SafetensorsError as e:
        self.close()
        raise ConfigError(str(e)) from None
      self.tensors.update(file.tensors)
    self.tensors, self.left_out = conversion.text_tensors(self.tensors)

  def get(self, name: str, ours: str, shape: tuple[int, ...]) -> safetensors_reader.Tensor:
    """Tensor `name`, which mintrain parameter `ours` reads, checked to have the `shape` config.json gives."""
    if name not in self.tensors:
      raise ConfigError(f'{self.path}: the checkpoint has no tensor {name!r} (mintrain parameter {ours}); '
                        'its weights and config.json disagree (e.g. tie_word_embeddings, the layer count) or '
                        'a shard is missing: use the config.json and every file saved with these weights.')
    tensor = self.tensors[name]
    if tensor.shape != shape:
      raise ConfigError(f'{self.path}: tensor {name} has shape {tensor.shape}, but config.json makes it '
                        f'{shape}: use the config.json saved with these weights.')
    return tensor


def _indexed_files(root: epath.Path) -> list[str]:
  """The shard files an index names, each a file of `root`; a damaged index is a one-line ConfigError."""
  try:
    weight_map = json.loads((root / INDEX).read_text()).get('weight_map')
  except (ValueError, AttributeError) as e:
    raise ConfigError(f'{root / INDEX} is not a JSON object ({e}); copy it again.') from None
  if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
    raise ConfigError(f'{root / INDEX} has no weight_map of tensor names to files; copy it again.')
  files = sorted(set(weight_map.values()))
  for name in files:
    if '/' in name or (root / name).is_dir():
      raise ConfigError(f'{root / INDEX} lists {name!r}, which is not a file of the directory.')
  return files


@dataclasses.dataclass(frozen=True)
class Source:
  """Where one mintrain parameter lives in a Hugging Face checkpoint."""
  names: tuple[str, ...]  # Its tensors: per layer (with `layers`), then per part (with `parts`), row-major.
  kind: Any  # How the family reshapes each (e.g. `transformer.hf.Kind`).
  layers: int  # Stacked on a leading `layers` axis (scan_layers): that many layers; 0 when not.
  parts: int  # Stacked from that many tensors on its next axis (a mixture's experts); 0 for one tensor.

  @property
  def lead(self) -> tuple[int, ...]:
    """The sizes of the leading axes whose every index is a tensor of its own."""
    return tuple(n for n in (self.layers, self.parts) if n)


def sources(conversion: Any, cfg: Any, params: dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]
           ) -> dict[str, Source]:
  """{our parameter path: its Source} for `params` ({path: (shape, logical axes)})."""
  names = conversion.weight_names(cfg)
  stacked = Relayout.plan(params, dict.fromkeys(names)).stack
  out = {}
  for ours in params:
    per_layer = [names.get(p) for p in stacked[ours]] if ours in stacked else [names.get(ours)]
    if None in per_layer:
      raise ConfigError(f'mintrain parameter {ours} has no Hugging Face tensor.')
    parts = [name if isinstance(name, tuple) else (name,) for name, _ in per_layer]
    out[ours] = Source(tuple(name for part in parts for name in part), per_layer[0][1],
                       len(per_layer) if ours in stacked else 0,
                       len(parts[0]) if isinstance(per_layer[0][0], tuple) else 0)
  return out


def load_params(path: str | os.PathLike, run: Run, mesh: jax.sharding.Mesh | None = None) -> nnx.State:
  """The checkpoint's weights as `run`'s parameters on `mesh` (default `run.mesh`): each process reads
  the slices its devices hold, each tensor once (`_load`)."""
  mesh = mesh or run.mesh
  leaves, treedef = jax.tree_util.tree_flatten_with_path(run.base_params, is_leaf=_is_variable)
  loaded = []
  with _Tensors(path, run.config.family.hf) as tensors:
    if tensors.left_out:
      _log.info(f'{path}: {tensors.left_out}')
    for var, source, files in _checked(tensors, run, leaves):
      abstract = jax.tree.leaves(var)[0]
      value = _load(run.config.family.hf, source, files, abstract.shape, abstract.dtype,
                    NamedSharding(mesh, abstract.sharding.spec))
      loaded.append(var.replace(value) if _is_variable(var) else value)
  return jax.tree_util.tree_unflatten(treedef, loaded)


def check(path: str | os.PathLike, run: Run) -> None:
  """Raises the ConfigError that `load_params` would for a missing tensor or a shape that disagrees with
  config.json, from the files' headers alone: a run checks before it writes anything."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(run.base_params, is_leaf=_is_variable)
  with _Tensors(path, run.config.family.hf) as tensors:
    _checked(tensors, run, leaves, warn=False)  # The load that follows warns.


def _checked(tensors: _Tensors, run: Run, leaves: list,
             warn: bool = True) -> list[tuple[Any, Source, list[safetensors_reader.Tensor]]]:
  """(variable, its Source, its tensors) for each (key path, abstract variable) of `leaves`; the tensors
  checked to exist with the shapes config.json gives, and every tensor to be used (`init.hf_strict`; else,
  with `warn`, a warning names those dropped)."""
  conversion = run.config.family.hf
  where = sources(conversion, run.config.model,
                  {train_state.path_str(key): shape_and_axes(var) for key, var in leaves})
  out = []
  for key, var in leaves:
    ours, shape = train_state.path_str(key), jax.tree.leaves(var)[0].shape
    source = where[ours]
    their_shape = tuple(conversion.their_shape(source.kind, shape[len(source.lead):]))
    out.append((var, source, [tensors.get(name, ours, their_shape) for name in source.names]))
  unused = set(tensors.tensors) - {name for _, source, _ in out for name in source.names}
  if unused:
    what = (f'{tensors.path}: the model config.json describes does not use {len(unused)} of the '
            f"checkpoint's tensors ({_names(unused, tensors.tensors)}); config.json and the weights disagree "
            '(e.g. num_hidden_layers)')
    if run.config.init.hf_strict:
      raise ConfigError(f'{what}: use the config.json saved with these weights, or init.hf_strict=False to '
                        'drop them.')
    if warn:
      _log.warning(f'warning: {what}; they are dropped (init.hf_strict=False).')
  return out


def _names(unused: set[str], every: Iterable[str]) -> str:
  """`unused` in short (transformers lists each): `model.layers.3.*` for a layer none of whose tensors is
  used."""
  layer = re.compile(r'(.*\.layers\.\d+)\.')
  partly = {m.group(1) for name in every if name not in unused and (m := layer.match(name))}
  short = set()
  for name in unused:
    m = layer.match(name)
    short.add(f'{m.group(1)}.*' if m and m.group(1) not in partly else name)
  return ', '.join(sorted(short, key=lambda s: [int(t) if t.isdigit() else t for t in re.split(r'(\d+)', s)]))


def _load(conversion: Any, source: Source, files: list[safetensors_reader.Tensor], shape: tuple[int, ...],
          dtype: np.dtype, sharding: NamedSharding) -> jax.Array:
  """One parameter, each of this process's devices given its slice; devices that hold the same slice
  (replicas) share its read, and each distinct slice is read in one pass over the tensor's rows. On the CPU,
  replicas are copy-on-write mappings of one copy; the other slices share one allocation, for huge pages."""
  devices = [(device, tuple(s.indices(n)[:2] for s, n in zip(index, shape)))
             for device, index in sharding.addressable_devices_indices_map(shape).items()]
  adopted = all(d.platform == 'cpu' for d, _ in devices)  # Others copy the host array: replicas may share it.
  slices: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
  replicas: dict[tuple[tuple[int, int], ...], list[np.ndarray]] = {}
  for bounds, count in collections.Counter(bounds for _, bounds in devices).items():
    shared = adopted and count > 1 and host_allocator.copy_on_write_empty(_shape(bounds), dtype, count)
    if shared:
      slices[bounds], replicas[bounds] = shared
  rest = [bounds for bounds in dict.fromkeys(bounds for _, bounds in devices) if bounds not in slices]
  slices |= zip(rest, host_allocator.adoptable_arrays([_shape(bounds) for bounds in rest], dtype))
  targets = [(tuple(slice(a, b) for a, b in bounds), out) for bounds, out in slices.items()]
  n = len(source.lead)
  # The tensor at leading index `at` (a layer's, an expert's) fills `at - start` of each slice holding it.
  for file, at in zip(files, np.ndindex(*source.lead)):
    part = [(index[n:], out[tuple(i - s.start for i, s in zip(at, index))] if n else out)
            for index, out in targets if all(s.start <= i < s.stop for i, s in zip(at, index))]
    if part:
      conversion.read(source.kind, file, part, shape[n:])
  hosts, taken = [], set()
  for _, bounds in devices:  # On the CPU a device buffer is never shared: its replica's own pages.
    if bounds in replicas:
      hosts.append(replicas[bounds].pop())
    else:
      hosts.append(_copy(slices[bounds]) if adopted and bounds in taken else slices[bounds])
    taken.add(bounds)
  arrays = jax.device_put(hosts, [device for device, _ in devices])
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _shape(bounds: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
  return tuple(b - a for a, b in bounds)


def _copy(x: np.ndarray) -> np.ndarray:
  out = host_allocator.adoptable_empty(x.shape, x.dtype)
  out[...] = x
  return out


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def shape_and_axes(var: nnx.Variable) -> tuple[tuple[int, ...], tuple[str | None, ...]]:
  return tuple(var.shape), tuple(var.get_metadata()['out_sharding'])


def from_pretrained(path: str | os.PathLike, *, base: ml_collections.ConfigDict | None = None) -> nnx.Module:
  """The model of a Hugging Face directory on the current mesh (`jax.set_mesh`; one device without one),
  laid out by `base`'s rules (default mintrain/configs/base.py); `model(tokens_BL)` gives the logits."""
  mesh = jax.sharding.get_mesh()
  if mesh.empty:
    sizes, devices = dict.fromkeys(mesh_lib.AXES, 1), jax.devices()[:1]
  else:
    sizes, devices = dict(mesh.shape), list(mesh.devices.flat)
  run = build(make_config(path, base, sizes), devices)
  params = load_params(path, run, None if mesh.empty else mesh)
  return nnx.merge(run.graphdef, params)
