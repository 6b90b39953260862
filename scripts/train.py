#!/usr/bin/env python
"""`mintrain.cli.train` from a checkout; installed, it is the `mintrain-train` command."""

import sys

from mintrain.cli.train import main

if __name__ == '__main__':
  sys.exit(main())
