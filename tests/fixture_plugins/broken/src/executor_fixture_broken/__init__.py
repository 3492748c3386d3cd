"""Plugins broken on purpose, to test that one bad plugin never hides the others."""
