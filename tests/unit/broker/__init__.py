"""Unit tests of reliable_messaging.broker."""
