#!/usr/bin/env python
"""`mintrain.cli.launch_local` from a checkout; installed, it is the `mintrain-launch` command."""

import sys

from mintrain.cli.launch_local import main

if __name__ == '__main__':
  sys.exit(main())
