"""User entry points: the `pagedserve` command line."""
