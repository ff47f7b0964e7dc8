"""The HTTP front door (built by a later issue)."""
