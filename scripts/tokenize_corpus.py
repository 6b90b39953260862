#!/usr/bin/env python
"""`mintrain.cli.tokenize_corpus` from a checkout; installed, it is the `mintrain-tokenize` command."""

import sys

from mintrain.cli.tokenize_corpus import main

if __name__ == '__main__':
  sys.exit(main())
