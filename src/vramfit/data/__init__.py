"""Training data: scanning and validating datasets, aspect-ratio bucketing, synthetic data."""
