"""HTTP routes: translation between requests and the library (manager.services, manager.launch, ...)."""
