"""Model families (one folder each, models/<family>/), the protocol they answer, their registry,
the parts they share, and model sources."""
