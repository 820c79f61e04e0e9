"""The shop: orders are charged, shipped and receipted through reliable_messaging handlers."""
