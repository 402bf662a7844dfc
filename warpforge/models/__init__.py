"""Models built on warpforge ops."""
