"""One module per experiment of the paper (SPEC §4); each registers a CLI subcommand."""
