"""Small CLI commands that belong to no subsystem."""
