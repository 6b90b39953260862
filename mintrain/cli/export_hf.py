"""Write a run's checkpoint as a Hugging Face directory that `transformers` loads.

  python scripts/export_hf.py --workdir runs/llama_ft --out exported/llama_ft
  python scripts/export_hf.py --workdir runs/llama_ft --out exported/step200 --step 200 --dtype bfloat16
  python scripts/export_hf.py --workdir runs/lora --out exported/lora_adapter --adapter

Only the parameters are read, onto one device (or the mesh of --config); the model is the one in the
checkpoint's saved config. Tensors are written one at a time into safetensors shards of at most
--max_shard_size bytes, with `config.json` (and `model.safetensors.index.json` when sharded), and the
files of the tokenizer the run trained with (none for the byte tokenizer), so `AutoTokenizer` loads it.
A LoRA run's adapters are merged into its base (read from the run's init.hf_checkpoint, or drawn from its
seed); with --adapter, only they are written, as a PEFT adapter (`peft.PeftModel.from_pretrained`).
"""

from __future__ import annotations

import argparse
import sys

from mintrain import errors
from mintrain.runtime import startup


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument('--workdir', required=True, help='a run directory, its checkpoints/, or one step in it')
  parser.add_argument('--out', required=True, help='the Hugging Face directory to write')
  parser.add_argument('--step', type=int, default=None, help='the checkpoint step (default: the newest)')
  parser.add_argument('--dtype', default=None, choices=('float32', 'bfloat16'),
                      help="the tensors' dtype (default: the model's parameter dtype)")
  parser.add_argument('--max_shard_size', type=int, default=2**30, help='bytes per safetensors file')
  parser.add_argument('--adapter', action='store_true',
                      help="a LoRA run's adapters alone, as a PEFT adapter directory")
  parser.add_argument('--overwrite', action='store_true',
                      help='replace --out even if it holds files that no export writes')
  args = parser.parse_args()
  from mintrain import config as config_lib  # After --help: it imports JAX.

  one_device = {'mesh': config_lib.one_device_mesh().to_dict()}
  devices = startup.devices_for(config_lib.validate(config_lib.upgrade(one_device)).mesh)

  import jax
  from etils import epath

  from mintrain import hf, loop
  from mintrain.build import build
  from mintrain.checkpoint import checkpoints as ckpt_lib
  from mintrain.data import tokenizer
  from mintrain.lora import peft

  try:
    hf.check_out_dir(args.out, overwrite=args.overwrite)  # Before anything is read.
    directory, step = ckpt_lib.find_run_checkpoints(args.workdir)
    checkpoints = ckpt_lib.Checkpoints(directory, read_only=True)
    steps = checkpoints.steps()
    step = args.step if args.step is not None else step if step is not None else (steps or [None])[-1]
    if step not in steps:
      raise errors.CheckpointError(f'{args.workdir}: no complete checkpoint of step {step} (it has: '
                                     f'{", ".join(map(str, steps)) or "none"}).')
    saved = config_lib.upgrade(checkpoints.metadata(step)['config'])
    tok = tokenizer.for_run(directory.parent, saved.data.tokenizer or 'byte')
    lora_run = saved.lora.rank > 0
    if args.adapter and not lora_run:
      raise errors.ConfigError(f'--adapter: the run in {args.workdir} has no LoRA adapters (lora.rank=0).')
    if not lora_run:
      saved.init.hf_checkpoint = ''  # The saved model section is complete; the source may be gone.
    saved.init.lora_adapter = ''
    saved.mesh = config_lib.one_device_mesh()
    saved.train.global_batch_size, saved.train.grad_accum_steps = 1, 1
    run = build(config_lib.validate(saved), devices[:1])
    restored = checkpoints.restore(step, run.abstract_state, params_only=True)
    params = restored.state['params']
    checkpoints.close()
    with jax.set_mesh(run.mesh):
      if args.adapter:
        out = epath.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        files = peft.save_adapter(params, run.config, run.layout, out)
      else:
        frozen = None
        if lora_run:
          loop.check_lora_base(run, restored.metadata.get('lora_base'))
          frozen = loop.frozen_base(run)
        model = run.model(params, frozen)
        model = peft.merged(model, run.rules) if lora_run else model
        source = directory.parent / hf.RUN_SOURCE  # The run's copy of its HF source's configs, if any.
        files = hf.save_pretrained(model, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                                   tokenizer=tok, overwrite=args.overwrite,
                                   source=source if source.exists() else None,
                                   context_length=saved.train.seq_len)
  except errors.MintrainError as e:
    startup.fail(str(e))
  print(f'Wrote step {step} of {directory} to {args.out}: {", ".join(files)}.')
  return 0


if __name__ == '__main__':
  sys.exit(main())
