#!/usr/bin/env python
"""`mintrain.cli.evaluate` from a checkout; installed, it is the `mintrain-eval` command."""

import sys

from mintrain.cli.evaluate import main

if __name__ == '__main__':
  sys.exit(main())
