"""Synthetic tasks and text data."""
