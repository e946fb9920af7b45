"""Token mixers (``nn.Module``): the Bayesian Layer and its baselines."""
