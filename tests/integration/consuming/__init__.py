"""Consuming against the real database and broker."""
