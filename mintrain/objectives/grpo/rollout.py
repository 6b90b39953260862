"""Each step's rollout, on the host: a step's prompts, `grpo.group_size` completions of each sampled by the
model family's KV-cached sampler on the run's mesh, their rewards, group-normalised advantages, and the
batch the train step learns from. Row r of step s draws with the run's seed folded with s and r, so the
completions depend on neither the mesh nor the process count."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mintrain.data import batches as batches_lib
from mintrain.data.prompts import Prompt, PromptBatches
from mintrain.data.tokenizer import Tokenizer
from mintrain.errors import ConfigError
from mintrain.models.family import prompt_width
from mintrain.models.layers import merge
from mintrain.objectives.grpo import rewards as rewards_lib

SAMPLING = 0x5A4D  # Folded into the seed first: sampling keys apart from every other use of the seed.


def advantages(rewards_B: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
  """((B,) float32 (reward - its group's mean) / (the group's standard deviation + 1e-4), as TRL, with the
  sample deviation; (groups,) whether each group's rewards are all equal)."""
  groups_GN = rewards_B.astype(np.float64).reshape(-1, group_size)
  std_G = groups_GN.std(axis=1, ddof=1)
  out_GN = (groups_GN - groups_GN.mean(axis=1, keepdims=True)) / (std_G[:, None] + 1e-4)
  return out_GN.reshape(-1).astype(np.float32), std_G == 0


def row_keys(seed: int, step: int, rows: int) -> jax.Array:
  """One sampling key per row of a step's batch: the seed folded with the step, then the row."""
  step_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), SAMPLING), step)
  return jax.vmap(lambda row: jax.random.fold_in(step_key, row))(jnp.arange(rows))


class Rollout:
  """The per-step hook (`Objective.make_rollout`): (state, step, prompts) -> (train batch, host metrics)."""

  def __init__(self, run: Any, tok: Tokenizer, prompt_batches: PromptBatches):
    config = run.config
    self.run, self.tok, self.cfg = run, tok, config.grpo
    if config.train.global_batch_size % self.cfg.group_size:  # Checked here: sampling and export change it.
      raise ConfigError(f'grpo.group_size={self.cfg.group_size} does not divide train.global_batch_size='
                        f'{config.train.global_batch_size} (completions per step); use a multiple of it.')
    self.rewards = rewards_lib.load(self.cfg.reward, self.cfg.reward_weights)
    self._probe(prompt_batches.peek())
    self.complete = config.family.complete
    self.seq_len, self.accum = config.train.seq_len, config.train.grad_accum_steps
    self.logps = jax.jit(self._logps) if self.cfg.num_iterations > 1 or self.cfg.kl_coef else None
    self.update_start: float | None = None  # When the last rollout handed its batch to the train step.

  def _probe(self, prompts: list[Prompt]) -> None:
    """Calls every reward on the first step's prompts with empty completions (which sampling can give), so
    that a function that fails or returns the wrong count stops the run before it writes."""
    rows = [p for p in prompts for _ in range(self.cfg.group_size)]
    texts = [[{'role': 'assistant', 'content': ''}] if isinstance(p.record['prompt'], list) else ''
             for p in rows]
    rewards_lib.score(self.rewards, [p.record['prompt'] for p in rows], texts, [[] for _ in rows],
                      _fields(rows), [p.where for p in rows])

  def _logps(self, params, frozen, reference, batch):
    """The sampling policy's and the reference's token log-probabilities of each micro-batch."""
    def one(micro: dict[str, jax.Array]) -> dict[str, jax.Array]:
      out = {}
      if self.cfg.num_iterations > 1:
        out['old_logp'] = merge(self.run.graphdef, params, frozen).token_log_probs(micro)[0]
      if self.cfg.kl_coef:
        out['ref_logp'] = merge(self.run.graphdef, reference, frozen).token_log_probs(micro)[0]
      return out
    return jax.lax.map(one, batch)

  def __call__(self, state: Any, step: int, prompts: list[Prompt]) -> tuple[dict[str, jax.Array],
                                                                             dict[str, float]]:
    jax.block_until_ready(state.params)  # The previous step's updates are done: sampling starts now.
    start = time.perf_counter()
    update_sec = None if self.update_start is None else start - self.update_start
    cfg, tok = self.cfg, self.tok
    rows = [p for p in prompts for _ in range(cfg.group_size)]
    lengths_B = np.array([len(p.ids_P) for p in rows])
    # At most the positions a prompt may take (`prompts.read`).
    width = prompt_width(int(lengths_B.max()), self.seq_len + 1 - cfg.max_new_tokens)
    prompt_BP = np.zeros((len(rows), width), np.int32)
    for b, p in enumerate(rows):
      prompt_BP[b, :len(p.ids_P)] = p.ids_P
    model = merge(self.run.graphdef, state.params, state.frozen)
    new_BN = self.complete(model, prompt_BP, lengths_B, cfg.max_new_tokens, temperature=cfg.temperature,
                           top_p=cfg.top_p, keys_B=row_keys(self.run.config.seed, step, len(rows)))
    new_BN = np.asarray(new_BN.addressable_data(0))  # Replicated: every process holds every row.
    sampled = time.perf_counter()
    ids = [_until_eos(new_N, tok.eos_id) for new_N in new_BN]
    texts = [tok.decode(_without(i, tok.eos_id)) for i in ids]
    completions = [[{'role': 'assistant', 'content': t}] if isinstance(p.record['prompt'], list) else t
                   for p, t in zip(rows, texts, strict=True)]
    rewards_B, means = rewards_lib.score(
        self.rewards, [p.record['prompt'] for p in rows], completions, [list(map(int, i)) for i in ids],
        _fields(rows), [p.where for p in rows])
    advantages_B, flat_G = advantages(rewards_B, cfg.group_size)
    batch = self._to_devices(self._rows(rows, ids, advantages_B))
    if self.logps is not None:
      batch |= self.logps(state.params, state.frozen, state.reference, batch)
    lengths = np.array([len(i) for i in ids])
    metrics = {'grpo_reward': float(rewards_B.mean()), 'grpo_reward_std': float(rewards_B.std()),
               'grpo_zero_variance_groups': float(flat_G.mean()),
               'grpo_completion_length': float(lengths.mean()),
               'grpo_completion_length_max': float(lengths.max()),
               'grpo_sample_sec': sampled - start,
               **{f'grpo_reward/{name}': value for name, value in means.items()}}
    if update_sec is not None:
      metrics['grpo_update_sec'] = update_sec
    jax.block_until_ready(batch)
    self.update_start = time.perf_counter()
    metrics['grpo_rollout_sec'] = self.update_start - start
    return batch, metrics

  def _rows(self, rows: list[Prompt], ids: list[np.ndarray],
            advantages_B: np.ndarray) -> dict[str, np.ndarray]:
    """(B, seq_len) rows of prompt + completion, weighted on the completion's targets, and advantages."""
    tokens_BS = np.zeros((len(rows), self.seq_len + 1), np.int32)
    weights_BS = np.zeros((len(rows), self.seq_len + 1), np.float32)
    for b, (p, new) in enumerate(zip(rows, ids, strict=True)):
      n = len(p.ids_P)
      tokens_BS[b, :n], tokens_BS[b, n:n + len(new)] = p.ids_P, new
      weights_BS[b, n:n + len(new)] = 1.0
    return {'inputs': tokens_BS[:, :-1], 'targets': tokens_BS[:, 1:], 'target_weights': weights_BS[:, 1:],
            'advantages': advantages_B}

  def _to_devices(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """(accum, micro, ...) arrays laid out as the data layer's batches; every process holds all rows."""
    out = {}
    for key, value in batch.items():
      value = value.reshape(self.accum, -1, *value.shape[1:])
      sharding = batches_lib.batch_sharding(self.run.mesh, self.run.rules, value.ndim)
      out[key] = jax.make_array_from_callback(value.shape, sharding, lambda index, value=value: value[index])
    return out


def _fields(rows: list[Prompt]) -> dict[str, list[Any]]:
  """The records' fields besides the prompt, each as a list over the rows (TRL's reward keyword arguments)."""
  names = dict.fromkeys(k for p in rows for k in p.record if k != 'prompt')
  return {k: [p.record.get(k) for p in rows] for k in names}


def _until_eos(new_N: np.ndarray, eos: int | None) -> np.ndarray:
  """The completion up to and including its first EOS (all of it without one)."""
  if eos is None:
    return new_N
  hits = np.flatnonzero(new_N == eos)
  return new_N[:hits[0] + 1] if len(hits) else new_N


def _without(ids: np.ndarray, eos: int | None) -> np.ndarray:
  return ids[:-1] if eos is not None and len(ids) and ids[-1] == eos else ids
