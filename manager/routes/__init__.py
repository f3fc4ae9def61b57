"""HTTP routes: translation between requests and the library in manager.services."""
