"""The trainer's configuration: the typed sections of the YAML, the backend names it allows, the SP rules it checks."""
