"""Importing this module loads NIXL's Python API the way the backend does (:func:`kvbridge_nixl.api.load`), for
a fork server's preload list (module names only): ``kvbridge demo``'s ranks and the test rigs' children.
Without NIXL installed the import raises, and a preload list skips it."""

from kvbridge_nixl.api import load

API = load()
