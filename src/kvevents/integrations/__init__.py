"""Adapters that put kvevents inside an engine (each imports its engine lazily)."""
