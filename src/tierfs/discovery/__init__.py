"""Finding the job's peers: the --peers grammar, DNS, and the current address list."""
