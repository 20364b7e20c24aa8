"""inlinelm."""
