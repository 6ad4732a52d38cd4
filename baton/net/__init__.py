"""The job's data network: the paths its process groups use, and their state."""
