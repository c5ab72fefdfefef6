"""The producer side (torch-free): the plan, the slot ring, producers and their pool, the scheduler, the autoscaler."""
