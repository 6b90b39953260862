"""The console filter of a process other than process 0, run as a child (`python -I console_guard.py`) that
reads the process's stderr.

When process 0 dies, JAX's client in another process learns that its service is gone as soon as
`distributed.PeerWatch` does, and its error and abort lines may come first. So C++ error lines are held
back for a moment: the PeerWatch's one line replaces them; without it, they are written after `HOLD_S`
or when the process has gone. A child, so that nothing held is lost when the process exits at once.
Standard library only.
"""

import os
import re
import select
import signal
import sys
import time

HOLD_S = 2.0
CPP_ERROR = re.compile(rb'[EF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^ ]+:\d+\] ')  # glog's error and fatal lines.
PEER_DIED = re.compile(rb'error: process \d+ .* died; process \d+ stops too')  # `PeerWatch._stop`'s line.


def main() -> None:
  for sig in (signal.SIGINT, signal.SIGTERM):  # Meant for the process; this drains until it has gone.
    signal.signal(sig, signal.SIG_IGN)
  out = sys.stdout.buffer
  held: list[bytes] = []
  since = 0.0
  pending = b''
  while True:
    timeout = max(0.0, since + HOLD_S - time.monotonic()) if held else None
    if not select.select([0], [], [], timeout)[0]:  # Held long enough: no peer died.
      out.writelines(held)
      out.flush()
      held = []
      continue
    chunk = os.read(0, 1 << 16)
    if not chunk:
      break
    *lines, pending = (pending + chunk).split(b'\n')
    for line in (line + b'\n' for line in lines):
      if PEER_DIED.match(line):
        out.write(line)
        out.flush()
        while os.read(0, 1 << 16):  # The process is going; the rest of what it writes is its abort.
          pass
        return
      if not held and CPP_ERROR.match(line):
        since = time.monotonic()
      if held or CPP_ERROR.match(line):
        held.append(line)
      else:
        out.write(line)
    out.flush()
  out.writelines([*held, pending])
  out.flush()


if __name__ == '__main__':
  main()
