"""Language model, checkpoints and retrofit."""
