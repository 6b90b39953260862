"""The benchmarks still run: each in its --smoke form, as a real subprocess.

They check the benchmark scripts, not mintrain, and each compiles several programs of its own: the slow
set (`pytest -m slow`, run by .ci/run) holds them.
"""

import os
import pathlib
import re
import shutil

import pytest
from helpers import run_script

pytestmark = pytest.mark.slow


def test_checkpoint_benchmark_smoke_prints_a_table_of_positive_times():
  stdout, header, body = smoke('checkpoint.py')
  assert 'simulating 8 CPU devices' in stdout
  for column in ('params', 'step_ms', 'first_save_blocked_ms', 'save_blocked_ms', 'save_total_ms', 'ckpt_MiB',
                 'restore_dp4_tp2_ms', 'restore_fsdp8_ms', 'restore_tp8_ms', 'restore_single_ms'):
    assert column in header
  assert [row[0] for row in body] == ['tiny']
  values = numbers(body[0][1:])
  assert len(values) == len(header) - 1 and all(n > 0 for n in values), body[0]


def smoke(script: str, *args: str) -> tuple[str, list[str], list[list[str]]]:
  """Runs `benchmarks/SCRIPT --smoke ARGS` without device flags: (stdout, table header, table rows). The time
  limit only catches a hang: moe.py compiles ten programs, which beside the other workers takes minutes."""
  proc = run_script(f'benchmarks/{script}', '--smoke', *args, timeout=900)
  assert proc.returncode == 0, proc.stderr
  rows = [[c.strip() for c in line.strip('|').split('|')] for line in proc.stdout.splitlines()
          if line.startswith('|') and '---' not in line]
  header, *body = rows
  return proc.stdout, header, body


def numbers(row: list[str]) -> list[float]:
  """The numeric cells of a table row (thousands separators and percent signs dropped)."""
  out = []
  for cell in row:
    try:
      out.append(float(cell.replace(',', '').rstrip('%')))
    except ValueError:
      pass
  return out


def test_step_benchmark_smoke_reports_model_flops_against_a_same_run_matmul_calibration():
  stdout, header, body = smoke('step.py')
  for column in ('compile_s', 'step_ms', 'tokens_per_s', 'model_TFLOP_s', 'matmul_TFLOP_s', 'ratio'):
    assert column in header
  assert [row[0] for row in body] == ['baseline']
  cells = dict(zip(header, body[0]))
  assert all(float(cells[c].replace(',', '').rstrip('%')) > 0 for c in header[1:] if c != 'spread')
  assert 'ratio = median over steps of model / matmul rate' in stdout


def test_dots_benchmark_smoke_times_the_steps_matmuls_alone_against_the_step():
  stdout, header, body = smoke('dots.py', '--kinds')
  assert header == ['program', 'ms', 'spread', 'of the step', 'ratio']
  kinds_header = ['ms', 'share', 'dots', 'lhs', 'rhs', 'dimension numbers', 'ratio']
  body, kinds = body[:body.index(kinds_header)], body[body.index(kinds_header) + 1:]
  assert [row[0] for row in body] == ['the train step', 'its dots alone']
  found = re.search(r'(\d+) dots per device, ([\d.]+) GFLOP \(the analytic count: ([\d.]+)\)', stdout)
  assert found and int(found.group(1)) > 0, stdout
  # Every dot of the compiled step was rebuilt from the HLO: their FLOPs are the model's.
  assert float(found.group(2)) == pytest.approx(float(found.group(3)), rel=0.1)
  step, alone = (numbers(row[1:]) for row in body)
  assert step[0] > 0 and alone[0] > 0 and alone[-1] > 0
  # Each kind of dot once, the slowest first, their counts all the step's dots.
  assert sum(int(row[2]) for row in kinds) == int(found.group(1))
  assert len({tuple(row[3:6]) for row in kinds}) == len(kinds)
  times = [float(row[0].replace(',', '')) for row in kinds]
  assert times == sorted(times, reverse=True) and sum(float(row[1].rstrip('%')) for row in kinds) == \
      pytest.approx(100, abs=0.1 * len(kinds))


def test_step_benchmark_times_two_checkouts_steps_in_turns_in_one_process(tmp_path):
  repo = pathlib.Path(__file__).parents[1]
  shutil.copytree(repo / 'mintrain', tmp_path / 'mintrain', ignore=shutil.ignore_patterns('__pycache__'))
  build = tmp_path / 'mintrain/build.py'  # The other checkout says when it builds a run.
  build.write_text(build.read_text() + '\nprint("other checkout imported")\n')
  stdout, header, body = smoke('step.py', '--tree', str(tmp_path), '--tree', str(repo))
  assert stdout.count('other checkout imported') == 1
  assert f'compiled baseline with {tmp_path}/mintrain' in stdout
  assert f'compiled baseline with {repo}/mintrain' in stdout
  cells = [dict(zip(header, row)) for row in body]
  assert [c['checkout'] for c in cells] == [str(tmp_path), str(repo)]
  assert cells[0]['against first'] == '1.000' and float(cells[1]['against first']) > 0
  assert all(float(c['step_ms']) > 0 for c in cells)


def test_overhead_benchmark_smoke_hand_written_step_matches_mintrain_loss():
  stdout, header, body = smoke('overhead.py')
  assert header[:3] == ['step', 'compile_s', 'step_ms']
  assert [row[0] for row in body] == ['mintrain', 'hand']
  assert all(n > 0 for row in body for n in numbers(row[1:]))
  mintrain, hand = (dict(zip(header, row)) for row in body)
  assert abs(float(mintrain['loss_first']) - float(hand['loss_first'])) < 1e-4
  assert 'mintrain / hand-written step time:' in stdout


def test_meshes_benchmark_smoke_reports_memory_and_the_fsdp_ratio():
  stdout, header, body = smoke('meshes.py')
  for column in ('step_ms', 'params_MiB', 'opt_state_MiB', 'xla_argument_MiB', 'xla_temp_MiB'):
    assert column in header
  assert [row[0] for row in body] == ['dp8', 'fsdp8']
  ratio = float(stdout.split('FSDP ratio: params + opt_state per device on fsdp8 / dp8 = ')[1].split()[0])
  assert 0 < ratio <= 1 / 7


def test_depth_benchmark_smoke_compiles_unrolled_and_scanned_layers():
  stdout, header, body = smoke('depth.py')
  assert {'unrolled_total_s', 'unrolled_step_ms'} <= set(header)
  assert len(body) == 1 and all(n > 0 for n in numbers(body[0]))
  assert 'unrolled: compile(' in stdout


def test_breakdown_benchmark_smoke_attributes_op_time_to_model_code():
  stdout, header, body = smoke('breakdown.py')
  assert header == ['part', 'forward_ms', 'backward_ms', 'total_ms', 'share']
  parts = {row[0] for row in body}
  assert {'_loss_chunk', 'linear (weight matmuls, all layers)', 'GatedMLP.__call__', 'optimizer (optax)'} \
      <= parts
  assert not parts & {'gather', 'AxisRules.reshard'}  # Helpers count for their callers.
  assert abs(sum(float(row[4].rstrip('%')) for row in body) - 100) < 1


def test_breakdown_puts_the_weight_matmuls_forward_products_in_the_linear_row(monkeypatch):
  """Their custom VJP's forward rule is traced without its caller's frames: the op goes by its einsum."""
  import jax
  monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[1] / 'benchmarks'))
  import breakdown
  import harness

  path, overrides = harness.bench_tiny()
  compiled, _, _ = harness.prepare(harness.load(path, (*overrides, *harness.SMOKE)), jax.devices())
  ops = breakdown.instructions(compiled.compiled.as_text()).values()
  dots = [(part, backward) for opcode, part, backward in ops if opcode == 'dot']
  # One layer: the fused query-key-value, output, gate-up and down projections, forward and backward (2).
  assert sum(part == breakdown.LINEAR_ROW and not backward for part, backward in dots) == 4, dots
  assert sum(part == breakdown.LINEAR_ROW and backward for part, backward in dots) == 8, dots
  assert not any(part == breakdown.OTHER for part, _ in dots), dots


def test_context_benchmark_smoke_reports_memory_per_device_and_step_time_of_both_paths():
  stdout, header, body = smoke('context.py')
  assert header == ['run', 'mesh', 'compile_s', 'step_ms', 'xla_temp_MiB', 'xla_argument_MiB', 'act_plan_MiB']
  assert [row[0] for row in body] == ['context1', 'context4 all_gather', 'context4 ring']
  assert all(n > 0 for row in body for n in numbers(row[2:]))
  for path in ('all_gather', 'ring'):  # Splitting the length saves memory even on the smoke's tiny model.
    ratio = float(stdout.split(f'xla_temp per device context4 {path} / context1 = ')[1].split()[0])
    assert 0 < ratio < 1
  assert 'step time ratio: ring / all_gather on context4 = ' in stdout


def test_moe_benchmark_smoke_times_the_mixtures_against_the_dense_model():
  stdout, header, body = smoke('moe.py')
  assert header[:2] == ['variant', 'mesh'] and 'step / dense' in header
  variants = ['dense', '8e top-2 grouped', '8e top-2 grouped, EP4', '8e top-2 grouped, EP4, bound 2',
              '8e top-2 slots, EP4', '8e top-2 capacity 1.25, EP4', '64e top-4 grouped',
              '64e top-4 grouped, EP4, bound 2', '64e top-4 grouped, EP8', '64e top-4 grouped, EP8, bound 2']
  assert [row[0] for row in body] == variants
  cells = [dict(zip(header, row)) for row in body]
  assert cells[0]['step / dense'] == '1.00' and all(float(c['step ms']) > 0 for c in cells)
  # The process's CPU time over the step's: some core was busy, never more than the machine has.
  assert all(0 < float(c['cores busy']) <= os.cpu_count() + 0.05 for c in cells)
  assert 'expert=4' in cells[2]['mesh'] and 'expert' not in cells[1]['mesh']
  assert 'expert=8' in cells[8]['mesh']
  # The analytic count is of the active experts: the same whatever the dispatch and the capacity.
  assert len({c['GFLOP per step (active)'] for c in cells[1:6]}) == 1


def test_moe_benchmark_times_a_variant_with_another_checkouts_layer_too(tmp_path):
  layer = tmp_path / 'mintrain/models/transformer'
  layer.mkdir(parents=True)
  source = pathlib.Path(__file__).parents[1] / 'mintrain/models/transformer'
  (layer / 'grouped.py').write_text((source / 'grouped.py').read_text())
  # The other checkout's layer says when it is traced: the baseline's step is built with it.
  (layer / 'moe.py').write_text((source / 'moe.py').read_text().replace(
      'def _grouped_local(', 'def _grouped_local(*args, **kwargs):\n  print("baseline layer traced")\n'
      '  return _ours(*args, **kwargs)\n\n\ndef _ours(', 1))
  stdout, header, body = smoke('moe.py', '--variant', '8e top-2 grouped', '--baseline', str(tmp_path))
  assert [row[0] for row in body] == ['dense', '8e top-2 grouped', '8e top-2 grouped (baseline)']
  assert stdout.count('baseline layer traced') >= 1
  cells = [dict(zip(header, row)) for row in body]
  assert cells[1]['GFLOP per step (active)'] == cells[2]['GFLOP per step (active)']
  assert all(float(c['step ms']) > 0 for c in cells)


def test_moe_benchmark_times_a_grouped_variant_with_the_tile_sizes_asked_for():
  stdout, header, body = smoke('moe.py', '--variant', '8e top-2 grouped', '--variant', '8e top-2 slots, EP4',
                               '--tile', '8')
  assert [row[0] for row in body] == ['dense', '8e top-2 grouped', '8e top-2 slots, EP4',
                                      '8e top-2 grouped, tile 8']  # Slots have no tiles.
  cells = [dict(zip(header, row)) for row in body]
  assert cells[1]['GFLOP per step (active)'] == cells[3]['GFLOP per step (active)']
  assert all(float(c['step ms']) > 0 for c in cells)
  # The size reaches the run's config: one it refuses stops the benchmark.
  proc = run_script('benchmarks/moe.py', '--smoke', '--variant', '8e top-2 grouped', '--tile', '-1',
                    timeout=900)
  assert proc.returncode != 0 and 'model.moe_tile=-1 must be an integer >= 0' in proc.stderr


def test_data_pipeline_benchmark_smoke_reads_each_source_faster_than_nothing():
  proc = run_script('benchmarks/data_pipeline.py', '--smoke')
  assert proc.returncode == 0, proc.stderr
  rates = {line[:24].strip(): float(line[24:].split()[0].replace(',', ''))
           for line in proc.stdout.splitlines() if 'tokens/s per process' in line}
  assert set(rates) == {'JSONL, byte tokenizer', 'JSONL, BPE tokenizer', 'ArrayRecord ids'}, proc.stdout
  assert all(rate > 0 for rate in rates.values())


def test_hf_load_benchmark_smoke_times_loads_against_reading_the_file_and_their_memory():
  stdout, header, body = smoke('hf_load.py')
  assert header == ['what', 'processes x devices', 'mesh', 'page_cache', 'ms', 'cpu_ms', 'x_read',
                    'x_fresh_read', 'cpu_x_fresh_read', 'read_MiB', 'peak_growth_MiB', 'growth / ckpt']
  assert [row[:4] for row in body] == [['read file, reused buffer', '1', '-', 'cold'],
                                       ['read file, fresh aligned buffer', '1', '-', 'cold'],
                                       ['read file, reused buffer', '1', '-', 'warm'],
                                       ['read file, fresh aligned buffer', '1', '-', 'warm'],
                                       ['read file, fresh aligned buffer, own process', '1', '-', 'warm'],
                                       ['hf.load_params', '1 x 8', 'fsdp8', 'warm'],
                                       ['hf.load_params', '2 x 4', 'fsdp8', 'warm']]
  assert all(n > 0 for row in body[4:] for n in numbers(row[4:]))
  assert 'Checkpoint: ' in stdout


def test_dpo_benchmark_smoke_times_dpo_against_sft_on_the_same_pairs():
  _, header, body = smoke('dpo.py')
  assert [row[0] for row in body] == ['sft', 'dpo, reference copy', 'dpo, LoRA (r=8)',
                                      'dpo, precomputed reference']
  cells = [dict(zip(header, row)) for row in body]
  assert all(float(c['step_ms']) > 0 for c in cells)
  sft, copy, _, precomputed = (float(c['GFLOP_per_step']) for c in cells)
  assert precomputed == pytest.approx(2 * sft, rel=0.05) and copy == pytest.approx(8 / 3 * sft, rel=0.05)
  assert all(c['loss_at_init'] == '0.6931' for c in cells[1:])  # The reference is the initial policy.


def test_lora_benchmark_smoke_has_fewer_trainable_bytes_with_lora_and_a_smaller_base_with_nf4():
  _, header, body = smoke('lora.py')
  assert [row[0] for row in body] == ['full fine-tuning', 'LoRA r16', 'QLoRA r16 nf4']
  full, lora, qlora = (dict(zip(header, row)) for row in body)
  assert float(lora['trainable']) < float(full['trainable'])
  assert float(qlora['params']) < float(lora['params'])
  assert all(float(row['step_ms']) > 0 for row in (full, lora, qlora))


def test_families_benchmark_smoke_times_each_family_against_llama():
  _, header, body = smoke('families.py')
  assert [row[0] for row in body] == ['llama', 'gemma2', 'gemma3', 'qwen3_moe', 'deepseek_v3']
  assert header[-1] == 'step / llama' and all(n > 0 for row in body for n in numbers(row[1:]))


def test_startup_benchmark_smoke_times_every_phase_and_finds_no_loop_in_the_initialiser():
  stdout, header, body = smoke('startup.py')
  assert header == ['tree', 'import_s', 'build_s', 'init_compile_s', 'init_run_s', 'batch_s',
                    'step_compile_s', 'first_step_s', 'second_step_s', 'to_first_step_s', 'init_loops']
  wall, repeated, cpu = body  # A table of wall seconds, then one of CPU seconds.
  assert repeated == header and 'CPU seconds:' in stdout
  for row in (wall, cpu):
    values = numbers(row[1:])
    assert all(n > 0 for n in values[:3]) and values[-2] > 0, row
    assert values[-1] == 0  # mintrain's threefry draws compile without loops.


def test_pipeline_benchmark_smoke_times_one_and_two_stages_against_their_bubble():
  _, header, body = smoke('pipeline.py')
  assert header[:4] == ['stages', 'microbatches', 'bubble', 'predicted_ms']
  assert [(row[0], row[2]) for row in body] == [('1', '0.0%'), ('2', '33.3%')]  # (S - 1) / (M + S - 1).
  assert all(n > 0 for row in body for n in numbers(row[3:]))


def test_pipeline_benchmark_runs_the_circular_schedule_and_skips_the_points_its_config_refuses():
  stdout, header, body = smoke('pipeline.py', '--override', 'pipeline.repeats=2', '--override',
                               'model.num_layers=4', '--stages', '2', '--microbatches', '1', '2')
  assert 'skipped 2 stage(s), 1 microbatches: pipeline.repeats=2' in stdout
  assert header[5] == 'step / 2 x 2'
  assert [(row[0], row[1], row[2]) for row in body] == [('2', '2', '20.0%')]  # (S - 1) / (R M + S - 1).
  cells = dict(zip(header, body[0]))
  assert float(cells['predicted_ms']) == float(cells['step_ms']) > 0  # The reference row predicts itself.


@pytest.mark.parametrize('timing', [(), ('--interleave',)])
def test_scaling_benchmark_smoke_compares_step_time_growth_with_flop_growth(timing):
  stdout, header, body = smoke('scaling.py', *timing)
  assert ('in turns, a calibration after each turn' in stdout) == bool(timing)
  assert [row[1] for row in body] == ['num_layers=1', 'num_layers=2']
  cells = [dict(zip(header, row)) for row in body]
  assert float(cells[0]['time_x']) == float(cells[0]['flops_x']) == 1.0
  assert float(cells[1]['flops_x']) > 1.0 and float(cells[1]['time_x']) > 0
  # Each cell is rounded to 0.005, so the quotient of the printed cells only bounds the printed quotient.
  time_x, flops_x = float(cells[1]['time_x']), float(cells[1]['flops_x'])
  low, high = (time_x - 0.005) / (flops_x + 0.005), (time_x + 0.005) / (flops_x - 0.005)
  assert low - 0.005 <= float(cells[1]['time_x / flops_x']) <= high + 0.005


def tables(stdout: str) -> list[tuple[list[str], list[dict[str, str]]]]:
  """Each Markdown table of `stdout`: its header, and its rows as {column: cell}."""
  out, lines = [], []
  for line in [*stdout.splitlines(), '']:
    if line.startswith('|'):
      lines.append([c.strip() for c in line.strip('|').split('|')])
    elif lines:
      header, *rows = [row for row in lines if not all(set(c) <= {'-'} for c in row)]
      out.append((header, [dict(zip(header, row)) for row in rows]))
      lines = []
  return out


def test_gpu_benchmark_smoke_times_each_part_and_checks_the_grouped_matmuls_values(tmp_path):
  proc = run_script('benchmarks/gpu.py', '--smoke', '--profile', str(tmp_path), timeout=900)
  assert proc.returncode == 0, proc.stderr
  found = tables(proc.stdout)
  mfu, moe = [rows for header, rows in found if header[0] == 'variant']
  assert [r['variant'] for r in mfu] == ['as configured (unrolled, no remat)', 'scanned layers']
  assert all(float(r['step_ms']) > 0 and float(r['MFU'].rstrip('%')) > 0 for r in mfu)
  assert all(r['cuDNN'] == '0' for r in mfu)  # cuDNN's attention is a GPU's only.
  assert [r['variant'] for r in moe] == ['dense', '8e top-2 ragged_dot'] and moe[0]['step / first'] == '1.00'
  checked = next(rows for header, rows in found if header[-1] == 'within 1e-5')
  assert [r['kernel'] for r in checked] == ['ragged_dot', 'tiles of 256 rows', 'tiles, automatic']
  assert all(r['within 1e-5'] == 'yes' for r in checked)
  # The traced step, broken down by op: its HLO and trace kept, every op's time in a row.
  assert (tmp_path / 'step.hlo.txt').is_file() and (tmp_path / 'step.xplane.pb').is_file()
  parts = next(rows for header, rows in found if header[0] == 'part')
  assert float(next(r for r in parts if r['part'] == 'all ops')['step ms']) > 0


@pytest.mark.parametrize('ragged', [(), ('--ragged',)])
def test_sampling_benchmark_smoke_times_a_generate_call_and_its_temporaries(ragged):
  out, header, body = smoke('sampling.py', *ragged)
  assert ('(sampling.complete)' in out) == bool(ragged)
  assert header == ['checkout', 'prompt', 'width', 'new', 'ms', 'spread', 'new tokens/s', 'temp MiB',
                    'x first']
  assert [row[:4] for row in body] == [['.', '8', '8', '4']]
  ms, _, tokens_per_s, temp, first = (float(c.split('-')[0]) for c in body[0][4:])
  assert ms > 0 and tokens_per_s > 0 and temp > 0 and first == 1.0
