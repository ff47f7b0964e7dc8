"""The chaos harness: `tokenfleet up` under mixed load while processes are killed at random,
then every promise checked. `harness` runs it (scripts/chaos.py is its command line), `clients`
are the callers, `checks` judge what they saw."""
