"""Ray actors of raypar: thin shells over the pure runtime in `raypar`."""
