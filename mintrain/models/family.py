"""What a model family gives the rest of mintrain, so that nothing outside `mintrain/models/` asks which
model it runs (torchtitan's model bundle): its config class, whose methods say what the model costs and
needs (as torchtitan's model args and Levanter's `LmConfig`), its constructor and its HF conversion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx
from jax.sharding import Mesh

from mintrain.models.pipeline import UNPIPELINED, PipelineConfig, Schedule
from mintrain.partitioning import AxisRules

# How many ways activations split along a logical axis on the run's mesh (`AxisRules.ways`).
Ways = Callable[[str], int]


@dataclasses.dataclass(frozen=True)
class Placement:
  """What the run's devices decide for a model, given to its constructor: their platform (which picks
  kernels), how many ways the rules split each logical axis on the mesh, and the pipeline that runs its
  stacked layers over the `layers` split (the `pipeline` section's schedule on those stages)."""

  platform: str = 'cpu'
  splits: tuple[tuple[str, int], ...] = ()
  pipeline: Schedule = UNPIPELINED

  @classmethod
  def of(cls, rules: AxisRules, mesh: Mesh, pipeline: PipelineConfig | None = None) -> Placement:
    names = dict.fromkeys(name for name, _ in rules.rules)
    splits = tuple((name, rules.ways(name, mesh.shape)) for name in names)
    stages = dict(splits).get('layers', 1)
    schedule = UNPIPELINED if pipeline is None or stages == 1 else Schedule(
        stages, pipeline.microbatches, pipeline.repeats)
    return cls(mesh.devices.flat[0].platform, splits, schedule)

  def ways(self, name: str) -> int:
    return dict(self.splits).get(name, 1)


class ModelConfig:
  """Base of a family's config (a frozen dataclass of `fields.option`s). A family defines `param_count()`,
  `train_flops_per_row(seq_len, causal_half)`, `activation_bytes(rows, seq_len, ways)` (kept for the
  backward pass on one device; a family that pipelines also takes `schedule=`, the pipeline's, when
  `mesh.stage` > 1) and `synthetic_rows(seed, step, rows, seq_len)` (a pure function of (seed, step,
  row)); the rest are defaults it may override."""

  compute_dtype: str = 'float32'  # Of its matmuls: which peak FLOP/s MFU divides by.
  vocab_size: int | None = None  # Token ids it reads; None: data ids are checked against the tokenizer's.

  def tokens_per_row(self, seq_len: int) -> int:
    """What throughput counts per batch row."""
    return seq_len

  def eval_metrics(self, loss: float) -> dict[str, float]:
    """Beyond loss, perplexity and (on text) bits per byte, from the mean eval loss."""
    return {}

  def for_tokenizer(self, num_ids: Callable[[], int]) -> Any:
    """The config for a tokenizer of num_ids() ids, where the config defers to it."""
    return self

  def check(self, seq_len: int) -> None:
    """Raises a ConfigError for options that cannot work together (each option alone is checked already)."""

  def for_platform(self, platform: str) -> Any:
    """Options left to 'auto' set for 'cpu', 'gpu' or 'tpu'."""
    return self

  def placement_notes(self, placement: Placement, seq_len: int) -> list[str]:
    """What the placement changes that a user should read; a ConfigError for what it cannot run."""
    return []


@dataclasses.dataclass(frozen=True)
class Family:
  config: type[ModelConfig]
  # (cfg, rules, placement, rngs) -> the module, with `loss(batch, *, dropout_key) -> (mean loss, count of
  # what it averages over, statistics)`: the batch is a dict of arrays ('inputs', 'targets' and whatever
  # else the data gives, such as packed rows' 'segment_ids'); a family reads the keys it knows. The
  # statistics ({} if none) are scalar metrics; their `aux_loss` (e.g. an MoE router's balancing losses)
  # joins the objective. Micro-batches are weighted by their counts, in the loss, gradients and statistics.
  # A language model may also have `sequence_log_probs(batch, *, dropout_key, documents=0) -> ((B,) summed
  # log-probability of each row's counted targets, or (B, documents) of each packed document's, statistics)`,
  # which preference objectives (`mintrain.objectives.dpo`) read.
  make: Callable[[Any, AxisRules, Placement, nnx.Rngs], nnx.Module]
  # Its Hugging Face conversion (a module like `models.transformer.hf`: MODEL_TYPES, model_options,
  # config_json, weight_names, text_tensors, their_shape, read, write), or None.
  hf: Any = None
  # Its projections by LoRA target name (`lora.targets`, e.g. 'q'): {weight path suffix, e.g. 'attn.wq_DHK':
  # (leading axes that are neither input nor output, such as experts; input axes)}, after any stacked
  # `layers` axis. None: LoRA does not apply.
  lora_targets: Mapping[str, Mapping[str, tuple[int, int]]] | None = None
  # Its sampler for policy-gradient objectives (`mintrain.objectives.grpo`), or None: `complete(model,
  # prompt_BP, lengths_B, max_new_tokens, *, temperature, top_p, keys_B) -> (B, N) int32` new tokens after
  # each row's first lengths_B[b] prompt tokens, token i of row b drawn with fold_in(keys_B[b], i); one
  # program serves every batch of a width.
  complete: Callable[..., Any] | None = None



def prompt_width(longest: int, most: int, least: int = 16) -> int:
  """The width to pad prompts of up to `longest` tokens to for `Family.complete`: a power of two, at least
  `least` and at most `most`, so that a few compiled samplers serve every batch and none prefills or
  attends over a buffer much wider than its prompts."""
  return min(most, max(least, 1 << (longest - 1).bit_length()))
