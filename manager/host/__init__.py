"""This box's engine processes: start one, end its whole group, find the engines nobody manages, free
the GPUs a stopped engine left held. Below the cluster (whose node agents run the same code on other
nodes) and the supervisor."""
