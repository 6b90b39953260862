"""Sample text from a run's newest checkpoint: one prefill, then one KV-cached step per token.

  python scripts/sample.py --workdir runs/dp4_tp2 --prompt "def " --max_new_tokens 200
  python scripts/sample.py --workdir runs/dp4_tp2 --prompt "import " --temperature 0    # greedy
  python scripts/sample.py --workdir runs/dp4_tp2/checkpoints/200 --config mintrain/configs/tp8.py \
      --num_samples 4

Only the parameters are restored. The model is the one in the checkpoint's saved config, so it
always fits; the mesh is one device unless --config gives one (with its partitioning rules).
`--config.key=value` overrides apply to the saved config, e.g. --config.mesh.model=2 or
--config.model.compute_dtype=bfloat16. The text goes to stdout, notes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from typing import TYPE_CHECKING

from mintrain import errors
from mintrain.runtime import startup

if TYPE_CHECKING:
  import ml_collections

  from mintrain.config import Config


def sampling_config(saved: dict, layout: ml_collections.ConfigDict, overrides: list[str],
                    num_samples: int) -> Config:
  """The saved config on the sampling layout; its batch is the samples, so layout checks are about them."""
  from mintrain import config as config_lib

  config = config_lib.upgrade(saved)
  config.mesh.update(layout.mesh.to_dict())  # The saved section's other keys (dcn_*) stay.
  if 'partitioning' in layout:
    config.partitioning = layout.partitioning
  config_lib.apply_overrides(config, overrides)
  config.train.global_batch_size, config.train.grad_accum_steps = num_samples, 1
  return config_lib.validate(config)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--workdir', required=True, help='a run directory, its checkpoints/, or one step in it')
  parser.add_argument('--prompt', default='', help="text to continue; the tokenizer's BOS goes before it")
  parser.add_argument('--max_new_tokens', type=int, default=200, help='tokens to generate')
  parser.add_argument('--temperature', type=float, default=0.8, help='softmax temperature; 0 is greedy')
  parser.add_argument('--top_k', type=int, default=40, help='sample among the k most likely tokens; 0: all')
  parser.add_argument('--seed', type=int, default=0, help='PRNG seed of the draws')
  parser.add_argument('--num_samples', type=int, default=1, help='continuations of the prompt, as one batch')
  parser.add_argument('--config', default=None,
                      help='config file whose mesh and partitioning rules to sample on (default: one device)')
  overrides, rest = startup.split_overrides(sys.argv[1:])
  args = parser.parse_args(rest)
  import numpy as np  # After --help: these import JAX.

  from mintrain import config as config_lib
  from mintrain.checkpoint.model import layout_config
  for name in ('max_new_tokens', 'num_samples'):
    if getattr(args, name) < 1:
      parser.error(f'--{name} must be at least 1')
  if args.temperature < 0 or args.top_k < 0:
    parser.error('--temperature and --top_k must be >= 0')
  try:
    layout = layout_config(args.config, overrides)
    mesh_config = config_lib.validate(config_lib.upgrade({'mesh': layout.mesh.to_dict()})).mesh
  except errors.ConfigError as e:
    startup.fail(str(e))
  with contextlib.redirect_stdout(sys.stderr):  # Its note too: stdout is for the text alone.
    devices = startup.devices_for(mesh_config)

  import jax
  import jax.numpy as jnp

  from mintrain import loop, report
  from mintrain import mesh as mesh_lib
  from mintrain.build import build
  from mintrain.checkpoint import checkpoints as ckpt_lib
  from mintrain.data import tokenizer
  from mintrain.errors import PartitioningError
  from mintrain.models.transformer import sampling
  from mintrain.partitioning import AxisRules
  from mintrain.runtime import caches

  def note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

  try:
    directory, step = ckpt_lib.find_run_checkpoints(args.workdir)
    checkpoints = ckpt_lib.Checkpoints(directory, read_only=True)
    step = checkpoints.steps()[-1] if step is None else step
    config = sampling_config(checkpoints.metadata(step)['config'], layout, overrides, args.num_samples)
    caches.use_compilation_cache(config.train.compilation_cache)
    mesh_shape = mesh_lib.make_mesh(config.mesh.sizes, devices, config.mesh.slices).shape
    batch_ways = AxisRules.from_config(config.partitioning).ways('batch', mesh_shape)
    if args.num_samples % batch_ways:
      note(f'note: {args.num_samples} sample(s) do not split over the {batch_ways} devices that `batch` maps '
           'to; replicating the batch instead.')
      rules = (('batch', None),) + config.partitioning.rules
      config = config.replace(partitioning=dataclasses.replace(config.partitioning, rules=rules))
    run = build(config, devices)
    restored = checkpoints.restore(step, run.abstract_state, params_only=True)
    params = restored.state['params']
    checkpoints.close()
    with jax.set_mesh(run.mesh):  # A LoRA run's base, which its checkpoints do not hold.
      loop.check_lora_base(run, restored.metadata.get('lora_base'))
      frozen = loop.frozen_base(run)
    tok = tokenizer.for_run(directory.parent, config.data.tokenizer)  # The one it trained with.
  except (errors.CheckpointError, errors.ConfigError, errors.MeshError, PartitioningError) as e:
    startup.fail(str(e))
  mesh = run.mesh
  with jax.set_mesh(mesh):
    model = run.model(params, frozen)
  if not hasattr(model, 'decode'):
    startup.fail(f'The checkpoint holds a model.name={config.model_name!r} model, which cannot sample '
                    'text '
                    '(it has no decode step).')

  vocab_size = model.cfg.vocab_size
  if args.top_k > vocab_size:
    parser.error(f'--top_k {args.top_k} exceeds the vocabulary ({vocab_size} tokens)')
  bos = [tok.bos_id] if tok.bos_id is not None and tok.bos_id < vocab_size else []
  if tok.bos_id is not None and not bos:
    note(f'note: the model has {vocab_size} tokens, so no BOS (id {tok.bos_id}); the prompt starts alone.')
  prompt_P = np.concatenate([np.array(bos, np.int32), tok.encode(args.prompt)])
  if not len(prompt_P):
    parser.error('--prompt is empty and the tokenizer has no BOS token to start from')
  total = len(prompt_P) + args.max_new_tokens
  if total > config.train.seq_len:
    note(f'warning: prompt + new tokens = {total} positions, more than the {config.train.seq_len} the model '
         'was trained on; expect the text to degrade past that.')
  how = ('greedy' if args.temperature == 0 else
         f'temperature {args.temperature}, top-k {args.top_k or "off"}, seed {args.seed}')
  note(f'Sampling step {step} of {directory} on mesh {mesh_lib.describe(mesh.shape)}: {args.max_new_tokens} '
       f'tokens, {how}.')
  with jax.set_mesh(mesh):
    cache = report.kv_cache_bytes(model, args.num_samples, total, jnp.dtype(config.model.compute_dtype))
  params = sum(p.bytes_per_device for p in run.layout)
  note(report.format_sampling_plan(params, cache, args.num_samples, total, mesh.devices.flat[0]))

  with jax.set_mesh(mesh):
    prompt_BP = np.tile(prompt_P, (args.num_samples, 1))
    tokens_BN = sampling.generate(model, prompt_BP, args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, key=jax.random.key(args.seed))
  for i, new_N in enumerate(np.asarray(tokens_BN)):
    if args.num_samples > 1:
      print(f'--- sample {i + 1} ---')
    print(tok.decode(np.concatenate([prompt_P, new_N])))
  return 0


if __name__ == '__main__':
  sys.exit(main())
