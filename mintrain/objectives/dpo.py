"""Direct preference optimisation (DPO, Rafailov et al. 2023) and its relatives, as TRL's `DPOTrainer`
defines them: each pair's chosen and rejected responses are scored by the summed log-probability of their
tokens (the batch's `target_weights`: the response, never the prompt) under the policy and under the frozen
reference model (the initial weights, `objective.reference`), and the loss pushes the policy's log-ratio
of chosen over rejected above the reference's.

A batch holds pairs: every array is (B, 2, L), [:, 0] the prompt and chosen response, [:, 1] the prompt and
rejected response (`data.format='preference'`); they go through the model as 2B rows, chosen and rejected
side by side, so a pair never spans devices. Packed rows (`data.packing='pack'`) hold several pairs, pair k
the documents of segment id k in both halves, each summed apart.

With `dpo.precompute_reference`, the reference's log-probabilities of every batch the run will read are
computed in one pass before the first step (`prepare_batches`) and kept in WORKDIR/reference_logp.npz, so
the state holds no reference model; each batch then carries them as `reference_chosen_logp` and
`reference_rejected_logp`, (accum, micro) each (packed rows: (accum, micro x pairs a row may hold)).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from mintrain.data import preference
from mintrain.data.batches import batch_sharding
from mintrain.errors import CheckpointError, ConfigError
from mintrain.fields import option, to_dict
from mintrain.models.layers import merge
from mintrain.objectives.objective import Batch, LossFn, Objective

LOSSES = ('sigmoid', 'ipo', 'hinge', 'simpo')
REFERENCE_KEYS = ('reference_chosen_logp', 'reference_rejected_logp')
# WORKDIR/reference_logp.npz: `train` (steps, accum, pairs, 2), `eval` (eval.steps, ...), `first_step`,
# `inputs` (what the values depend on: `_inputs`).
REFERENCE_FILE = 'reference_logp.npz'


@dataclasses.dataclass(frozen=True)
class DPOConfig:
  beta: float = option(above=0)
  loss: str = option(choices=LOSSES)
  label_smoothing: float = option(at_least=0, below=0.5)
  gamma: float = option(at_least=0)
  precompute_reference: bool = option()


def check(config) -> None:
  if not config.data.pairs:
    raise ConfigError(f"train.objective='dpo' learns from (prompt, chosen, rejected) records; "
                      f"data.format={config.data.format!r} has none. Set data.format='preference' (and "
                      "data.source='jsonl' or 'parquet').")
  if config.dpo.precompute_reference and config.dpo.loss == 'simpo':
    raise ConfigError("dpo.precompute_reference=True has no reference to precompute with dpo.loss='simpo' "
                      '(reference-free); set it to False.')
  if config.dpo.label_smoothing and config.dpo.loss not in ('sigmoid', 'simpo'):
    raise ConfigError(f'dpo.label_smoothing={config.dpo.label_smoothing} applies to the sigmoid and simpo '
                      f"losses, not dpo.loss={config.dpo.loss!r}; set it to 0 or choose one of those.")


def pair_losses(cfg: DPOConfig, chosen_P: jax.Array, rejected_P: jax.Array, ref_chosen_P: jax.Array | None,
                ref_rejected_P: jax.Array | None, chosen_tokens_P: jax.Array, rejected_tokens_P: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(loss, chosen reward, rejected reward) of each of P pairs from the summed log-probabilities of their
  responses (and response lengths): TRL's `dpo_loss`. 'ipo' compares length-averaged log-probabilities,
  as TRL does; 'simpo' (Meng et al. 2024) is reference-free, length-averaged, with a target margin gamma."""
  beta = cfg.beta
  if cfg.loss == 'simpo':
    chosen_P, rejected_P = chosen_P / chosen_tokens_P, rejected_P / rejected_tokens_P
    logits_P = chosen_P - rejected_P - cfg.gamma / beta
    chosen_rewards_P, rejected_rewards_P = beta * chosen_P, beta * rejected_P
  else:
    if cfg.loss == 'ipo':
      chosen_P, rejected_P = chosen_P / chosen_tokens_P, rejected_P / rejected_tokens_P
      ref_chosen_P = ref_chosen_P / chosen_tokens_P
      ref_rejected_P = ref_rejected_P / rejected_tokens_P
    logits_P = (chosen_P - rejected_P) - (ref_chosen_P - ref_rejected_P)
    chosen_rewards_P = beta * (chosen_P - ref_chosen_P)
    rejected_rewards_P = beta * (rejected_P - ref_rejected_P)
  if cfg.loss in ('sigmoid', 'simpo'):
    smoothing = cfg.label_smoothing
    losses_P = (-jax.nn.log_sigmoid(beta * logits_P) * (1 - smoothing)
                - jax.nn.log_sigmoid(-beta * logits_P) * smoothing)
  elif cfg.loss == 'hinge':
    losses_P = jax.nn.relu(1 - beta * logits_P)
  else:
    losses_P = (logits_P - 1 / (2 * beta)) ** 2
  return losses_P, chosen_rewards_P, rejected_rewards_P


def _rows(batch: Batch) -> Batch:
  """(B, 2, L) pair arrays as (2B, L) rows: chosen and rejected of pair i at rows 2i and 2i + 1."""
  return {k: v.reshape(v.shape[0] * v.shape[1], *v.shape[2:]) for k, v in batch.items()}


def _documents(config) -> int:
  """Pairs a row may hold, each summed apart: packed rows' bound (`preference.max_pairs_per_row`), or 0
  for padded rows, whose sequences are summed whole."""
  return preference.max_pairs_per_row(config.train.seq_len) if config.data.packing == 'pack' else 0


def _log_probs(params: nnx.State, graphdef: nnx.GraphDef, rows: Batch, dropout_key: jax.Array | None,
               frozen: nnx.State | None, documents: int) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """(chosen, rejected) summed response log-probabilities, each (P,) (P: B pairs, or B * documents pair
  slots of packed rows), and the family's statistics."""
  logp_R, stats = merge(graphdef, params, frozen).sequence_log_probs(rows, dropout_key=dropout_key,
                                                                     documents=documents)
  logp_BT = _whole(logp_R).reshape(-1, 2, *logp_R.shape[1:])  # Whole: the pairs' reshape needs no layout.
  return logp_BT[:, 0].reshape(-1), logp_BT[:, 1].reshape(-1), stats


def _pair_tokens(batch: Batch, documents: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(chosen tokens, rejected tokens, 1.0 where a pair is) of each of the P pairs or packed pair slots."""
  weights_BTL = _whole(batch['target_weights'])
  if not documents:
    tokens_BT = jnp.sum(weights_BTL, axis=-1)
    return tokens_BT[:, 0], tokens_BT[:, 1], jnp.ones(tokens_BT.shape[:1], jnp.float32)
  segment_ids_BTL = _whole(batch['segment_ids'])
  in_BTLN = segment_ids_BTL[..., None] == jnp.arange(1, documents + 1, dtype=jnp.int32)
  tokens_BTN = jnp.sum(jnp.where(in_BTLN, weights_BTL[..., None], 0.0), axis=2)
  exists_BN = jnp.any(in_BTLN[:, 0], axis=1).astype(jnp.float32)
  return tokens_BTN[:, 0].reshape(-1), tokens_BTN[:, 1].reshape(-1), exists_BN.reshape(-1)


def _whole(x: jax.Array) -> jax.Array:
  """A handful of numbers, whole on every device."""
  return x if jax.sharding.get_abstract_mesh().empty else jax.sharding.reshard(x, jax.P())


def make_loss(config) -> LossFn:
  cfg: DPOConfig = config.dpo
  reference_free, documents = cfg.loss == 'simpo', _documents(config)

  def loss(params: nnx.State, graphdef: nnx.GraphDef, batch: Batch, dropout_key: jax.Array | None,
           frozen: nnx.State | None = None, reference: nnx.State | None = None
           ) -> tuple[jax.Array, tuple[jax.Array, dict[str, jax.Array]]]:
    """The mean loss over the batch's pairs (plus the family's `aux_loss`, if any), their count, and the
    loss, rewards and log-probabilities averaged over the pairs."""
    rows = _rows({k: v for k, v in batch.items() if k not in REFERENCE_KEYS})
    chosen_P, rejected_P, stats = _log_probs(params, graphdef, rows, dropout_key, frozen, documents)
    if reference_free:
      ref_chosen_P = ref_rejected_P = None
    elif REFERENCE_KEYS[0] in batch:  # Precomputed: whole on every device, as the policy's.
      ref_chosen_P, ref_rejected_P = (_whole(batch[k]).reshape(-1) for k in REFERENCE_KEYS)
    else:
      # With LoRA, the reference's adapters are the initial ones (B = 0): the frozen base itself.
      ref_chosen_P, ref_rejected_P, _ = _log_probs(jax.lax.stop_gradient(reference), graphdef, rows, None,
                                                   frozen, documents)
    chosen_tokens_P, rejected_tokens_P, exists_P = _pair_tokens(batch, documents)
    # A response truncated away: log-probability 0 over 1 token.
    losses_P, chosen_rewards_P, rejected_rewards_P = pair_losses(
        cfg, chosen_P, rejected_P, ref_chosen_P, ref_rejected_P, jnp.maximum(chosen_tokens_P, 1.0),
        jnp.maximum(rejected_tokens_P, 1.0))
    count = jnp.sum(exists_P)

    def mean_of(x_P: jax.Array) -> jax.Array:  # Over the pairs there are (packed rows hold empty slots).
      return jnp.sum(x_P * exists_P) / jnp.maximum(count, 1.0)

    mean = mean_of(losses_P)
    metrics = {'loss': mean,
               'dpo_reward_accuracy': mean_of((chosen_rewards_P > rejected_rewards_P).astype(jnp.float32)),
               'dpo_reward_margin': mean_of(chosen_rewards_P - rejected_rewards_P),
               'dpo_chosen_reward': mean_of(chosen_rewards_P),
               'dpo_rejected_reward': mean_of(rejected_rewards_P),
               'dpo_chosen_logp': mean_of(chosen_P),
               'dpo_rejected_logp': mean_of(rejected_P), **stats}
    objective = mean + stats['aux_loss'] if 'aux_loss' in stats else mean
    return objective, (count, metrics)

  return loss


def keeps_reference(config) -> bool:
  return config.dpo.loss != 'simpo' and not config.dpo.precompute_reference


def flops_factor(config) -> float:
  """Two sequences trained per pair, each with the reference's forward pass when the step runs it."""
  return 2 * (1 + (1 / 3 if keeps_reference(config) else 0))


class WithReference:
  """Batches carrying their precomputed reference log-probabilities: the i-th batch handed out since it was
  made (or since the last `set_state`, as evaluation restarts) gets `logp_NAM2[i]`."""

  def __init__(self, batches: Iterator, logp_NAM2: np.ndarray, sharding: jax.sharding.NamedSharding):
    self.batches, self.logp_NAM2, self.sharding, self.index = batches, logp_NAM2, sharding, 0

  def __iter__(self) -> WithReference:
    return self

  def __next__(self) -> dict[str, jax.Array]:
    batch = next(self.batches)
    logp_AM2 = self.logp_NAM2[self.index]
    self.index += 1
    for k, key in enumerate(REFERENCE_KEYS):
      batch[key] = jax.make_array_from_callback(logp_AM2.shape[:2], self.sharding,
                                                lambda index, k=k: logp_AM2[(*index, k)])
    return batch

  def get_state(self) -> dict[str, Any]:
    return self.batches.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self.batches.set_state(state)
    self.index = 0


def reference_pass(run, state, batches: Iterator, count: int) -> np.ndarray:
  """(count, accum, micro, 2) float32: the reference's (the state's parameters') summed response
  log-probabilities of chosen and rejected in the next `count` batches, whole on every process."""
  def logp_AM2(params: nnx.State, frozen: nnx.State, batch: Batch) -> jax.Array:
    def micro(micro_batch: Batch) -> jax.Array:
      chosen_P, rejected_P, _ = _log_probs(params, run.graphdef, _rows(micro_batch), None, frozen,
                                           _documents(run.config))
      return jnp.stack([chosen_P, rejected_P], axis=-1)
    return jax.lax.map(micro, batch)

  forward = jax.jit(logp_AM2)
  out = [forward(state.params, state.frozen, next(batches)) for _ in range(count)]
  return np.stack([np.asarray(x.addressable_data(0)) for x in out]).astype(np.float32)


def _write(path: epath.Path, arrays: dict[str, np.ndarray]) -> None:
  """Written aside, then renamed: a reader finds the whole file or none."""
  buffer = io.BytesIO()
  np.savez(buffer, **arrays)
  staging = path.parent / f'{path.name}.tmp'
  staging.write_bytes(buffer.getvalue())
  staging.rename(path)


def _inputs(config) -> str:
  """A digest of the options the reference log-probabilities depend on: the data read, the model and its
  initial weights, the batch shape."""
  train = config.train
  parts = {'seed': config.seed, 'data': to_dict(config.data), 'model': to_dict(config.model),
           'init': to_dict(config.init), 'lora': to_dict(config.lora),
           'batch': [train.seq_len, train.global_batch_size, train.grad_accum_steps]}
  return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def prepare_batches(run, state, batches, eval_batches, *, fresh: Callable[[str], Iterator],
                    workdir: epath.Path | None, is_main: bool, say: Callable[[str], None]) -> tuple:
  """With dpo.precompute_reference, the run's batches with their reference log-probabilities: read back
  from the workdir (a resume), or computed from the starting state's parameters, on the batches read
  afresh from the same positions, and written there by process 0 (every process computes them all)."""
  if not run.config.dpo.precompute_reference:
    return batches, eval_batches
  first, steps = int(np.asarray(state.step.addressable_data(0))), run.config.train.steps
  eval_count = run.config.eval.steps if eval_batches is not None else 0
  path = workdir / REFERENCE_FILE if workdir is not None else None
  if path is not None and path.exists():
    with np.load(io.BytesIO(path.read_bytes())) as saved:
      start, train_logp, eval_logp = int(saved['first_step']), saved['train'], saved['eval']
      inputs = str(saved['inputs']) if 'inputs' in saved else ''
    if inputs != _inputs(run.config):
      raise CheckpointError(f'{path} holds reference log-probabilities of other data, model, initial weights '
                            'or batch shape than this run reads: restore the run with its own options, or '
                            'delete the file to compute them anew.')
    if not start <= first or steps > start + len(train_logp) or len(eval_logp) < eval_count:
      raise CheckpointError(f'{path} holds the reference log-probabilities of steps {start + 1} to '
                            f'{start + len(train_logp)} and {len(eval_logp)} eval batches, not of steps '
                            f'{first + 1} to {steps} and {eval_count}: the run was started with another '
                            'train.steps or eval.steps; restore it with those.')
    train_logp = train_logp[first - start:]
    say(f'dpo: read the reference log-probabilities of steps {first + 1} to {steps} from {path}.')
  else:
    train_fresh = fresh('train')
    train_fresh.set_state(batches.get_state())
    train_logp = reference_pass(run, state, train_fresh, steps - first)
    eval_logp = (reference_pass(run, state, fresh('eval'), eval_count) if eval_count
                 else np.zeros((0, *train_logp.shape[1:]), np.float32))
    if path is not None and is_main:
      _write(path, {'first_step': np.int64(first), 'train': train_logp, 'eval': eval_logp,
                    'inputs': np.str_(_inputs(run.config))})
    say(f'dpo: precomputed the reference log-probabilities of steps {first + 1} to {steps}'
        + (f' and {eval_count} eval batches' if eval_count else '') + (f' in {path}.' if path else '.'))
  sharding = batch_sharding(run.mesh, run.rules, 2)
  return (WithReference(batches, train_logp, sharding),
          WithReference(eval_batches, eval_logp, sharding) if eval_count else eval_batches)


OBJECTIVE = Objective(check=check, make_loss=make_loss, keeps_reference=keeps_reference,
                      sequences_per_row=lambda config: 2, flops_factor=flops_factor,
                      prepare_batches=prepare_batches)
