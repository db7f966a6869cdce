"""The kvbridge conformance kit (a pytest plugin)."""
