"""Saving a model as a Hugging Face directory (`save_pretrained`) that `transformers` loads: one tensor at
a time from process 0, in shards of at most `max_shard_size` bytes, named by the family's `weight_names`
as loading reads them (`load.sources`); the directory is replaced whole, never mixed with another export.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from mintrain import errors, train_state
from mintrain.errors import ConfigError
from mintrain.hf.load import INDEX, SINGLE, shape_and_axes, sources
from mintrain.models import FAMILIES

# What an export writes: a directory holding only these (or nothing) may be replaced by a new export whole.
EXPORTED = re.compile(r'config\.json|generation_config\.json|model(-\d{5}-of-\d{5})?\.safetensors|'
                      r'model\.safetensors\.index\.json|tokenizer(_config)?\.json|tokenizer\.model|'
                      r'special_tokens_map\.json|chat_template\.jinja|adapter_config\.json|'
                      r'adapter_model\.safetensors')


def _layer(x_L: jax.Array, layer: int) -> jax.Array:
  """One layer of a stacked array whose `layers` dimension may be split (over `stage`): gathered there."""
  sharding = x_L.sharding
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return x_L[layer]
  rest = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
  return x_L.at[layer].get(out_sharding=rest)


def _host(x: jax.Array) -> np.ndarray:
  """The whole array on this host (a collective when it spans processes)."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def check_out_dir(out_dir: str | os.PathLike, *, overwrite: bool = False) -> epath.Path:
  """`out_dir` if an export may write it: missing, empty, an earlier export, or anything with `overwrite`."""
  out = epath.Path(out_dir)
  if out.exists() and not out.is_dir():
    raise errors.StorageError(f'{out} is a file; give a directory to export into.')
  foreign = sorted(p.name for p in out.iterdir() if not EXPORTED.fullmatch(p.name)) if out.exists() else []
  if foreign and not overwrite:
    raise errors.StorageError(f'{out} holds {", ".join(foreign[:3])}{", ..." if len(foreign) > 3 else ""}, '
                              'which no export writes; give a new or empty directory, or --overwrite to '
                              'replace it whole.')
  return out


@contextlib.contextmanager
def _replacing(out: epath.Path) -> Iterator[epath.Path]:
  """A fresh directory beside `out` that replaces it whole once everything is written, and is removed if
  anything fails: `out` never mixes two exports nor holds half of one."""
  out.parent.mkdir(parents=True, exist_ok=True)
  staging = out.parent / f'.{out.name}.export-{uuid.uuid4().hex[:8]}'
  staging.mkdir()
  try:
    yield staging
  except BaseException:
    staging.rmtree()
    raise
  old = out.parent / f'.{out.name}.replaced-{uuid.uuid4().hex[:8]}'
  if out.exists():
    out.rename(old)
  staging.rename(out)
  if old.exists():
    old.rmtree()


SOURCE_FILES = ('config.json', 'generation_config.json')  # What an export carries from the model it began as.
RUN_SOURCE = 'hf_source'  # WORKDIR/hf_source: a run's copy of its init.hf_checkpoint's SOURCE_FILES.
# Keys of an older config.json that the exported `rope_parameters` replace.
LEGACY_ROPE = ('rope_scaling', 'rope_theta', 'rope_local_base_freq')


def save_sources(hf_dir: str | os.PathLike, run_dir: str | os.PathLike) -> None:
  """Copies `hf_dir`'s config.json and generation_config.json into the run (`RUN_SOURCE`), so an export
  carries their special token ids and other fields even after the source has moved."""
  target = epath.Path(run_dir) / RUN_SOURCE
  target.mkdir(parents=True, exist_ok=True)
  for name in SOURCE_FILES:
    if (epath.Path(hf_dir) / name).exists():
      (target / name).write_text((epath.Path(hf_dir) / name).read_text())


def _source_json(source: str | os.PathLike | None, name: str) -> dict[str, Any]:
  path = None if source is None else epath.Path(source) / name
  if path is None or not path.exists():
    return {}
  try:
    loaded = json.loads(path.read_text())
  except ValueError:
    return {}
  return loaded if isinstance(loaded, dict) else {}


def config_files(ours: dict[str, Any], source: str | os.PathLike | None, tokenizer: Any,
                 context_length: int | None) -> dict[str, dict[str, Any]]:
  """config.json and generation_config.json of an export: the family's own keys, over every other field of
  the config.json the model began as (`source`: special token ids, max_position_embeddings, ...); without
  one, the ids from `tokenizer` and `context_length`; generation_config.json the source's, else its ids
  (none without any)."""
  original = _source_json(source, 'config.json')
  carried = {k: v for k, v in original.items()
             if k not in ours and not (k in LEGACY_ROPE and 'rope_parameters' in ours) and k != 'torch_dtype'}
  config = {**carried, **ours}
  ids = {'bos_token_id': getattr(tokenizer, 'bos_id', None),
         'eos_token_id': getattr(tokenizer, 'eos_id', None)}
  for key, value in ids.items():
    if config.get(key) is None and value is not None:
      config[key] = value
  if 'max_position_embeddings' not in config and context_length:
    config['max_position_embeddings'] = context_length
  special = ('bos_token_id', 'eos_token_id', 'pad_token_id')
  generation = _source_json(source, 'generation_config.json') or {
      key: config[key] for key in special if config.get(key) is not None}
  return {'config.json': config, **({'generation_config.json': generation} if generation else {})}


def save_pretrained(model: nnx.Module, out_dir: str | os.PathLike, *, dtype: str | None = None,
                    max_shard_size: int = 2**30, tokenizer: Any = None, overwrite: bool = False,
                    source: str | os.PathLike | None = None, context_length: int | None = None) -> list[str]:
  """Writes `model` (and `tokenizer`'s files) as a Hugging Face directory that `transformers` loads, in
  place of what `out_dir` held (`check_out_dir`); returns the files written. Its config.json and
  generation_config.json carry what the directory `source` (the model it began as) says (`config_files`).

  Every process must call it (a sharded parameter is gathered collectively); process 0 writes.
  """
  is_main = jax.process_index() == 0
  out = check_out_dir(out_dir, overwrite=overwrite)
  with _replacing(out) if is_main else contextlib.nullcontext(out) as staging:
    return _write(model, staging, dtype, max_shard_size, tokenizer, is_main, source, context_length)


def _write(model: nnx.Module, out: epath.Path, dtype: str | None, max_shard_size: int, tokenizer: Any,
           is_main: bool, source_dir: str | os.PathLike | None, context_length: int | None) -> list[str]:
  from safetensors.numpy import save_file

  cfg = model.cfg
  family = next((f for f in FAMILIES.values() if isinstance(cfg, f.config) and f.hf is not None), None)
  if family is None:
    raise ConfigError(f'{type(cfg).__name__} models have no Hugging Face architecture.')
  out_dtype = np.dtype(dtype or cfg.param_dtype)
  _, params = nnx.split(model, nnx.Param)
  names = family.hf.weight_names(cfg)  # A name of None: a parameter of training only, not exported.
  variables = {train_state.path_str(key): var for key, var in nnx.to_flat_state(params)
               if names.get(train_state.path_str(key), ()) is not None}
  where = sources(family.hf, cfg, {path: shape_and_axes(var) for path, var in variables.items()})
  # Each shard is written once full; its final name needs the shard count, so it is renamed at the end.
  shard: dict[str, np.ndarray] = {}
  shard_names: list[list[str]] = []
  total = 0

  def flush() -> None:
    save_file(shard, os.fspath(out / f'part-{len(shard_names)}.tmp'), metadata={'format': 'pt'})
    shard_names.append(list(shard))
    shard.clear()

  for path, var in variables.items():
    source = where[path]
    per_layer = len(source.names) // max(source.layers, 1)
    for layer in range(max(source.layers, 1)):
      # Every process takes part in the gather of one layer's tensors; process 0 keeps them. A layer's
      # parts (experts) are split on the host: indexing the device array would cross their mesh axis.
      host = _host(_layer(var[...], layer) if source.layers else var[...])
      if not is_main:
        continue
      names = source.names[layer * per_layer:(layer + 1) * per_layer]
      for name, value in zip(names, host if source.parts else [host]):
        tensor = family.hf.write(source.kind, value).astype(out_dtype)
        if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > max_shard_size:
          flush()
        shard[name] = tensor
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
  written = config_files(family.hf.config_json(cfg, str(out_dtype)), source_dir, tokenizer, context_length)
  for name, content in written.items():
    (out / name).write_text(json.dumps(content, indent=2))
  tokenizer_files = tokenizer.save(out) if tokenizer is not None else []
  return files + ([INDEX] if len(files) > 1 else []) + list(written) + tokenizer_files
