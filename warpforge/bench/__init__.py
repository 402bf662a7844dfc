"""`warpforge bench`: every kernel beside the best alternative a user has, in one process."""
