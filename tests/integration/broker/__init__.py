"""The broker tier against the real broker."""
