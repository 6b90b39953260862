"""Metric writers and the figures they report.

Writers: a console line, TensorBoard event files in WORKDIR/tensorboard (written by
tensorboardX, so no process imports TensorFlow) and WORKDIR/metrics.jsonl, all behind
one `MultiWriter`, on process 0 only.
Throughput follows MaxText's conventions: step time excludes the compiling first
step, model FLOPs come from the analytic count in `flops.py`, and MFU divides
the achieved model FLOP/s per device by the device's peak.
"""

from __future__ import annotations

import datetime
import json
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from tensorboardX import SummaryWriter
from tensorboardX.summary import hparams as hparams_summaries

from mintrain import hardware

Scalars = Mapping[str, float]


class NonFiniteLossError(FloatingPointError):
  """The loss became NaN or Inf; the message names the step."""


def format_duration(seconds: float) -> str:
  return str(datetime.timedelta(seconds=round(seconds)))


CONSOLE = (('loss', 'loss {:.4f}'), ('grad_norm', 'grad_norm {:.3f}'), ('learning_rate', 'lr {:.2e}'),
           ('steps_per_sec', '{:.2f} steps/s'), ('tokens_per_sec', '{:,.0f} tok/s'),
           ('tflops_per_device', '{:.3f} TFLOP/s/dev'), ('mfu', 'MFU {:.1%}'),
           ('data_wait_fraction', 'data wait {:.1%}'), ('eval_loss', 'eval_loss {:.4f}'),
           ('eval_perplexity', 'eval_ppl {:.2f}'), ('eval_bits_per_byte', 'eval {:.3f} bits/byte'),
           ('unigram_bits_per_byte', 'eval split unigram entropy {:.3f} bits/byte: the baseline to beat'))


def format_line(step: int, scalars: Scalars, total_steps: int | None = None) -> str:
  head = f'step {step}' if total_steps is None else f'step {step}/{total_steps} ({step / total_steps:.0%})'
  parts = [head] + [fmt.format(scalars[key]) for key, fmt in CONSOLE if key in scalars]
  if 'eta_sec' in scalars:
    parts.append(f"ETA {format_duration(scalars['eta_sec'])}")
  return ' | '.join(parts)


class Writer(Protocol):
  """What the train loop writes to: scalars at every logged step, hyperparameters once."""

  def write_scalars(self, step: int, scalars: Scalars) -> None: ...

  def write_hparams(self, hparams: Mapping[str, Any]) -> None: ...

  def flush(self) -> None: ...

  def close(self) -> None:
    """Idempotent: a second call does nothing."""


class ConsoleWriter:
  """One line per record: progress, the figures in CONSOLE, and the ETA."""

  def __init__(self, print_fn: Callable[[str], None], total_steps: int):
    self.print_fn, self.total_steps = print_fn, total_steps

  def write_scalars(self, step: int, scalars: Scalars) -> None:
    self.print_fn(format_line(step, scalars, self.total_steps))

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    pass  # The config is in hparams.json and TensorBoard; on the console it would bury the report.

  def flush(self) -> None:
    pass

  def close(self) -> None:
    pass


class JsonlWriter:
  """`metrics.jsonl`: one JSON object per record; hyperparameters go to `hparams.json`."""

  def __init__(self, workdir: pathlib.Path):
    self.path = workdir / 'metrics.jsonl'
    self.hparams_path = workdir / 'hparams.json'

  def write_scalars(self, step: int, scalars: Scalars) -> None:
    with self.path.open('a') as f:
      f.write(json.dumps({'step': int(step), **{k: float(v) for k, v in scalars.items()}}) + '\n')

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    self.hparams_path.write_text(json.dumps(dict(hparams), indent=1, sort_keys=True) + '\n')

  def flush(self) -> None:
    pass  # Each record is closed as it is written.

  def close(self) -> None:
    pass


class TensorBoardWriter:
  """Event files in `logdir`: one scalar per tag and step, and the hyperparameters as the session start
  of TensorBoard's HParams plugin, which then offers every scalar tag as a metric (as `hp.hparams` does)."""

  def __init__(self, logdir: pathlib.Path):
    self.events = SummaryWriter(str(logdir))

  def write_scalars(self, step: int, scalars: Scalars) -> None:
    for tag, value in scalars.items():
      self.events.add_scalar(tag, float(value), int(step))

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    _, session_start, _ = hparams_summaries(dict(hparams), {})
    self.events.file_writer.add_summary(session_start)

  def flush(self) -> None:
    self.events.flush()

  def close(self) -> None:
    self.events.close()  # tensorboardX ignores a second close.


class MultiWriter:
  """Passes every call on to each of `writers`; with none, a writer that does nothing."""

  def __init__(self, writers: Sequence[Writer] = ()):
    self.writers = list(writers)

  def write_scalars(self, step: int, scalars: Scalars) -> None:
    for writer in self.writers:
      writer.write_scalars(step, scalars)

  def write_hparams(self, hparams: Mapping[str, Any]) -> None:
    for writer in self.writers:
      writer.write_hparams(hparams)

  def flush(self) -> None:
    for writer in self.writers:
      writer.flush()

  def close(self) -> None:
    for writer in self.writers:
      writer.close()

  def __enter__(self) -> MultiWriter:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def make_writer(workdir: str | pathlib.Path | None, *, is_main: bool, total_steps: int,
                print_fn: Callable[[str], None] = print) -> MultiWriter:
  """Console + TensorBoard + metrics.jsonl on process 0; nothing elsewhere."""
  if not is_main:
    return MultiWriter()
  writers: list[Writer] = [ConsoleWriter(print_fn, total_steps)]
  if workdir is not None:
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    writers += [TensorBoardWriter(workdir / 'tensorboard'), JsonlWriter(workdir)]
  return MultiWriter(writers)


def flat_hparams(config: Mapping[str, Any], prefix: str = '') -> dict[str, Any]:
  """Nested config -> {'model.embed_dim': 128, ...} with TensorBoard-friendly values."""
  out = {}
  for key, value in config.items():
    name = f'{prefix}{key}'
    if isinstance(value, Mapping):
      out.update(flat_hparams(value, f'{name}.'))
    elif isinstance(value, (bool, int, float, str)):
      out[name] = value
    else:
      out[name] = str(value)
  return out


def format_summary(s: Mapping[str, float]) -> str:
  parts = [f"total {format_duration(s['total_time_sec'])}", f"compile {s['compile_time_sec']:.1f} s"]
  if 'step_time' in s:
    parts += [f"mean step {s['step_time'] * 1e3:.1f} ms", f"{s['tokens_per_sec']:,.0f} tok/s",
              f"{s['tflops_per_device']:.3f} TFLOP/s/dev", f"MFU {s['mfu']:.1%}"]
  if 'final_loss' in s:
    parts.append(f"final loss {s['final_loss']:.4f}")
  if 'final_eval_loss' in s:
    bpb = f" ({s['final_eval_bits_per_byte']:.3f} bits/byte)" if 'final_eval_bits_per_byte' in s else ''
    parts.append(f"final eval loss {s['final_eval_loss']:.4f}{bpb}")
  return 'summary: ' + ', '.join(parts)


def throughput(steps: int, seconds: float, *, tokens_per_step: int, flops_per_step: float,
               num_devices: int, peak_tflops: float) -> dict[str, float]:
  """Rates of an interval of `steps` steps that took `seconds`."""
  step_time = seconds / steps
  flops_per_device = flops_per_step / step_time / num_devices
  return {'step_time': step_time, 'steps_per_sec': 1 / step_time,
          'tokens_per_sec': tokens_per_step / step_time,
          'tokens_per_sec_per_device': tokens_per_step / step_time / num_devices,
          'tflops_per_device': flops_per_device / 1e12, 'mfu': hardware.mfu(flops_per_device, peak_tflops)}
