"""ringflow.integrations: shims that plug ringflow into inference engines."""
