"""Shared fixtures: see kvevents.testing for the public ones."""
