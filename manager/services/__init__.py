"""The manager's logic, usable without FastAPI."""
