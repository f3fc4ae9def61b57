"""Logging in: browser sessions that stand for the API token, and the limit on wrong tokens.

Plain Python, no FastAPI: ``manager.deps`` and the login page use it.
"""
