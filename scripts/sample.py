#!/usr/bin/env python
"""`mintrain.cli.sample` from a checkout; installed, it is the `mintrain-sample` command."""

import sys

from mintrain.cli.sample import main

if __name__ == '__main__':
  sys.exit(main())
