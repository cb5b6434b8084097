"""kernel_toggles package."""
