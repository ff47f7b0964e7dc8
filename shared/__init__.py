"""The contract between tokenfleet's parts: message types, errors, config, logging."""
