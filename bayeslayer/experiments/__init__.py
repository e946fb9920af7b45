"""One module per experiment of the paper (docs/theory.md §8); each registers a CLI subcommand."""
