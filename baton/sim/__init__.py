"""Failure economics: closed-form cost model and Monte Carlo cluster simulator."""
