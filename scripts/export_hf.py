#!/usr/bin/env python
"""`mintrain.cli.export_hf` from a checkout; installed, it is the `mintrain-export` command."""

import sys

from mintrain.cli.export_hf import main

if __name__ == '__main__':
  sys.exit(main())
