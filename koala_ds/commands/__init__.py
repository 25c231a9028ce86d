"""Subcommands of the `koala` CLI, one module each (see koala_ds.cli)."""
