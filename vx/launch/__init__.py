"""Running a job over many engines: the token-balanced partition plan, worker slots and processes on
one node, Ray tasks on a cluster, and the scale-out options they share."""
