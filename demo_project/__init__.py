"""The demo shop for reliable_messaging: ``make demo`` runs it end to end."""
