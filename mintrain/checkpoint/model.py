"""A checkpoint's model, built from the checkpoint's own saved config on a mesh the caller picks: what
evaluation (and any other reader of a trained model) starts from. Only the parameters are read."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import jax
import ml_collections
from etils import epath
from flax import nnx
from jax.sharding import Mesh

from mintrain import config as config_lib
from mintrain import mesh as mesh_lib
from mintrain.build import build
from mintrain.checkpoint import checkpoints as ckpt_lib
from mintrain.config import Config
from mintrain.data import tokenizer
from mintrain.errors import CheckpointError
from mintrain.partitioning import AxisRules


@dataclasses.dataclass(frozen=True)
class RestoredModel:
  model: nnx.Module  # Its parameters on `mesh`; call it under `jax.set_mesh(mesh)`.
  config: Config  # The checkpoint's config on the chosen mesh and rules.
  tokenizer: tokenizer.Tokenizer  # The one the run trained with.
  mesh: Mesh
  step: int
  directory: epath.Path  # The run's checkpoints directory.


def layout_config(config_file: str | None, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """The mesh (and rules) to run a checkpoint on, known before it is read (so devices can be simulated):
  a config file's, else one device; `mesh.*` overrides apply."""
  if config_file:
    given = config_lib.load(config_file)
    layout = ml_collections.ConfigDict({'mesh': given.mesh, 'partitioning': given.partitioning})
  else:
    layout = ml_collections.ConfigDict({'mesh': config_lib.one_device_mesh()})
  config_lib.apply_overrides(layout, [o for o in overrides if o.startswith('mesh.')])
  return layout


def restore_model(workdir: str | os.PathLike, *, step: int | None = None,
                  layout: ml_collections.ConfigDict | None = None, overrides: Sequence[str] = (),
                  devices: Sequence[jax.Device] | None = None) -> RestoredModel:
  """The model of `step` (default: the one `workdir` names, else the newest) of a run, its checkpoints or
  one step directory, on `layout` (`layout_config`; default one device) with `key=value` overrides of the
  saved config. Raises one-line mintrain errors for a missing run or step and a config that cannot work."""
  layout = layout if layout is not None else layout_config(None)
  directory, named = ckpt_lib.find_run_checkpoints(workdir)
  checkpoints = ckpt_lib.Checkpoints(directory, read_only=True)
  try:
    steps = checkpoints.steps()
    step = step if step is not None else named if named is not None else (steps or [None])[-1]
    if step not in steps:
      raise CheckpointError(f'{workdir}: no complete checkpoint of step {step} (it has: '
                            f'{", ".join(map(str, steps)) or "none"}).')
    metadata = checkpoints.metadata(step)
    config = config_lib.upgrade(metadata['config'])
    if not config.lora.rank:
      config.init.hf_checkpoint = ''  # The saved model section is complete; the source may be gone.
    config.init.lora_adapter = ''  # A LoRA run's adapters are the checkpoint's; its base is read below.
    config.mesh.update(layout.mesh.to_dict())  # The saved section's other keys (dcn_*) stay.
    if 'partitioning' in layout:
      config.partitioning = layout.partitioning
    config_lib.apply_overrides(config, overrides)
    config.train.grad_accum_steps = 1
    checked = config_lib.validate(config)
    mesh_shape = mesh_lib.make_mesh(checked.mesh.sizes, devices, checked.mesh.slices).shape
    batch_ways = AxisRules.from_config(checked.partitioning).ways('batch', mesh_shape)
    # Only the parameters are read: any batch that splits over the mesh serves the build's checks.
    run = build(checked.replace(train=dataclasses.replace(checked.train, global_batch_size=batch_ways)),
                devices)
    params = checkpoints.restore(step, run.abstract_state, params_only=True).state['params']
  finally:
    checkpoints.close()
  tok = tokenizer.for_run(directory.parent, run.config.data.tokenizer or 'byte')
  with jax.set_mesh(run.mesh):
    frozen = None
    if run.config.lora.enabled:  # Its base, from where the run read it (refused if it changed).
      from mintrain import loop

      loop.check_lora_base(run, metadata.get('lora_base'))
      frozen = loop.frozen_base(run)
    model = run.model(params, frozen)
  return RestoredModel(model, run.config, tok, run.mesh, step, directory)
