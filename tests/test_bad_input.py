"""Every bad input to scripts/train.py is one line on stderr, `error: ...`, exit status 2 and no traceback,
and it loses nothing: the workdir a previous run left (its checkpoints, metrics.jsonl, hparams.json) is
unchanged byte for byte after the failed run, and no half-written checkpoint is left behind.

Each row starts from a copy of one short real run (made once per session) at TMP/run.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
from collections.abc import Callable

import helpers
import pytest
from helpers import REPO, run_script, script_flags

# The reference run's model and schedule; every row starts from them, so a run that got past a bad input
# would resume the reference run rather than stop on a model mismatch.
SMALL = script_flags('data.source=synthetic', *helpers.SMALL, 'train.steps=2', 'train.log_every=1',
                     'eval.every_steps=0', 'checkpoint.every_steps=1')
TIMEOUT_S = 300  # Per script run; under a loaded machine the full-disk row, which trains, takes 2 min.

# A run that holds the lock on a workdir until its stdin closes: another run, as far as a new one can tell.
HOLD = ('import sys\nfrom mintrain.runtime.run_lock import RunLock\n'
        'with RunLock(sys.argv[1]):\n  sys.stdin.read()\n')


class Scene:
  """What a row's set-up may make in TMP (the test's directory): files, mounts, a run holding the lock.
  Everything it starts or mounts ends with the test."""

  def __init__(self, tmp: pathlib.Path):
    self.tmp = tmp
    self.mounts: list[pathlib.Path] = []
    self.procs: list[subprocess.Popen] = []

  def write(self, name: str, text: str) -> None:
    (self.tmp / name).write_text(text)

  def write_bytes(self, name: str, data: bytes) -> None:
    (self.tmp / name).write_bytes(data)

  def tmpfs(self, name: str, size: str) -> pathlib.Path:
    """A fresh tmpfs at TMP/name (chmod does not stop root, a read-only mount does)."""
    path = self.tmp / name
    path.mkdir()
    proc = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(path)],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode:
      pytest.skip(f'cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}')
    self.mounts.append(path)
    return path

  def remount(self, path: pathlib.Path, options: str) -> None:
    subprocess.run(['mount', '-o', f'remount,{options}', str(path)], check=True, timeout=30)

  def hold_lock(self, workdir: pathlib.Path) -> None:
    proc = subprocess.Popen([sys.executable, '-c', HOLD, str(workdir)], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL)
    self.procs.append(proc)
    deadline = time.monotonic() + 60
    while not _held_by(workdir, proc.pid):
      assert proc.poll() is None and time.monotonic() < deadline, 'the lock holder did not take the lock'
      time.sleep(0.05)

  def close(self) -> None:
    for proc in self.procs:
      proc.kill()
      proc.wait(timeout=60)
      proc.stdin.close()
    for path in self.mounts:
      subprocess.run(['umount', '--lazy', str(path)], check=True, timeout=60)


def _held_by(workdir: pathlib.Path, pid: int) -> bool:
  try:
    return json.loads((workdir / 'run.lock').read_text())['pid'] == pid
  except (OSError, ValueError, KeyError):
    return False


def workdir_on_full_disk(scene: Scene) -> None:
  """The reference run on a tmpfs with room for its metrics but not for one more checkpoint."""
  disk = scene.tmpfs('disk', '64m')
  shutil.copytree(scene.tmp / 'run', disk / 'run')
  used = os.statvfs(disk).f_blocks - os.statvfs(disk).f_bfree
  scene.remount(disk, f'size={(used + 32) * os.statvfs(disk).f_frsize}')  # 32 pages to spare.


def corpus(bad_name: str, bad: bytes | Callable[[pathlib.Path], None]) -> Callable[[Scene], None]:
  """TMP/c: twelve good JSONL files, both splits, and one bad file (bytes, or written by a function)."""
  def setup(scene: Scene) -> None:
    root = scene.tmp / 'c'
    root.mkdir()
    for i in range(12):
      (root / f'good{i:02d}.jsonl').write_text(''.join(json.dumps({'text': f'doc {i} {j} ' * 9}) + '\n'
                                                       for j in range(20)))
    if callable(bad):
      bad(root / bad_name)
    else:
      (root / bad_name).write_bytes(bad)
  return setup


def parquet_without_text(path: pathlib.Path) -> None:
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.table({'body': ['a document']}), path)


# With evaluation on, the eval split's baseline is a full pass over it before the run writes: its bad file is
# found then (without evaluation, no eval split is read at all).
STREAMED = ('--workdir', '{tmp}/run', '--config.data.source=jsonl', '--config.data.path={tmp}/c/*',
            '--config.data.eval_fraction=0.3', '--config.eval.steps=1')


def workdir_read_only(scene: Scene) -> None:
  disk = scene.tmpfs('disk', '64m')
  shutil.copytree(scene.tmp / 'run', disk / 'run')
  scene.remount(disk, 'ro')


@dataclasses.dataclass(frozen=True)
class Row:
  args: tuple[str, ...]  # After the dp4_tp2 config and SMALL; `{tmp}`: the test's directory.
  says: tuple[str, ...]  # What the error line names (the key, the value, what is allowed, the path).
  setup: Callable[[Scene], None] = lambda scene: None
  kept: str = 'run'  # Under TMP: what must be unchanged byte for byte.


def row(*args: str, says: str | tuple[str, ...], **kwargs) -> Row:
  return Row(args, (says,) if isinstance(says, str) else says, **kwargs)


ROWS = {
    # Config files that do not load.
    'config with a syntax error': row(
        '--config', '{tmp}/bad.py', '--workdir', '{tmp}/run', says='{tmp}/bad.py:4: SyntaxError: ',
        setup=lambda s: s.write('bad.py', 'from configs import base\n\ndef get_config():\n  c = base.(\n')),
    'config that raises': row(
        '--config', '{tmp}/bad.py', '--workdir', '{tmp}/run',
        says="{tmp}/bad.py: get_config() raised KeyError: 'dataset' ({tmp}/bad.py:2).",
        setup=lambda s: s.write('bad.py', 'def get_config():\n  return {}["dataset"]\n')),
    'config without get_config': row(
        '--config', '{tmp}/bad.py', '--workdir', '{tmp}/run',
        says='{tmp}/bad.py has no get_config() function',
        setup=lambda s: s.write('bad.py', 'def config():\n  return None\n')),
    'config that does not exist': row(
        '--config', '{tmp}/nope.py', '--workdir', '{tmp}/run', says='{tmp}/nope.py does not exist'),
    'config that is a directory': row('--config', '{tmp}', '--workdir', '{tmp}/run', says='is a directory'),
    # Malformed overrides.
    'override without a value': row(
        '--config.train.steps', '--workdir', '{tmp}/run',
        says="Override 'train.steps' must look like key.path=value"),
    'override of an unknown key': row(
        '--config.no.such.key=1', '--workdir', '{tmp}/run', says="Unknown config key 'no.such.key'"),
    'override with a close match': row(
        '--config.train.stesp=5', '--workdir', '{tmp}/run', says=("'train.stesp'", 'Did you mean steps?')),
    'override that does not parse': row(
        '--config.train.steps=abc', '--workdir', '{tmp}/run',
        says="train.steps expects an integer, got 'abc'"),
    'override of the wrong type': row(
        '--config.model.tie_embeddings=1', '--workdir', '{tmp}/run',
        says="model.tie_embeddings expects True or False, got '1'"),
    'override of a list with a word': row(
        '--config.partitioning.rules=batch', '--workdir', '{tmp}/run',
        says="partitioning.rules expects a list, got 'batch'"),
    'override of a whole section': row(
        '--config.train=3', '--workdir', '{tmp}/run', says='train is a section, not a value'),
    # Values outside their meaning.
    'negative learning rate': row(
        '--config.optimizer.learning_rate=-1', '--workdir', '{tmp}/run',
        says='optimizer.learning_rate=-1.0 must be > 0.'),
    'infinite learning rate': row(
        '--config.optimizer.learning_rate=1e999', '--workdir', '{tmp}/run',
        says='optimizer.learning_rate=inf must be a finite number.'),
    'negative steps': row(
        '--config.train.steps=-5', '--workdir', '{tmp}/run', says='train.steps=-5 must be an integer >= 1.'),
    'unknown choice': row(
        '--config.model.remat=some', '--workdir', '{tmp}/run',
        says="model.remat='some'; choose one of ('none', 'full', 'save_matmuls')."),
    'tokenizer that does not exist': row(
        '--config.data.tokenizer={tmp}/nope.json', '--workdir', '{tmp}/run',
        says="data.tokenizer='{tmp}/nope.json' does not exist; give 'byte', a Hugging Face tokenizer.json"),
    'tokenizer that is not one': row(
        '--config.data.tokenizer={tmp}/tokenizer.json', '--workdir', '{tmp}/run',
        says=("data.tokenizer='{tmp}/tokenizer.json': {tmp}/tokenizer.json is not a Hugging Face "
              'tokenizer.json ('),
        setup=lambda s: s.write('tokenizer.json', '{"version": "1.0", "model": 3}\n')),
    'token file with an id outside the vocabulary': row(
        '--config.data.source=tokens', '--config.data.path={tmp}/ids.bin', '--workdir', '{tmp}/run',
        says=('{tmp}/ids.bin holds token id 500 at token 70 (byte offset 140)', '[0, 384) of 384 ids'),
        setup=lambda s: s.write_bytes('ids.bin', bytes(140) + b'\xf4\x01' + bytes(58))),
    'unknown model family': row(
        '--config.model.name=gpt', '--workdir', '{tmp}/run', says="model.name='gpt'; choose one of"),
    'batch the mesh does not divide': row(
        '--config.train.global_batch_size=30', '--workdir', '{tmp}/run', says='30 % 4 != 0'),
    'sequence the context split does not divide': row(
        '--config.mesh.data=2', '--config.mesh.context=2', '--config.train.seq_len=33',
        '--workdir', '{tmp}/run',
        says='`length` (train.seq_len=33) is split over `context` = 2 devices; 33 % 2 != 0.'),
    'memory plan beyond the host memory': row(
        '--config.train.global_batch_size=1048576', '--workdir', '{tmp}/run',
        says=('memory plan', 'train.global_batch_size')),
    # Streamed data: each bad file, line or record is named; the run stops before it writes anything.
    'malformed JSONL line': row(
        *STREAMED, says=('{tmp}/c/bad.jsonl:2: not valid JSON', 'data.skip_bad_records=True'),
        setup=corpus('bad.jsonl', b'{"text": "one"}\n{"text": "two\n{"text": "three"}\n')),
    'JSONL line without the text field': row(
        *STREAMED, says="{tmp}/c/bad.jsonl:3: no field 'text' (data.text_field)",
        setup=corpus('bad.jsonl', b'{"text": "one"}\n\n{"body": "two"}\n')),
    'empty JSONL file': row(*STREAMED, says='{tmp}/c/bad.jsonl is empty', setup=corpus('bad.jsonl', b'')),
    'corrupt Parquet file': row(
        *STREAMED, '--config.data.source=parquet', says='{tmp}/c/bad.parquet is not a readable Parquet file',
        setup=corpus('bad.parquet', b'PAR1' + b'\0' * 64)),
    'Parquet file without the text column': row(
        *STREAMED, '--config.data.source=parquet', '--config.data.path={tmp}/c/*.parquet',
        says="{tmp}/c/bad.parquet has no column 'text' (data.text_field; its columns: body)",
        setup=corpus('bad.parquet', parquet_without_text)),
    'corrupt ArrayRecord file': row(
        *STREAMED, '--config.data.source=arrayrecord', '--config.data.path={tmp}/c/*.arrayrecord',
        says='{tmp}/c/bad.arrayrecord is not a readable ArrayRecord file',
        setup=corpus('bad.arrayrecord', b'\1' * 4096)),
    'mixture weight of 0': row(
        '--workdir', '{tmp}/run', '--config.data.source=mixture',
        "--config.data.mixture=[({{'source': 'jsonl', 'path': 'a/*.jsonl'}}, 0)]",
        says='data.mixture[0]: weight=0 must be a finite number > 0'),
    'mixture of an unknown source': row(
        '--workdir', '{tmp}/run', '--config.data.source=mixture',
        "--config.data.mixture=[({{'source': 'csv', 'path': 'a/*.csv'}}, 1)]",
        says="data.mixture[0]: source='csv' is not a source a mixture can draw from"),
    # Workdirs that cannot take the run.
    'workdir that is a file': row(
        '--workdir', '{tmp}/file', says='{tmp}/file is a file', kept='file',
        setup=lambda s: s.write('file', 'notes\n')),
    'workdir under a file': row(
        '--workdir', '{tmp}/file/run', says='{tmp}/file/run', kept='file',
        setup=lambda s: s.write('file', 'notes\n')),
    'workdir on a read-only disk': row(
        '--config.train.steps=4', '--workdir', '{tmp}/disk/run',
        says=('{tmp}/disk/run', 'Read-only file system'),
        setup=workdir_read_only, kept='disk/run'),
    'workdir on a full disk': row(
        '--config.train.steps=4', '--workdir', '{tmp}/disk/run', says=('{tmp}/disk/run', 'free'),
        setup=workdir_on_full_disk, kept='disk/run/checkpoints'),
    'workdir locked by a live run': row(
        '--config.train.steps=4', '--workdir', '{tmp}/run', says=('{tmp}/run is in use by another run: pid',),
        setup=lambda s: s.hold_lock(s.tmp / 'run')),
    'resume with a changed architecture': row(
        '--config.train.steps=4', '--config.model.embed_dim=128', '--workdir', '{tmp}/run',
        says=('{tmp}/run/checkpoints/2 does not match the configured model', 'params.')),
    # Restore paths with nothing to restore.
    'restore from a path that does not exist': row(
        '--workdir', '{tmp}/new', '--restore_from', '{tmp}/nope',
        says='{tmp}/nope: no such file or directory'),
    'restore from a file': row(
        '--workdir', '{tmp}/new', '--restore_from', '{tmp}/run/metrics.jsonl',
        says='{tmp}/run/metrics.jsonl is a file'),
    'restore from a directory without checkpoints': row(
        '--workdir', '{tmp}/new', '--restore_from', '{tmp}/empty',
        says='{tmp}/empty holds no complete checkpoint',
        setup=lambda s: (s.tmp / 'empty').mkdir()),
}


@pytest.fixture(scope='session')
def reference_run(tmp_path_factory) -> pathlib.Path:
  """A short real run's workdir (checkpoints, metrics.jsonl, hparams.json), made once for all workers."""
  shared = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    shared = shared.parent  # The session's directory, above each worker's own.
  done = shared / 'bad_input_reference'
  with open(shared / 'bad_input_reference.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not done.exists():
      work = shared / 'bad_input_reference.partial'
      shutil.rmtree(work, ignore_errors=True)
      proc = run_script('scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py', *SMALL,
                        '--workdir', str(work), timeout=TIMEOUT_S)
      assert proc.returncode == 0, proc.stderr
      work.rename(done)
  return done


def snapshot(path: pathlib.Path) -> dict[str, bytes]:
  """Every file under `path` (or the file itself) by relative path, with its bytes."""
  if path.is_file():
    return {'.': path.read_bytes()}
  return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob('*')) if p.is_file()}


# One row of each kind in the default suite (each is a process of its own, about 4 s of the suite's time
# on 2 cores); the slow set runs every row, the full disk among them (~20 s: a run until its disk fills).
DEFAULT_ROWS = {
    'config with a syntax error', 'override with a close match', 'infinite learning rate',
    'tokenizer that is not one', 'token file with an id outside the vocabulary',
    'batch the mesh does not divide', 'memory plan beyond the host memory', 'malformed JSONL line',
    'corrupt Parquet file', 'mixture of an unknown source', 'workdir under a file',
    'workdir locked by a live run', 'resume with a changed architecture',
    'restore from a directory without checkpoints'}
assert DEFAULT_ROWS <= ROWS.keys()


@pytest.mark.parametrize('name', [pytest.param(name, marks=[] if name in DEFAULT_ROWS else [pytest.mark.slow])
                                  for name in ROWS])
def test_a_bad_input_is_one_line_exit_2_no_traceback_and_loses_nothing(name, tmp_path, reference_run):
  case = ROWS[name]
  shutil.copytree(reference_run, tmp_path / 'run')
  scene = Scene(tmp_path)
  try:
    case.setup(scene)
    before = snapshot(tmp_path / case.kept)
    args = [a.format(tmp=tmp_path) for a in case.args]
    proc = run_script('scripts/train.py', '--config', 'mintrain/configs/dp4_tp2.py', *SMALL, *args,
                      timeout=TIMEOUT_S)
    after = snapshot(tmp_path / case.kept)
    leftovers = [str(p) for p in tmp_path.rglob('*orbax-checkpoint-tmp*')]
  finally:
    scene.close()
  assert 'Traceback' not in proc.stdout + proc.stderr, proc.stderr[-3000:]
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: '), proc.stderr[-3000:]
  for text in case.says:
    assert text.format(tmp=tmp_path) in lines[0]
  assert after == before, sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
  assert not leftovers
