"""Consuming deliveries: the service and its connection thread, the worker threads, processing in
the inbox, the fast path and the guards.
"""
