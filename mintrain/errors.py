"""Every error mintrain raises for bad input or an unusable environment: one line that says what was wrong and
what to do. Scripts catch `MintrainError` alone, print it and exit with status 2; anything else is a bug."""


class MintrainError(Exception):
  """Base of mintrain's one-line errors."""


class ConfigError(MintrainError, ValueError):
  """A config value that cannot work; the message names the key, the value and what is allowed."""


class MeshError(MintrainError, ValueError):
  """A mesh that does not fit the devices."""


class PartitioningError(MintrainError, ValueError):
  """A rule set or a shape that cannot be laid out on the mesh."""


class DataError(MintrainError, ValueError):
  """Unusable data or data settings; the message names the file or key and what to change."""


class MemoryPlanError(MintrainError, ValueError):
  """A memory plan larger than the devices hold: refused before anything is allocated."""


class NonFiniteLossError(MintrainError, FloatingPointError):
  """The loss became NaN or Inf; the message names the step."""


class CheckpointError(MintrainError, RuntimeError):
  """A checkpoint that is missing, damaged or does not fit the model; one line, names what to do."""


class DamagedCheckpointError(CheckpointError):
  """A checkpoint whose files cannot be read; an older one may still be intact."""


class StorageError(CheckpointError):
  """A run path that cannot hold what a run writes: an existing file where a directory belongs, a
  read-only file system, no permission."""


class DiskFullError(StorageError):
  """A save that did not fit: it names the bytes it needs and those free. Nothing older is lost."""


class SafetensorsError(MintrainError, ValueError):
  """A file that is not a well-formed safetensors file."""


class RunLockError(MintrainError, RuntimeError):
  """The workdir is held by another run, or cannot hold a lock; one line naming the holder and what to do."""


class DistributedError(MintrainError, RuntimeError):
  """Incomplete or inconsistent multi-process settings."""


class RewardError(MintrainError, ValueError):
  """A reward function (grpo.reward) failed or returned values that do not fit its completions."""


def first_line(e: BaseException) -> str:
  """The first line of an exception's message (its type's name if it has none): the reason in a one-line
  error about something a library refused."""
  return (str(e).strip().splitlines() or [type(e).__name__])[0]
