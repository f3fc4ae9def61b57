"""Database tables and API shapes, one module per thing.

Nothing is imported here: a reader of one shape (the planner's path checks in ``common``) does not load
SQLModel and every table with it."""
