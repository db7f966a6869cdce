"""State types: the built-in ``kv`` and the base class other state-type plugins build on."""
