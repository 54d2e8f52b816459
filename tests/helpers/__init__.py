"""Shared test helpers (tests/ is on sys.path through tests/conftest.py): import them as `helpers.<module>`;
test modules never import each other."""
