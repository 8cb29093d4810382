"""Runtime: Ray actors, the scheduler, resources and the driver. Knows no algorithm by name."""
