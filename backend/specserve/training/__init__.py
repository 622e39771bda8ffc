"""Drafter training and its self-distilled data."""
