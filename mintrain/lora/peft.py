"""PEFT LoRA adapters in and out (`adapter_config.json` + `adapter_model.safetensors`), and the merged model.

PEFT names an adapter `base_model.model.<module>.lora_A.weight` (r, in) and `.lora_B.weight` (out, r), where
`<module>` is the Hugging Face module of the adapted weight (its tensor name less `.weight`); the family's
Hugging Face conversion (`Family.hf.weight_names`) gives it. Ours are A (*in, r) and B (r, *out), whose
flattened input and output follow the Hugging Face layout's (one reshape and a transpose each way).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from etils import epath
from flax import nnx

from mintrain.errors import ConfigError
from mintrain.lora import LoRA
from mintrain.models.layers import LAYERS, Frozen
from mintrain.partitioning import AxisRules

CONFIG = 'adapter_config.json'
WEIGHTS = 'adapter_model.safetensors'


def _modules(config: Any, layout: list) -> dict[str, tuple[str, list[tuple[str, int | None]]]]:
  """{adapted weight's path: (its A's path, [(Hugging Face module, layer in a stacked weight or None)])}."""
  names = config.family.hf.weight_names(config.model) if config.family.hf is not None else {}
  out = {}
  for p in layout:
    if not p.trainable or not p.path.endswith('.a'):
      continue
    ours = p.path[:-2]
    if p.logical_axes[0] == LAYERS:
      parts = ours.split('.')
      per_layer = [('.'.join(parts[:1] + [str(i)] + parts[1:]), i) for i in range(p.shape[0])]
    else:
      per_layer = [(ours, None)]
    modules = []
    for path, layer in per_layer:
      name = names.get(path)
      if name is None or not isinstance(name[0], str):
        raise ConfigError(f'The adapter of {ours} has no PEFT module (a mixture\'s experts are one PEFT '
                          'parameter, not a module): export the merged model instead (no --adapter).')
      modules.append((name[0].removesuffix('.weight'), layer))
    out[ours] = (p.path, modules)
  return out


def save_adapter(params: nnx.State, config: Any, layout: list, out: epath.Path) -> list[str]:
  """Writes `params` (the adapters) as a PEFT adapter directory; returns the files written."""
  from safetensors.numpy import save_file

  flat = {'.'.join(map(str, path)): np.asarray(jax.device_get(v[...]))
          for path, v in nnx.to_flat_state(params)}
  tensors, targets = {}, set()
  for ours, (_, modules) in _modules(config, layout).items():
    a_all, b_all = flat[f'{ours}.a'], flat[f'{ours}.b']
    for module, layer in modules:
      a, b = (a_all, b_all) if layer is None else (a_all[layer], b_all[layer])
      r = a.shape[-1]
      tensors[f'base_model.model.{module}.lora_A.weight'] = np.ascontiguousarray(a.reshape(-1, r).T)
      tensors[f'base_model.model.{module}.lora_B.weight'] = np.ascontiguousarray(b.reshape(r, -1).T)
      targets.add(module.rsplit('.', 1)[-1])
  lora = config.lora
  adapter = {'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': lora.rank, 'lora_alpha': lora.alpha,
             'lora_dropout': lora.dropout, 'target_modules': sorted(targets), 'bias': 'none',
             'fan_in_fan_out': False, 'use_rslora': False, 'init_lora_weights': True, 'inference_mode': True,
             'base_model_name_or_path': config.init.hf_checkpoint or None, 'modules_to_save': None}
  save_file(tensors, os.fspath(out / WEIGHTS), metadata={'format': 'pt'})
  (out / CONFIG).write_text(json.dumps(adapter, indent=2))
  return [CONFIG, WEIGHTS]


def load_adapter(path: str | os.PathLike, config: Any, layout: list, abstract_params: nnx.State) -> nnx.State:
  """A PEFT adapter directory's A and B as the run's adapter parameters (placed as `abstract_params`); a
  one-line ConfigError for one whose r, lora_alpha or target modules differ from the lora section's."""
  from safetensors.numpy import load_file

  root = epath.Path(path)
  try:
    adapter = json.loads((root / CONFIG).read_text())
    tensors = load_file(os.fspath(root / WEIGHTS))
  except FileNotFoundError as e:
    raise ConfigError(f'init.lora_adapter={os.fspath(path)!r} is not a PEFT adapter directory: no '
                      f'{os.path.basename(e.filename or CONFIG)}.') from None
  except ValueError as e:
    raise ConfigError(f'init.lora_adapter={os.fspath(path)!r}: {CONFIG} or {WEIGHTS} is damaged '
                      f'({e}).') from None
  lora = config.lora
  if adapter.get('peft_type') != 'LORA' or adapter.get('r') != lora.rank or float(
      adapter.get('lora_alpha', 0)) != lora.alpha:
    raise ConfigError(f'init.lora_adapter={os.fspath(path)!r} is a {adapter.get("peft_type")} adapter of '
                      f'r={adapter.get("r")}, lora_alpha={adapter.get("lora_alpha")}; the run has lora.rank='
                      f'{lora.rank}, lora.alpha={lora.alpha}: set those to match.')
  values = {}
  for ours, (_, modules) in _modules(config, layout).items():
    a_parts, b_parts = [], []
    for module, _ in modules:
      key = f'base_model.model.{module}'
      if f'{key}.lora_A.weight' not in tensors:
        raise ConfigError(f'init.lora_adapter={os.fspath(path)!r} has no adapter for {module} (mintrain '
                          f'{ours}): its target_modules {adapter.get("target_modules")} and lora.targets='
                          f'{lora.targets!r} differ.')
      a_parts.append(tensors[f'{key}.lora_A.weight'].T)
      b_parts.append(tensors[f'{key}.lora_B.weight'].T)
    values[f'{ours}.a'] = a_parts if modules[0][1] is not None else a_parts[0]
    values[f'{ours}.b'] = b_parts if modules[0][1] is not None else b_parts[0]

  def place(path, var):
    name = '.'.join(map(str, path))
    x = values[name]
    x = np.stack(x) if isinstance(x, list) else x
    abstract = var.get_value()
    host = np.asarray(x.reshape(abstract.shape), abstract.dtype)
    return var.replace(jax.device_put(host, abstract.sharding))

  flat = nnx.to_flat_state(abstract_params)
  return nnx.from_flat_state([(path, place(path, var)) for path, var in flat])


def merged(model: nnx.Module, rules: AxisRules) -> nnx.Module:
  """`model` with each adapted weight merged (base + alpha/r A @ B, dequantized) and every frozen one a
  plain parameter again, in place: the model a Hugging Face export writes."""
  found = [(module, attr, var) for _, module in nnx.iter_modules(model)
           if not isinstance(module, LoRA)
           for attr, var in list(vars(module).items()) if isinstance(var, (LoRA, Frozen))]
  for module, attr, var in found:
    if isinstance(var, LoRA):
      value = var.gather(rules, np.dtype(var.param_dtype))
      setattr(module, attr, nnx.Param(value, out_sharding=var.axes, eager_sharding=False))
    else:
      setattr(module, attr, nnx.Param(var[...], **var.get_metadata()))
  return model

