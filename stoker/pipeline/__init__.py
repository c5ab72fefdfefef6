"""The engine: the plan, the slot ring, producers and their pool, the scheduler, the autoscaler, the feed."""
