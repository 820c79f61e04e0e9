"""Producers from other ecosystems (Node's amqplib, kombu) and the app that records what a
handler saw of their messages; used by tests/faults/test_foreign_producers.py."""
