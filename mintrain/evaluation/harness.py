"""A mintrain model as an lm-evaluation-harness model (`HarnessLM`), and running tasks on it.

Requests are tokenized as lm-eval's own `hf` backend does (its `TemplateLM`: context and continuation are
encoded whole, then split; BOS first unless the text starts with it; rolling windows of `max_length`), so the
two give the same log-likelihoods for the same weights. Scored rows are padded to a few fixed shapes (the
batch to `batch_size`, the length to a power of two), so a task compiles a handful of programs, not one per
request. Generation uses the family's KV-cache sampler on prompts padded the same way (`Family.complete`:
each row fed its own prompt until it ends), so a task compiles one program per length bucket and
`max_gen_toks`.

Shape letters: B batch, L length, V vocab, N new tokens.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mintrain.errors import ConfigError, MintrainError
from mintrain.models.family import prompt_width
from mintrain.partitioning import AxisRules

try:
  import lm_eval
  from lm_eval.api.model import TemplateLM
  from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
  from lm_eval.tasks import TaskManager
except ImportError:
  raise ConfigError("lm-evaluation-harness is not installed: pip install -e '.[eval]'.") from None

if TYPE_CHECKING:
  from mintrain.config import Config
  from mintrain.data.tokenizer import Tokenizer

MIN_BUCKET = 16  # The shortest padded row length: short requests share one program.


class EvalError(MintrainError, ValueError):
  """A request the model cannot serve (generation from a model without a sampler, a context too short)."""


class HarnessLM(TemplateLM):
  """`model` (its parameters on `mesh`) with the run's tokenizer, for `lm_eval.simple_evaluate`."""

  def __init__(self, model: nnx.Module, config: Config, tok: Tokenizer, mesh: Mesh, *, batch_size: int = 8,
               max_length: int | None = None, max_gen_toks: int = 256):
    super().__init__()
    self.model, self.config, self.tok, self.mesh = model, config, tok, mesh
    rules = AxisRules.from_config(config.partitioning)
    batch_ways, self.length_ways = rules.ways('batch', mesh.shape), rules.ways('length', mesh.shape)
    self.batch_size = -(-batch_size // batch_ways) * batch_ways  # Rows split evenly over `batch`.
    self.max_length = max_length or config.train.seq_len
    self.max_gen_toks = max_gen_toks
    self.graphdef, self.params = nnx.split(model)
    self.bos_text = tok.decode([tok.bos_id]) if tok.bos_id is not None else None

  @property
  def eot_token_id(self) -> int:
    """EOS, or where the tokenizer has none (bytes), the BOS that separates its documents."""
    return self.tok.eos_id if self.tok.eos_id is not None else self.tok.bos_id

  @property
  def prefix_token_id(self) -> int:
    return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

  @property
  def tokenizer_name(self) -> str:
    return str(getattr(self.tok, 'name', 'byte')).replace('/', '__')

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
    """As the hf backend's: BOS first (where the tokenizer has one) unless told not to or the text starts with
    it."""
    if add_special_tokens is None:
      add_special_tokens = not (self.bos_text and string.startswith(self.bos_text))
    ids = [int(i) for i in self.tok.encode(string)]
    return [self.tok.bos_id] + ids if add_special_tokens and self.tok.bos_id is not None else ids

  def _check_language_model(self) -> None:
    if self.config.model.vocab_size is None:
      raise EvalError(f'model.name={self.config.model_name!r} is not a language model (it reads no token '
                      'ids): lm-eval tasks need one.')

  def _loglikelihood_tokens(self, requests: Sequence[tuple[Any, list[int], list[int]]],
                            disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
    """(log-likelihood of the continuation, whether it is the greedy one) of each (key, context ids,
    continuation ids), left-truncated to `max_length` positions as the hf backend does."""
    self._check_language_model()
    rows = []
    for _, context, continuation in requests:
      whole = (list(context) + list(continuation))[-(self.max_length + 1):]
      rows.append((whole[:-1], whole[1:], len(continuation)))
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # Similar lengths share a batch.
    out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
    for start in range(0, len(order), self.batch_size):
      chunk = order[start:start + self.batch_size]
      length = self._bucket(max(len(rows[i][0]) for i in chunk))
      inputs_BL = np.zeros((self.batch_size, length), np.int32)
      targets_BL = np.zeros((self.batch_size, length), np.int32)
      for row, i in enumerate(chunk):
        inputs, targets, _ = rows[i]
        inputs_BL[row, :len(inputs)], targets_BL[row, :len(targets)] = inputs, targets
      logp_BL, greedy_BL = self._score(inputs_BL, targets_BL)
      for row, i in enumerate(chunk):
        end, count = len(rows[i][0]), rows[i][2]
        out[i] = (float(logp_BL[row, end - count:end].sum()), bool(greedy_BL[row, end - count:end].all()))
    return out

  def _bucket(self, length: int) -> int:
    """The padded length of rows up to `length` tokens: a power of two (at least MIN_BUCKET), at most
    `max_length`, a multiple of the ways `length` splits."""
    bucket = min(max(MIN_BUCKET, 1 << math.ceil(math.log2(max(length, 1)))), max(self.max_length, length))
    return -(-bucket // self.length_ways) * self.length_ways

  def _score(self, inputs_BL: np.ndarray, targets_BL: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    replicated = NamedSharding(self.mesh, P())
    with jax.set_mesh(self.mesh):
      out = _score(self.graphdef, self.params, jax.device_put(inputs_BL, replicated),
                   jax.device_put(targets_BL, replicated))
    return tuple(np.asarray(x.addressable_data(0)) for x in out)

  def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[float]:
    """The log-likelihood of each whole text, in disjoint windows of up to `max_length` predictions."""
    windows, owners = [], []
    for i, (string,) in enumerate(req.args for req in requests):
      tokens = self.tok_encode(string)
      for window in lm_eval.utils.get_rolling_token_windows(tokens, prefix_token=self.prefix_token_id,
                                                            max_seq_len=self.max_length, context_len=1):
        windows.append((None, *lm_eval.utils.make_disjoint_window(window)))
        owners.append(i)
    totals = [0.0] * len(requests)
    for owner, (logp, _) in zip(owners, self._loglikelihood_tokens(windows)):
      totals[owner] += logp
    return totals

  def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
    """Greedy (or, with do_sample, temperature) continuations, cut at the first stop sequence (`until`, and
    EOS) after at most `max_gen_toks` tokens."""
    complete = self.config.family.complete
    if complete is None:
      raise EvalError(f'model.name={self.config.model_name!r} has no sampler: it cannot run generate_until '
                      'tasks.')

    eos_text = self.tok.decode([self.eot_token_id]) if self.tok.eos_id is not None else None
    groups: dict[tuple, list[int]] = {}
    prepared = []
    for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
      kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
      until = handle_stop_sequences(kwargs.pop('until', None), eos=eos_text)
      new = int(kwargs.pop('max_gen_toks'))
      if new >= self.max_length:
        raise EvalError(f'max_gen_toks={new} leaves no room for a context in max_length={self.max_length} '
                        'positions.')
      temperature = float(kwargs.get('temperature') or 0.0) if kwargs.get('do_sample') else 0.0
      prompt = self.tok_encode(context)[-(self.max_length - new):] or [self.prefix_token_id]
      prepared.append((prompt, until))
      groups.setdefault((self._prompt_bucket(len(prompt), new), new, temperature), []).append(i)
    out = [''] * len(requests)
    for (length, new, temperature), members in groups.items():
      for start in range(0, len(members), self.batch_size):
        chunk = members[start:start + self.batch_size]
        rows = chunk + chunk[:1] * (self.batch_size - len(chunk))  # Rows past the chunk repeat its first.
        prompt_BP = np.zeros((self.batch_size, length), np.int32)
        for row, i in enumerate(rows):
          prompt_BP[row, :len(prepared[i][0])] = prepared[i][0]
        lengths_B = np.array([len(prepared[i][0]) for i in rows], np.int32)
        with jax.set_mesh(self.mesh):
          tokens_BN = complete(self.model, prompt_BP, lengths_B, new, temperature=temperature, top_p=1.0,
                               keys_B=jax.random.split(jax.random.key(0), len(rows)))
        tokens_BN = np.asarray(tokens_BN.addressable_data(0))
        for row, i in enumerate(chunk):
          new_N = tokens_BN[row].tolist()
          if self.tok.eos_id is not None and self.tok.eos_id in new_N:
            new_N = new_N[:new_N.index(self.tok.eos_id)]
          out[i] = postprocess_generated_text(self.tok.decode(new_N), prepared[i][1], None)
    return out

  def _prompt_bucket(self, length: int, new: int) -> int:
    """The padded length of prompts up to `length` tokens: a power of two (at least MIN_BUCKET), at most
    the `max_length - new` positions a prompt may take."""
    return prompt_width(length, self.max_length - new, MIN_BUCKET)

  def sampling_plan(self) -> str:
    """The memory per device that generation takes at most (`report.format_sampling_plan`): a batch of
    `max_length` positions; '' for a model without a sampler."""
    if not hasattr(self.model, 'init_cache'):
      return ''
    from mintrain import report

    params = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(self.params))
    with jax.set_mesh(self.mesh):
      cache = report.kv_cache_bytes(self.model, self.batch_size, self.max_length,
                                    jnp.dtype(self.config.model.compute_dtype))
    device = self.mesh.devices.flat[0]
    return report.format_sampling_plan(params, cache, self.batch_size, self.max_length, device)

  def apply_chat_template(self, chat_history: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    """The chat as the tokenizer's own template renders it (as transformers' apply_chat_template)."""
    from mintrain.data import chat

    return chat.render(self.tok, chat_history, add_generation_prompt=add_generation_prompt)[0]

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    """What lm-eval records of the template (and keys its request cache by): the tokenizer's name."""
    return self.tokenizer_name if chat_template else None


@functools.partial(jax.jit, static_argnames='graphdef')
def _score(graphdef: nnx.GraphDef, params: nnx.State, inputs_BL: jax.Array,
           targets_BL: jax.Array) -> tuple[jax.Array, jax.Array]:
  """float32 log-probabilities of the targets (BL) and whether each is the argmax, on every device."""
  logits_BLV = nnx.merge(graphdef, params)(inputs_BL).astype(jnp.float32)
  logp_BLV = jax.nn.log_softmax(logits_BLV, axis=-1)
  hit_BLV = jnp.arange(logits_BLV.shape[-1]) == targets_BL[..., None]
  logp_BL = jnp.sum(jnp.where(hit_BLV, logp_BLV, 0.0), axis=-1)
  greedy_BL = jnp.max(logits_BLV, axis=-1) <= jnp.sum(jnp.where(hit_BLV, logits_BLV, 0.0), axis=-1)
  return jax.sharding.reshard(logp_BL, P()), jax.sharding.reshard(greedy_BL, P())


def task_manager(include_path: str | None = None, include_defaults: bool = True) -> TaskManager:
  """lm-eval's tasks (unless not `include_defaults`), with those of the YAML files under `include_path`."""
  return TaskManager(include_path=include_path or None, include_defaults=include_defaults)


def check_tasks(tasks: Sequence[str], manager: TaskManager, what: str = '--tasks') -> None:
  """A one-line ConfigError naming the tasks (or groups) lm-eval does not know."""
  unknown = [name for name in tasks if not manager.match_tasks([name])]
  if unknown:
    raise ConfigError(f'{what}: unknown lm-eval task(s) {", ".join(map(repr, unknown))} (lm-eval lists its '
                      'tasks with `lm-eval ls tasks`; give your own YAML files a directory with '
                      '--include_path).')


def evaluate(lm: HarnessLM, tasks: Sequence[str], manager: TaskManager, *, num_fewshot: int | None = None,
             limit: float | None = None, apply_chat_template: bool = False, log_samples: bool = False,
             bootstrap_iters: int = 100000) -> dict[str, Any]:
  """lm-eval's results dictionary (`simple_evaluate`'s) of `tasks` on `lm`; its own loggers stay quiet
  below warnings while it runs."""
  logger = logging.getLogger('lm_eval')
  level = logger.level
  logger.setLevel(max(level, logging.WARNING))
  try:
    return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                   task_manager=manager, apply_chat_template=apply_chat_template,
                                   log_samples=log_samples, bootstrap_iters=bootstrap_iters)
  finally:
    logger.setLevel(level)


def scalars(results: dict[str, Any]) -> dict[str, float]:
  """`harness/<task>/<metric>` for every numeric metric of every task (lm-eval's 'acc,none' is 'acc'; its
  standard errors are left out)."""
  out = {}
  for task, metrics in results['results'].items():
    for key, value in metrics.items():
      metric, _, filter_name = key.partition(',')
      if metric.endswith('_stderr') or isinstance(value, bool) or not isinstance(value, (int, float)):
        continue
      name = metric if filter_name in ('', 'none') else f'{metric}_{filter_name}'
      out[f'harness/{task}/{name}'] = float(value)
  return out
