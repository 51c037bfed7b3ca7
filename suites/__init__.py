"""The distconf conformance suites: one file per area, every test marked with its spec ID."""
