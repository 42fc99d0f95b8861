"""Product catalogues: the synthetic generator and the loader for real and synthetic data."""
