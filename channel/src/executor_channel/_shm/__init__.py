"""Within a node: shared-memory rings, their doorbells, fences and spinning, a worker's loop."""
