"""One way to build a run, for the loop, scripts, benchmarks and tests alike: from a validated config and
devices to the mesh, rules, layout, state set-up, steps and batches. Nothing is allocated: the layout comes
from abstract evaluation and is checked before anything is traced on the mesh."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mintrain import lora, partitioning, report, train_state
from mintrain import mesh as mesh_lib
from mintrain.data.batches import GlobalBatches, make_batches
from mintrain.data.prompts import PromptBatches
from mintrain.data.tokenizer import Tokenizer
from mintrain.errors import ConfigError
from mintrain.models.family import Placement
from mintrain.models.layers import Draw, Frozen, ParamKeys, merge
from mintrain.optimizer import make_optimizer, schedule
from mintrain.partitioning import AxisRules
from mintrain.train_state import ParamInfo, TrainState
from mintrain.train_step import make_eval_step, make_train_step

if TYPE_CHECKING:  # Only for annotations: mintrain.config imports the sections' owners.
  from mintrain.config import Config


@dataclasses.dataclass(frozen=True)
class Run:
  """Everything a run needs that follows from the config and the devices."""

  config: Config  # Its model options left to 'auto' set for the devices' platform (`for_platform`).
  mesh: Mesh
  rules: AxisRules
  placement: Placement  # What the devices and mesh decide for the model, given to its constructor.
  notes: list[str]  # What the placement changes that a user should read (`placement_notes`).
  layout: list[ParamInfo]
  graphdef: nnx.GraphDef
  tx: optax.GradientTransformation
  abstract_state: TrainState  # ShapeDtypeStructs with concrete NamedShardings of `mesh`.
  init: train_state.Initialiser  # The state the seed draws: `()`, or `compile()` and call; under the mesh.
  from_params: Callable[[nnx.State], TrainState]  # Jitted: fresh optimizer state and step 0 around params.
  train_step: Callable  # Jitted, state donated: (state, batch) -> (state, metrics).
  # Jitted: (params, batch, reference=None) -> (summed loss, count) over its counted targets (or pairs).
  eval_step: Callable
  plan: report.MemoryPlan
  # The parameters of the model without LoRA (ShapeDtypeStructs in Variables, with shardings of `mesh`): what
  # a Hugging Face checkpoint fills. Without LoRA, `abstract_state.params`.
  base_params: nnx.State
  # Jitted: the state (fresh adapters, optimizer state, step 0) around such base parameters, donated: with
  # LoRA its frozen part is them, quantized as `lora.base_dtype` says. Without LoRA, `from_params`.
  from_base: Callable[[nnx.State], TrainState]
  frozen_from_seed: Callable[[], nnx.State]  # Jitted: the frozen parameters the seed draws.

  def batches(self, tok: Tokenizer, split: str = 'train') -> GlobalBatches | PromptBatches:
    """Global batches of `split` read with the run's tokenizer, each process reading only its devices' rows;
    call under the mesh."""
    if self.config.objective.read_batches:  # What the objective reads itself (whole prompts).
      return self.config.objective.read_batches(self.config, tok)
    return make_batches(self.config, self.mesh, self.rules, tok, split=split)

  def model(self, params: nnx.State, frozen: nnx.State | None = None) -> nnx.Module:
    """The model module with these parameters (e.g. restored ones) and frozen ones, to call or sample from."""
    return merge(self.graphdef, params, frozen)


def build(config: Config, devices: Sequence[jax.Device] | None = None) -> Run:
  """The run of `config` on a mesh over `devices` (default: all of the default backend's)."""
  mesh = mesh_lib.make_mesh(config.mesh.sizes, devices, config.mesh.slices)
  family = config.family
  rules = AxisRules.from_config(config.partitioning)
  rules.check_mesh_axes(mesh.axis_names)
  placement = Placement.of(rules, mesh, config.pipeline)
  config = config.replace(model=config.model.for_platform(placement.platform))
  _check_batch_split(config, rules, mesh)
  _check_microbatches(config, rules, mesh, placement)
  _check_length_split(config, rules, mesh)
  notes = config.model.placement_notes(placement, config.train.seq_len)
  make_base = functools.partial(family.make, config.model, rules, placement)

  def with_lora(model: nnx.Module) -> nnx.Module:
    return lora.apply(model, config.lora, family.lora_targets, config.seed, rules)

  make = (lambda rngs: with_lora(make_base(rngs))) if config.lora.enabled else make_base
  abstract, draws = train_state.abstract_model(make, config.seed)
  layout = train_state.param_layout(abstract, rules, mesh)
  graphdef, _, _ = nnx.split(abstract, nnx.Param, Frozen)
  objective = config.objective
  updates = objective.updates_per_step(config)
  tx = make_optimizer(config.optimizer, config.train.steps * updates)
  draw, from_params = train_state.make_init(make, tx, config.seed, objective.keeps_reference(config))
  keys = train_state.draw_keys(config.seed, draws)  # Host arrays: building allocates nothing on devices.
  with jax.set_mesh(mesh):
    own_draws: list[Draw] = []
    abstract_state = _concrete(jax.eval_shape(functools.partial(draw, record=own_draws), keys), mesh)
  shardings = jax.tree.map(lambda x: x.sharding, abstract_state)
  init = train_state.Initialiser(jax.jit(draw, donate_argnums=1), tuple(keys), tuple(own_draws))
  # The keys stay arguments, so that XLA sees them as such (`draw_keys`).
  frozen = jax.jit(lambda keys: draw(keys).frozen, out_shardings=shardings.frozen)
  frozen_from_seed = functools.partial(frozen, keys)
  from_base = from_params
  base_params = abstract_state.params
  if config.lora.enabled:
    base_graphdef = nnx.split(train_state.abstract_model(make_base, config.seed)[0], nnx.Param)[0]
    with jax.set_mesh(mesh):
      base_params = _concrete(jax.eval_shape(
          lambda: nnx.split(make_base(ParamKeys(base=train_state.key(config.seed))), nnx.Param)[1]), mesh)

    def from_base(params: nnx.State) -> TrainState:
      return from_params(*nnx.split(with_lora(nnx.merge(base_graphdef, params)), nnx.Param, Frozen)[1:])

  from_params = jax.jit(from_params, out_shardings=shardings, donate_argnums=0)
  from_base = jax.jit(from_base, out_shardings=shardings, donate_argnums=0)
  # Every step gets dropout keys; a model without dropout never reads them, and XLA drops their math.
  loss_fn = objective.make_loss(config)
  train_step = make_train_step(graphdef, tx, schedule(config.optimizer, config.train.steps * updates),
                               use_dropout=True, loss_fn=loss_fn, updates=updates)
  plan = report.plan(config, rules, mesh, layout, abstract_state, placement.pipeline)
  return Run(config, mesh, rules, placement, notes, layout, graphdef, tx, abstract_state, init, from_params,
             train_step, make_eval_step(graphdef, loss_fn), plan, base_params, from_base, frozen_from_seed)


def _concrete(tree, mesh: Mesh):
  """eval_shape's shardings are on an AbstractMesh; restore targets need this mesh's devices."""
  def one(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    spec = x.sharding.spec if x.sharding is not None else PartitionSpec()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
  return jax.tree.map(one, tree)


def _check_batch_split(config: Config, rules: AxisRules, mesh: Mesh) -> None:
  """The micro-batch must split evenly over the mesh axes that `batch` maps to."""
  train, ways = config.train, rules.ways('batch', mesh.shape)
  if train.micro_batch_size % ways:
    axes = partitioning.spec_axes(rules.activation_spec(('batch',))[0])
    named = ' x '.join(f'`{a}`' for a in axes) or 'no mesh axes'
    raise ConfigError(
        f'`batch` (micro-batch of {train.micro_batch_size} = train.global_batch_size '
        f'{train.global_batch_size} '
        f'/ train.grad_accum_steps {train.grad_accum_steps}) is split over {named} '
        f'= {ways} devices; {train.micro_batch_size} % {ways} != 0. Use a global batch that is a '
        f'multiple of {ways * train.grad_accum_steps}.')


def _check_microbatches(config: Config, rules: AxisRules, mesh: Mesh, placement: Placement) -> None:
  """Each device's rows of a micro-batch must cut evenly into the pipeline's microbatches."""
  schedule = placement.pipeline
  rows = config.train.micro_batch_size // rules.ways('batch', mesh.shape)
  if schedule.stages > 1 and schedule.microbatches > 1 and config.lora.dropout:
    raise ConfigError(f'mesh.stage={schedule.stages} with pipeline.microbatches={schedule.microbatches} '
                      'would draw other dropout masks than one batch does; set lora.dropout=0 or '
                      'pipeline.microbatches=1.')
  if schedule.stages > 1 and rows % schedule.microbatches:
    raise ConfigError(f'pipeline.microbatches={schedule.microbatches} must divide the {rows} rows each '
                      'device holds of a micro-batch (train.global_batch_size / train.grad_accum_steps / the '
                      f'`batch` split); use a divisor of {rows}, or a larger batch.')


def _check_length_split(config: Config, rules: AxisRules, mesh: Mesh) -> None:
  """The sequence must split evenly over the mesh axes that `length` maps to (context parallelism)."""
  seq_len, ways = config.train.seq_len, rules.ways('length', mesh.shape)
  if seq_len % ways:
    axes = ' x '.join(f'`{a}`' for a in partitioning.spec_axes(rules.activation_spec(('length',))[0]))
    raise ConfigError(f'`length` (train.seq_len={seq_len}) is split over {axes} = {ways} devices; '
                      f'{seq_len} % {ways} != 0. Use a train.seq_len that is a multiple of {ways}.')
