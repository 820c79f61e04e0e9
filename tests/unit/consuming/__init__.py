"""Unit tests of reliable_messaging.consuming."""
