"""Test fixture plugins: three broken on purpose (one bad plugin must never hide the others)
and one observer that records the worker-side hooks when asked to.

Never installed: a test that needs them takes the ``fixture_plugins`` fixture (conftest.py).
"""
