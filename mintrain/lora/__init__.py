"""LoRA and QLoRA: low-rank adapters on a frozen, optionally quantized base (the `lora` config section).

`apply` turns a family's model into its LoRA form. Each weight the family names as a projection
(`Family.lora_targets`) becomes a `LoRA` module whose `gather` (`layers.gather`, which every call site uses)
returns `base + (alpha / rank) * A @ B` in the compute layout, so stacked q/k/v, gate/up and experts get
adapters alike; every other parameter becomes `layers.Frozen`. A (input axes + `lora_rank`) and B
(`lora_rank` + output axes) are the only `nnx.Param`s left, so gradients, optimizer state and checkpoints
hold the adapters alone. The merged form cannot drop out the adapter's input (PEFT's lora_dropout): with
`lora.dropout` > 0, in training, a call site takes the base alone and adds the adapter's term on the
dropped-out input itself (`layers.gather_split`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import string
import zlib
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from mintrain.errors import ConfigError
from mintrain.fields import option
from mintrain.lora import quantize
from mintrain.models.layers import LAYERS, Frozen, dropout, matmul
from mintrain.partitioning import AxisRules

RANK = 'lora_rank'  # Logical name of the adapters' rank dimension.
BASE_DTYPES = ('float32', 'bfloat16', 'int8', 'nf4')


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  rank: int = option(at_least=0)
  alpha: float = option(above=0)
  dropout: float = option(at_least=0, below=1)
  targets: str = option()
  base_dtype: str = option(choices=BASE_DTYPES)
  nf4_block_size: int = option(at_least=1)

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def target_names(self) -> tuple[str, ...]:
    return tuple(t.strip() for t in self.targets.split(',') if t.strip())

  @property
  def scaling(self) -> float:
    return self.alpha / self.rank

  def check(self, family_targets: Mapping[str, Mapping[str, tuple[int, int]]] | None,
            model_name: str) -> None:
    """A ConfigError for target names the family does not have (or a family without any)."""
    if not self.enabled:
      return
    if not family_targets:
      raise ConfigError(f'lora.rank={self.rank}: model family {model_name!r} names no LoRA targets; '
                        'set lora.rank=0.')
    if not self.target_names:
      raise ConfigError(f'lora.targets={self.targets!r} names no target; choose from '
                        f'{",".join(family_targets)}.')
    unknown = [t for t in self.target_names if t not in family_targets]
    if unknown:
      raise ConfigError(f'lora.targets={self.targets!r}: {", ".join(map(repr, unknown))} is not a target of '
                        f'model family {model_name!r}; choose from {",".join(family_targets)}.')


class LoRA(nnx.Module):
  """A frozen base weight (*lead, *inputs, *outputs), stored as `base_dtype` (int8 and nf4 quantized; nf4's
  last axis half as long, two codes a byte), with a rank-r adapter A (*lead, *inputs, r), B (*lead, r,
  *outputs); rank 0: the (quantized) base alone."""

  def __init__(self, base: nnx.Variable, *, lead: int, inputs: int, cfg: LoraConfig, rank: int,
               key: jax.Array, layer_keys: int, rules: AxisRules):
    value, axes = base[...], tuple(base.get_metadata()['out_sharding'])
    mesh_empty = jax.sharding.get_abstract_mesh().empty
    # Counts of axes, not the axes: a scan over stacked layers gives each layer's slice its own.
    self.inputs, self.outputs, self.rank = inputs, len(axes) - lead - inputs, rank
    self.scaling = cfg.scaling if rank else 0.0
    self.dropout = cfg.dropout if rank else 0.0
    if self.dropout and lead - (axes[:1] == (LAYERS,)) > 0:
      raise ConfigError(f'lora.dropout={cfg.dropout} with the adapters of a mixture\'s experts is not '
                        'supported (they run inside the expert all-to-all); use 0 or leave those targets '
                        'out.')
    self.base_dtype, self.block = cfg.base_dtype, cfg.nf4_block_size
    self.param_dtype = str(value.dtype)
    in_axes = tuple(range(lead, lead + inputs))
    if cfg.base_dtype == 'int8':
      codes, scale = quantize.quantize_int8(value, in_axes)
      scale_axes = axes[:lead] + axes[lead + inputs:]
    elif cfg.base_dtype == 'nf4':
      if value.shape[-1] % self.block:
        raise ConfigError(f'lora.nf4_block_size={self.block} does not divide the last dimension '
                          f'({value.shape[-1]}) of a base weight of shape {tuple(value.shape)}; use a '
                          'divisor of it.')
      if value.shape[-1] % 2:
        raise ConfigError(f'lora.base_dtype=nf4 packs two codes a byte along the last dimension, which is '
                          f'odd ({value.shape[-1]}) in a base weight of shape {tuple(value.shape)}; use '
                          'int8 or bfloat16.')
      scale_axes = (*axes[:-1], None)  # Blocks along the last axis, which stays whole for them.
      whole = value if mesh_empty else jax.sharding.reshard(value, rules.param_spec(scale_axes))
      codes, scale = quantize.quantize_nf4(whole, self.block)
      codes = codes if mesh_empty else jax.sharding.reshard(codes, rules.param_spec(axes))
    else:
      codes, scale, scale_axes = value.astype(cfg.base_dtype), None, ()
    self.base = Frozen(codes, out_sharding=axes, eager_sharding=False)
    if scale is not None:
      self.absmax = Frozen(scale, out_sharding=scale_axes, eager_sharding=False)
    if not rank:
      return
    shape = value.shape
    a_shape = (*shape[:lead + inputs], rank)
    b_shape = (*shape[:lead], rank, *shape[lead + inputs:])
    a_axes, b_axes = (*axes[:lead + inputs], RANK), (*axes[:lead], RANK, *axes[lead + inputs:])
    bound = 1 / math.sqrt(math.prod(shape[lead:lead + inputs]))  # PEFT: kaiming_uniform(a=sqrt(5)) of A.
    a_spec = None if mesh_empty else rules.param_spec(a_axes)
    if layer_keys:  # Stacked layers: each layer's A drawn from its own key, as when unstacked.
      draws = [jax.random.uniform(jax.random.fold_in(key, i), a_shape[1:], value.dtype, -bound, bound)
               for i in range(layer_keys)]
      a = jnp.stack(draws)
      a = a if mesh_empty else jax.sharding.reshard(a, a_spec)
    else:
      a = jax.random.uniform(key, a_shape, value.dtype, -bound, bound, out_sharding=a_spec)
    b = jnp.zeros(b_shape, value.dtype, out_sharding=None if mesh_empty else rules.param_spec(b_axes))
    self.a = nnx.Param(a, out_sharding=a_axes, eager_sharding=False, weight_decay=True)
    self.b = nnx.Param(b, out_sharding=b_axes, eager_sharding=False, weight_decay=True)

  @property
  def axes(self) -> tuple[str | None, ...]:
    return tuple(self.base.get_metadata()['out_sharding'])

  def gather_base(self, rules: AxisRules, dtype: jnp.dtype) -> jax.Array:
    """The base weight in its compute layout and `dtype`, dequantized after the (smaller) codes move."""
    axes = self.axes
    codes = rules.reshard(self.base[...], axes)
    if self.base_dtype == 'int8':
      scale = rules.reshard(self.absmax[...], self.absmax.get_metadata()['out_sharding'])
      lead = len(axes) - self.inputs - self.outputs
      return quantize.dequantize_int8(codes, scale, tuple(range(lead, lead + self.inputs)), dtype)
    if self.base_dtype == 'nf4':
      scale = rules.reshard(self.absmax[...], (*axes[:-1], None))
      return quantize.dequantize_nf4(codes, scale, self.block, dtype)
    return codes.astype(dtype)

  def delta(self, rules: AxisRules, dtype: jnp.dtype) -> jax.Array:
    """(alpha / rank) * A @ B in the base's compute layout."""
    axes = self.axes
    lead, ins, outs = _letters(len(axes) - self.inputs - self.outputs, self.inputs, self.outputs)
    a = rules.reshard(self.a[...].astype(dtype), self.a.get_metadata()['out_sharding'])
    b = rules.reshard(self.b[...].astype(dtype), self.b.get_metadata()['out_sharding'])
    ab = matmul(f'{lead}{ins}r,{lead}r{outs}->{lead}{ins}{outs}', a, b, rules.activation_spec(axes))
    return (ab * jnp.asarray(self.scaling, dtype)).astype(dtype)

  def term(self, x: jax.Array, *, rules: AxisRules, key: jax.Array) -> jax.Array:
    """(alpha / rank) * dropout(x) @ A @ B for activations x (batch, length, *inputs), in the layout of the
    matmul's output (batch, length, *outputs): PEFT's adapter path with lora_dropout."""
    _, ins, outs = _letters(0, self.inputs, self.outputs)
    dtype = x.dtype
    a = rules.reshard(self.a[...].astype(dtype), self.a.get_metadata()['out_sharding'])
    b = rules.reshard(self.b[...].astype(dtype), self.b.get_metadata()['out_sharding'])
    x = dropout(x, self.dropout, key)
    xa = matmul(f'BL{ins},{ins}r->BLr', x, a, rules.activation_spec(('batch', 'length', RANK), x.shape[:2]))
    out_axes = ('batch', 'length', *self.axes[len(self.axes) - self.outputs:])
    y = matmul(f'BLr,r{outs}->BL{outs}', xa, b, rules.activation_spec(out_axes, x.shape[:2]))
    return y * jnp.asarray(self.scaling, dtype)

  def gather(self, rules: AxisRules, dtype: jnp.dtype) -> jax.Array:
    """The merged weight, base + (alpha / rank) * A @ B, as `layers.gather` gives a plain one."""
    w = self.gather_base(rules, dtype)
    return w + self.delta(rules, dtype) if self.rank else w


def base_fingerprint(path: str | os.PathLike) -> dict[str, str]:
  """Where a LoRA run's base comes from: the Hugging Face directory's absolute path and a hash of its
  config.json and safetensors files' names, sizes, modification times, headers and first 64 KiB of tensor
  data (cheap: a few reads per file, whatever its size)."""
  digest = hashlib.sha256()
  root = os.path.abspath(os.fspath(path))
  for name in sorted(os.listdir(root)):
    if name.endswith('.safetensors') or name == 'config.json':
      file = os.path.join(root, name)
      stat = os.stat(file)
      with open(file, 'rb') as f:
        head = f.read(8) if name.endswith('.safetensors') else b''
        start = f.read(int.from_bytes(head, 'little') + (1 << 16) if head else stat.st_size)
      digest.update(f'{name}:{stat.st_size}:{stat.st_mtime_ns}:'.encode() + start)
  return {'path': root, 'fingerprint': digest.hexdigest()}


def _letters(lead: int, inputs: int, outputs: int) -> tuple[str, str, str]:
  letters = [c for c in string.ascii_lowercase if c != 'r']
  return (''.join(letters[:lead]), ''.join(letters[lead:lead + inputs]),
          ''.join(letters[lead + inputs:lead + inputs + outputs]))


def unstacked_path(path: str) -> tuple[str, int | None]:
  """(the path without its layer index, the index or None): a layer's key, the same in either layout."""
  parts = path.split('.')
  digits = [i for i, p in enumerate(parts) if p.isdigit()]
  if not digits:
    return path, None
  i = digits[0]
  return '.'.join(parts[:i] + parts[i + 1:]), int(parts[i])


def _target(path: str, wanted: Mapping[str, tuple[int, int]]) -> str | None:
  for rel in wanted:
    if path == rel or path.endswith('.' + rel):
      return rel
  return None


def apply(model: nnx.Module, cfg: LoraConfig, family_targets: Mapping[str, Mapping[str, tuple[int, int]]],
          seed: int, rules: AxisRules) -> nnx.Module:
  """`model` in its LoRA form, in place: the family's projections as `LoRA` modules (adapters of
  `cfg.rank` on those `cfg.targets` names, the base alone on the others), every other parameter `Frozen`.
  A is drawn from `seed` and the weight's path, the same for stacked and unstacked layers."""
  chosen = {rel for name in cfg.target_names for rel in family_targets[name]}
  shapes = {rel: spec for specs in family_targets.values() for rel, spec in specs.items()}
  base_key = jax.random.key(seed, impl='threefry2x32')
  found = [(path, module, attr, var) for path, module in nnx.iter_modules(model)
           for attr, var in list(vars(module).items()) if isinstance(var, nnx.Param)]
  for path, module, attr, var in found:
    name = '.'.join(str(p) for p in (*path, attr))
    rel = _target(name, shapes)
    if rel is None:
      setattr(module, attr, Frozen(var[...], **var.get_metadata()))
      continue
    lead, inputs = shapes[rel]
    stacked = int(tuple(var.get_metadata()['out_sharding'])[:1] == (LAYERS,))
    key_path, layer = unstacked_path(name)
    key = jax.random.fold_in(base_key, zlib.crc32(key_path.encode()))
    if layer is not None:
      key = jax.random.fold_in(key, layer)
    rank = cfg.rank if rel in chosen else 0
    setattr(module, attr, LoRA(var, lead=lead + stacked, inputs=inputs, cfg=cfg, rank=rank, key=key,
                               layer_keys=var.shape[0] if stacked else 0, rules=rules))
  return model
