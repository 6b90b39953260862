#!/usr/bin/env python
"""`mintrain.cli.plot_metrics` from a checkout; installed, it is the `mintrain-plot` command."""

import sys

from mintrain.cli.plot_metrics import main

if __name__ == '__main__':
  sys.exit(main())
