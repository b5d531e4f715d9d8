"""Helpers the tests import (tiny models, the project's facts and paths, things built once per
run); ``conftest.py`` holds only fixtures and hooks."""
