"""`python -m vlmprune.compiler.cli`: the CLI itself, as `python -m` ran compiler/cli.py before it became a package
(the console script, compiler/__main__.py, adds the interrupt boundary around it)."""

from vlmprune.compiler.cli import main

main()
