#!/usr/bin/env python
"""`mintrain.cli.inspect_checkpoint` from a checkout; installed, it is the `mintrain-inspect` command."""

import sys

from mintrain.cli.inspect_checkpoint import main

if __name__ == '__main__':
  sys.exit(main())
