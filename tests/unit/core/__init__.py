"""Unit tests of reliable_messaging.core."""
