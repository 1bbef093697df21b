"""Fitting a run to a GPU: the planner (predict each phase's memory, choose settings for a budget),
the model facts it reads, the fit probe (one real step before caching) and the spill watch."""
