"""`python -m jaxspec.bench ...` is `jaxspec bench ...`."""

import sys

from jaxspec.cli import main

main(["bench", *sys.argv[1:]])
