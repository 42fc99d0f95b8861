"""Accuracy evaluation with the MLPerf benchmark metric."""
