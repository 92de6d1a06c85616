"""Helpers the tests share (not shipped)."""
