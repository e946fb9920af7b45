"""Training: the pieces every experiment's training shares."""
