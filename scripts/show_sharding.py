#!/usr/bin/env python
"""`mintrain.cli.show_sharding` from a checkout; installed, it is the `mintrain-show-sharding` command."""

import sys

from mintrain.cli.show_sharding import main

if __name__ == '__main__':
  sys.exit(main())
