"""needle package."""
