"""Where a run writes: local paths made absolute, URLs (`gs://...`) kept as they are, and the checks that a
path can hold a run (a directory, writable, with free space) before anything is written there."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import urllib.parse
import uuid

from etils import epath

from mintrain.errors import StorageError, first_line


def is_remote(path: str | os.PathLike) -> bool:
  """A URL (`gs://`, `s3://`, ...) rather than a local path; one-letter schemes are Windows drives."""
  return bool(re.match(r'[A-Za-z][A-Za-z0-9+.-]+://', os.fspath(path)))


def run_path(path: str | os.PathLike) -> epath.Path:
  """`path` as an epath.Path: a local path made absolute, a URL kept as it is (never absolutised).

  `pathlib.Path('gs://b/run')` reads as `gs:/b/run`, a local folder named `gs:`; such a path is refused
  rather than written in the working directory.
  """
  text = os.fspath(path)
  if re.match(r'[A-Za-z][A-Za-z0-9+.-]+:/(?!/)', text):
    raise StorageError(f'{text} looks like a URL that lost one slash of "://" (pathlib.Path does this); '
                       'pass it as a string or an etils.epath.Path.')
  if not is_remote(text):
    return epath.Path(os.path.abspath(text))
  missing = _missing_gcs_clients() if text.startswith('gs://') else []
  if missing:
    raise StorageError(f'{text}: gs:// paths need {" and ".join(missing)}; install them with '
                       "pip install 'mintrain[gcs]'.")
  return epath.Path(text)


def _missing_gcs_clients() -> list[str]:
  """What gs:// lacks here: google-cloud-storage (Orbax deletes with it) and gcsfs (epath's files), which
  TensorFlow's gfile replaces where it is installed (epath then prefers it)."""
  missing = [] if _importable('google.cloud.storage') else ['google-cloud-storage']
  if not _importable('gcsfs') and not _importable('tensorflow'):
    missing.insert(0, 'gcsfs')
  return missing


def _importable(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # A missing parent package.
    return False


def os_reason(e: BaseException) -> str:
  return e.strerror if isinstance(e, OSError) and e.strerror else _reason(e)


def prepare_dir(path: str | os.PathLike, what: str = 'workdir') -> epath.Path:
  """`path` (as `run_path` gives it), created if missing, once a probe file could be written there.

  Raises StorageError before any work is done when the run could not save: `path` is a file, or its file
  system is read-only, denies permission or is full. Permission bits alone would not tell: root may write
  through them, but not to a read-only mount.
  """
  path = run_path(path)
  if os.fspath(path).startswith('gs://'):
    _check_gcs(path, what)
  try:
    if path.exists() and not path.is_dir():
      raise StorageError(f'{what} {path} is a file, not a directory; give a directory (it is created if '
                         'missing).')
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f'.mintrain-write-probe-{uuid.uuid4().hex[:12]}'
    probe.write_bytes(b'')
    probe.unlink()
  except ImportError as e:  # fsspec's filesystem for the URL's scheme is not installed.
    raise StorageError(f'{what} {path} cannot be reached: {_reason(e)}') from e
  except OSError as e:
    blocking = None if is_remote(path) else next((p for p in path.parents if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
      raise StorageError(f'{what} {path} cannot be created: {blocking} is a file.') from e
    raise StorageError(f'{what} {path} is not writable ({os_reason(e)}); give a directory on a writable '
                       'file system.') from e
  return path


GCS_HOST = ('storage.googleapis.com', 443)
PROBE_SECS = 5.0


def _check_gcs(path: epath.Path, what: str) -> None:
  """Cloud Storage reachable and credentials present, found in seconds: gcsfs alone retries for a minute
  and logs a traceback per retry. `STORAGE_EMULATOR_HOST` (an emulator) needs no credentials."""
  emulator = os.environ.get('STORAGE_EMULATOR_HOST', '')
  if emulator:
    url = urllib.parse.urlsplit(emulator if '://' in emulator else f'http://{emulator}')
    host, port = url.hostname or 'localhost', url.port or (443 if url.scheme == 'https' else 80)
  else:
    host, port = GCS_HOST
  try:
    socket.create_connection((host, port), timeout=PROBE_SECS).close()
  except OSError as e:
    raise StorageError(f'{what} {path} cannot be reached: no connection to {host}:{port} '
                       f'({os_reason(e) if not isinstance(e, TimeoutError) else "timed out"}); check the '
                       f'network, or give a local directory.') from None
  if emulator:
    return
  import google.auth  # With google-cloud-storage, which `run_path` checked.
  import google.auth.exceptions

  try:
    google.auth.default()
  except google.auth.exceptions.DefaultCredentialsError:
    raise StorageError(f'{what} {path}: no Google Cloud credentials found; run `gcloud auth '
                       'application-default login` or set GOOGLE_APPLICATION_CREDENTIALS.') from None


def free_bytes(path: str | os.PathLike) -> int | None:
  """Free bytes of the local file system holding `path`; None for a remote path or when unknown."""
  if is_remote(path):
    return None
  try:
    return shutil.disk_usage(os.fspath(path)).free
  except OSError:
    return None


def _reason(e: BaseException) -> str:
  return first_line(e)[:200]  # A storage client's message can be a page long.
