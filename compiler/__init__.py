"""vlmprune.compiler: frontend, reference pruner, parity, bundles and the CLI."""

__version__ = "0.1.0"
