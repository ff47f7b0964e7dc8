"""The commands: the `tokenfleet` CLI, the `up` launcher of a whole fleet on one machine, the
batch and bench client tools, and the Redis server launcher. The only package that imports
all the others."""
