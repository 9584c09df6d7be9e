"""Hyper-parameter search with Optuna: the study, the sweeper, and what a trial's rank 0 reports."""
